"""Prometheus and Grafana: the scrape targets match compose services and ports, and every dashboard query
names a metric that the gateway exports (service/metrics.py) or that Triton 2.51 exports. See
tests/deploy/test_compose.py for the other deployment checks."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from typing import Any

import pytest
import yaml

from tests.deploy.compose_files import port_spec, volume_mount
from tests.deploy.helpers import DEPLOY, container_port

pytest_plugins = ["tests.deploy.fixtures"]

#: Metrics of Triton 2.51: those of the bundled server (read from its /metrics), plus the GPU metrics
#: that the NGC server adds (Triton docs, "Metrics"); name -> labels.
_PER_MODEL = ("nv_inference_request_success", "nv_inference_request_failure", "nv_inference_count",
              "nv_inference_exec_count", "nv_inference_request_duration_us", "nv_inference_queue_duration_us",
              "nv_inference_compute_input_duration_us", "nv_inference_compute_infer_duration_us",
              "nv_inference_compute_output_duration_us", "nv_inference_pending_request_count")
_SERVER = ("nv_pinned_memory_pool_total_bytes", "nv_pinned_memory_pool_used_bytes", "nv_cpu_utilization",
           "nv_cpu_memory_total_bytes", "nv_cpu_memory_used_bytes")
_PER_GPU = ("nv_gpu_utilization", "nv_gpu_memory_total_bytes", "nv_gpu_memory_used_bytes",
            "nv_gpu_power_usage", "nv_gpu_power_limit", "nv_energy_consumption")
TRITON_METRICS: dict[str, set[str]] = {
    **{name: {"model", "version"} for name in _PER_MODEL},
    **{name: set() for name in _SERVER},
    **{name: {"gpu_uuid"} for name in _PER_GPU},
}


def _prometheus() -> dict[str, Any]:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert isinstance(config, dict)
    return config


def test_prometheus_scrapes_compose_services(models: dict[str, Any], app_routes: set[str]) -> None:
    services = models["gpu"]["services"]
    jobs = {job["job_name"]: job for job in _prometheus()["scrape_configs"]}
    assert {"triton", "gateway"} <= set(jobs)
    for name, job in jobs.items():
        for target in (t for config in job["static_configs"] for t in config["targets"]):
            host, port = target.split(":")
            if host == "localhost":
                continue
            assert host in services, f"{name}: {host} is not a compose service"
            assert container_port(services[host], port), f"{name}: {host} does not listen on {port}"
    assert jobs["gateway"].get("metrics_path", "/metrics") in app_routes
    assert jobs["triton"]["static_configs"][0]["targets"] == ["triton:8002"]
    mounts = [volume_mount(v) for v in services["prometheus"]["volumes"]]
    assert ("./deploy/prometheus/prometheus.yml", "/etc/prometheus/prometheus.yml", True) in mounts
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]


def test_prometheus_config_with_promtool() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    result = subprocess.run([promtool, "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture(scope="module")
def gateway_metrics() -> dict[str, set[str]]:
    """Sample names the gateway exports (as exposed: _total, _bucket, ...) -> their labels."""
    from service.metrics import Metrics

    metrics = Metrics()
    metrics.requests.labels("GET", "/health/live", "200").inc()
    metrics.latency.labels("GET", "/health/live").observe(0.01)
    metrics.triton_latency.observe(0.01)
    metrics.faces.observe(2)
    metrics.watch_gallery(lambda: {"default": 3}, lambda: (0, {"chosen": 1, "outdated": 0, "failed": 0}))
    names: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(set(sample.labels) - {"le"})
    return names


_FUNCTIONS_AND_KEYWORDS = {"sum", "avg", "max", "min", "count", "rate", "irate", "increase",
                           "histogram_quantile", "clamp_min", "clamp_max", "by", "without", "on", "ignoring",
                           "group_left", "group_right", "and", "or", "unless", "offset", "bool",
                           "label_values", "topk", "bottomk"}


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (label matchers, ranges, grouping and functions removed)."""
    stripped = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\b(by|without|on|ignoring)\s*\([^)]*\)|\"[^\"]*\"", " ", expr)
    tokens = re.findall(r"(?<![\w:$])[A-Za-z_:][\w:]*+(?!\s*\()", stripped)
    return {t for t in tokens if t not in _FUNCTIONS_AND_KEYWORDS and not re.fullmatch(r"e\d*|\d.*", t)}


def grouping_labels(expr: str) -> set[str]:
    return {label.strip() for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr)
            for label in group.split(",") if label.strip()}


def _dashboard() -> dict[str, Any]:
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "facerec.json").read_text())
    assert isinstance(dashboard, dict)
    return dashboard


def _queries(dashboard: dict[str, Any]) -> list[str]:
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable["type"] == "datasource":  # its query is a datasource type, not PromQL
            continue
        query = variable.get("query")
        queries.append(query["query"] if isinstance(query, dict) else str(query))
    return queries


def test_metric_name_check_can_fail() -> None:
    assert metric_names('sum by (route) (rate(facerec_bogus_total{route=~"a.b"}[5m])) / 1e-9') == \
        {"facerec_bogus_total"}
    expr = "histogram_quantile(0.99, sum by (le) (rate(x_bucket[$__rate_interval])))"
    assert metric_names(expr) == {"x_bucket"}
    assert metric_names("label_values(facerec_http_requests_total, route)") >= {"facerec_http_requests_total"}


def test_dashboard_queries_use_existing_metrics(gateway_metrics: dict[str, set[str]]) -> None:
    dashboard = _dashboard()
    known = {**gateway_metrics, **TRITON_METRICS}
    used: set[str] = set()
    for expr in _queries(dashboard):
        names = metric_names(expr) - {"route"}  # label_values(metric, label)
        unknown = names - set(known)
        assert not unknown, f"unknown metrics {unknown} in {expr}"
        labels = set().union(*(known[n] for n in names)) if names else set()
        assert grouping_labels(expr) <= labels | {"le"}, f"grouping by labels the metrics lack: {expr}"
        used |= names
    required = {"facerec_http_requests_total", "facerec_http_request_duration_seconds_bucket",
                "nv_inference_queue_duration_us", "nv_inference_compute_infer_duration_us",
                "nv_inference_request_success", "nv_inference_exec_count", "facerec_faces_per_request_bucket",
                "facerec_gallery_faces", "facerec_triton_request_duration_seconds_bucket"}
    assert required <= used, f"panels missing for {required - used}"


def test_dashboard_structure_and_provisioning(models: dict[str, Any]) -> None:
    dashboard = _dashboard()
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    provisioning = DEPLOY / "grafana" / "provisioning"
    datasources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    source = datasources["datasources"][0]
    # every query goes through the datasource variable, so an imported copy works with any Prometheus
    # (Kubernetes users import the file into their own Grafana); compose's provisioned one is the default
    (variable,) = (v for v in dashboard["templating"]["list"] if v["type"] == "datasource")
    assert variable["query"] == "prometheus" and source["isDefault"] is True
    chosen = {"type": "prometheus", "uid": f"${{{variable['name']}}}"}
    assert all(v["datasource"] == chosen for v in dashboard["templating"]["list"] if "datasource" in v)
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert {"h", "w", "x", "y"} <= set(grid) and grid["x"] + grid["w"] <= 24
        for target in panel.get("targets", []):
            assert target["datasource"] == chosen, panel["title"]
    services = models["gpu"]["services"]
    assert source["url"] == "http://prometheus:9090"
    published = [port_spec(p) for p in services["prometheus"]["ports"] if port_spec(p).published]
    assert any(p.target == "9090" for p in published)
    providers = yaml.safe_load((provisioning / "dashboards" / "facerec.yml").read_text())
    mounts = {mount.source: mount.target for mount in map(volume_mount, services["grafana"]["volumes"])}
    assert mounts["./deploy/grafana/dashboards"] == providers["providers"][0]["options"]["path"]
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
