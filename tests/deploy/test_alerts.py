"""The alerting rules and the Grafana dashboard on a live stack: Debian's real Prometheus scrapes a real
Triton (started here, so that the test can stop it) and a real gateway on it every second and evaluates
deploy/prometheus/alerts.yml every second. Every dashboard query returns data, every rule evaluates and
none fires on the healthy stack, and FacerecTritonDown and FacerecTritonNotReady (their ``for:`` shortened)
fire once Triton is stopped and clear once it is back. The static checks of the same files are in
tests/deploy/test_monitoring.py."""

from __future__ import annotations

import math
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import yaml

from service.launcher import TritonPorts, TritonServer
from tests.conftest import free_ports
from tests.deploy.monitoring import (
    ALERT_RULES,
    PROMETHEUS_CONFIG,
    alert_rules,
    load_yaml,
    metric_names,
    panel_queries,
)

if TYPE_CHECKING:
    from tests.service.live_fixtures import Live, StartLive

pytest_plugins = ["tests.service.live_fixtures"]

pytestmark = pytest.mark.triton

PROMETHEUS = Path("/usr/bin/prometheus")
#: Grafana's ``$__rate_interval`` as the queries get it here: long enough to hold the whole test's traffic.
RATE_INTERVAL = "1m"
#: The alerts the test makes fire by stopping Triton, with their ``for:`` shortened to this.
#: Exported only by a gateway that runs its own tritonserver (``python -m service``).
LAUNCHER_ONLY = {"facerec_triton_restarts_total"}
STOPPED_TRITON_ALERTS = ("FacerecTritonDown", "FacerecTritonNotReady")
TEST_FOR = "2s"


class Prometheus:
    """A prometheus process's HTTP API."""

    def __init__(self, base: str) -> None:
        self.base = base

    def get(self, path: str, **params: str) -> Any:
        response = httpx.get(self.base + path, params=params, timeout=10)
        body = response.json()
        assert response.status_code == 200 and body["status"] == "success", (path, params, body)
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        return list(data["result"])

    def active_alerts(self) -> dict[str, str]:
        """Alert name -> state (pending or firing) of the alerts active now."""
        alerts = self.get("/api/v1/alerts")["alerts"]
        return {alert["labels"]["alertname"]: alert["state"] for alert in alerts}


def render_config(folder: Path, targets: dict[str, str]) -> Path:
    """prometheus.yml with its jobs pointed at ``targets`` (job -> host:port), scraping and evaluating
    every second, and alerts.yml with the ``for:`` of ``STOPPED_TRITON_ALERTS`` shortened."""
    rules = load_yaml(ALERT_RULES)
    for rule in alert_rules(rules):
        if rule["alert"] in STOPPED_TRITON_ALERTS:
            rule["for"] = TEST_FOR
    (folder / "alerts.yml").write_text(yaml.safe_dump(rules))
    config = load_yaml(PROMETHEUS_CONFIG)
    config["global"].update(scrape_interval="1s", scrape_timeout="900ms", evaluation_interval="1s")
    assert config["rule_files"] == ["alerts.yml"]  # relative to the configuration file, as in compose
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": [targets[job["job_name"]]]}]
    path = folder / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@contextmanager
def prometheus(folder: Path, targets: dict[str, str], port: int) -> Iterator[Prometheus]:
    config = render_config(folder, {**targets, "prometheus": f"127.0.0.1:{port}"})
    log = (folder / "prometheus.log").open("wb")
    command = [str(PROMETHEUS), f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
               f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        api = Prometheus(f"http://127.0.0.1:{port}")
        wait_for(lambda: _answers(api.base + "/-/ready"), 30, "Prometheus ready",
                 lambda: (folder / "prometheus.log").read_text())
        yield api
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def wait_for(condition: Callable[[], bool], timeout: float, what: str,
             explain: Callable[[], object] = lambda: "") -> float:
    """Poll until ``condition()``; returns the seconds it took."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            pytest.fail(f"{what}: not within {timeout} s\n{explain()}")
        time.sleep(0.2)
    return time.monotonic() - started


def traffic(live: Live, key: str, photos: dict[str, Path], rounds: int = 4) -> None:
    """Enroll, identify, detect and a bad request, in rounds a little more than a scrape apart, so that
    every counter rises between scrapes (a series that appears and never rises again has a rate of 0)."""
    face = ("obama.jpg", photos["obama.jpg"].read_bytes(), "image/jpeg")
    group = ("t1.jpg", photos["t1.jpg"].read_bytes(), "image/jpeg")
    with httpx.Client(base_url=live.base, headers={"X-API-Key": key}, timeout=60) as client:
        for number in range(rounds):
            enrolled = client.post(f"/v1/collections/people/identities/person{number}/faces",
                                   params={"create": "true"}, files={"images": face})
            assert enrolled.status_code == 201, enrolled.text
            for path in ("/v1/collections/people/identify", "/v1/detect"):
                answer = client.post(path, files={"image": group})
                assert answer.status_code == 200, answer.text
            bad = client.post("/v1/detect", files={"image": ("x.jpg", b"not an image", "image/jpeg")})
            assert 400 <= bad.status_code < 500, bad.text
            time.sleep(1.2)


def finite(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(series["value"][1])) for series in result)


def test_dashboard_and_alerts_on_a_live_stack(live_api: StartLive, cpu_repository: Path,
                                              photos: dict[str, Path], tmp_path: Path) -> None:
    if not PROMETHEUS.is_file() or shutil.which("promtool") is None:
        pytest.skip("Debian's prometheus is not installed (apt-get install prometheus; .ci/run does)")
    triton = TritonServer(cpu_repository, TritonPorts(*free_ports(3)), log_file=tmp_path / "triton.log")
    try:
        triton.start()
        live = live_api(triton_url=triton.grpc_url, triton={"probe_interval_s": 1.0})
        targets = {"triton": f"127.0.0.1:{triton.ports.metrics}", "gateway": f"{live.host}:{live.port}"}
        with prometheus(tmp_path, targets, free_ports(1)[0]) as api:
            wait_for(lambda: len([s for s in api.query("up == 1")]) == 3, 20, "every target scraped")
            key = live.collection_with_key("people")
            traffic(live, key, photos)
            check_panels(api)
            check_rules(api)

            def identify() -> httpx.Response:
                return httpx.post(f"{live.base}/v1/collections/people/identify", headers={"X-API-Key": key},
                                  files={"image": ("t1.jpg", photos["t1.jpg"].read_bytes())}, timeout=60)

            check_triton_down(api, triton, identify)
    finally:
        triton.stop()


def check_panels(api: Prometheus) -> None:
    """Every panel's every query, as Grafana sends it with the route variable at "All", has data."""
    gpu = bool(api.query('count({__name__=~"nv_gpu_.*"})'))
    for query in panel_queries():
        expr = query.expr.replace("$__rate_interval", RATE_INTERVAL).replace('"$route"', '".*"')
        assert "$" not in expr, expr
        result = api.query(expr)
        if "nv_gpu_" in expr and not gpu:  # Triton exports GPU metrics only where it uses a GPU
            assert result == [], f"{query.panel}: GPU data without GPU metrics?"
            continue
        assert finite(result), f"{query.panel} ({query.legend}): no data for {expr}: {result}"
    routes = set(api.get("/api/v1/label/route/values", **{"match[]": "facerec_http_requests_total"}))
    assert {"/v1/detect", "/v1/collections/{collection}/identify",
            "/v1/collections/{collection}/identities/{external_id}/faces"} <= routes


def check_rules(api: Prometheus) -> None:
    """Every rule's metrics have data, every rule evaluates without error, and none fires here."""
    for rule in alert_rules():
        # the gateway here runs no tritonserver of its own; test_monitoring.py tests that rule with promtool
        for name in metric_names(rule["expr"]) - LAUNCHER_ONLY:
            wait_for(lambda name=name: bool(api.query(f"count({name})")), 10,
                     f"{rule['alert']}: data for {name}")
        api.query(rule["expr"])  # evaluates: an error is a 400
    # the index applied every change the database logged: the follower-lag rule's two gauges agree
    agree = ("facerec_gallery_changelog_head == facerec_gallery_changelog_applied"
             " and facerec_gallery_changelog_head >= 4")  # the four enrollments
    wait_for(lambda: finite(api.query(agree)), 10, "the change log's positions")
    groups = api.get("/api/v1/rules", type="alert")["groups"]
    evaluated = [rule for group in groups for rule in group["rules"]]
    assert sorted(rule["name"] for rule in evaluated) == sorted(rule["alert"] for rule in alert_rules())
    for rule in evaluated:
        assert rule["health"] == "ok", rule
    firing = {name: state for name, state in api.active_alerts().items() if state == "firing"}
    assert firing == {}, "alerts firing on a healthy stack"


def check_triton_down(api: Prometheus, triton: TritonServer, identify: Callable[[], httpx.Response]) -> None:
    """Stop Triton: both alerts fire (Prometheus's scrape fails; the gateway's probe finds it not ready),
    and the dashboard's share of 5xx counts the 503 of an identify; start it again: both alerts clear.
    Prints how long each took."""
    def states() -> dict[str, str]:
        active = api.active_alerts()
        return {name: active.get(name, "inactive") for name in STOPPED_TRITON_ALERTS}

    assert states() == dict.fromkeys(STOPPED_TRITON_ALERTS, "inactive")
    stopping = time.monotonic()
    triton.stop()
    stop_s = time.monotonic() - stopping
    fired = stop_s + wait_for(lambda: set(states().values()) == {"firing"}, 30, "alerts firing", states)
    for _ in range(2):  # a scrape apart: rate() sees no increase in a series' first sample
        failed = identify()
        assert failed.status_code == 503 and failed.json()["code"] == "triton_unavailable", failed.text
        time.sleep(1.5)
    (errors,) = (q.expr for q in panel_queries() if q.legend == "5xx")
    errors = errors.replace("$__rate_interval", RATE_INTERVAL)
    wait_for(lambda: float(api.query(errors)[0]["value"][1]) > 0, 10, "the 503 on the dashboard")
    starting = time.monotonic()
    triton.start()
    start_s = time.monotonic() - starting
    cleared = wait_for(lambda: set(states().values()) == {"inactive"}, 30, "alerts cleared", states)
    print(f"\n{' and '.join(STOPPED_TRITON_ALERTS)} (for: {TEST_FOR}; scrapes and evaluations every 1 s): "
          f"firing {fired:.1f} s after Triton's stop began (the stop took {stop_s:.1f} s), inactive "
          f"{cleared:.1f} s after it was ready again (the start took {start_s:.1f} s)")
