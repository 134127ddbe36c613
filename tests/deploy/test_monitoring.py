"""Prometheus, its alerting rules and Grafana: the scrape targets match compose services and ports, every
dashboard query and every alerting rule names a metric that the gateway exports (service/metrics.py) or that
Triton 2.51 exports, the rules pass promtool, the PrometheusRule holds the same rules, and docs/deploy.md says
what each alert means. tests/deploy/test_alerts.py runs them on a live stack; see tests/deploy/test_compose.py
for the other deployment checks."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import ROOT
from tests.deploy.compose_files import port_spec, volume_mount
from tests.deploy.helpers import DEPLOY, K8S, container_port
from tests.deploy.monitoring import (
    ALERT_RULES,
    PROMETHEUS_CONFIG,
    PROMETHEUS_RULE,
    alert_rules,
    dashboard,
    grouping_labels,
    load_yaml,
    metric_names,
    panel_queries,
    variable_queries,
)

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


def test_prometheus_scrapes_compose_services(models: dict[str, Any], app_routes: set[str]) -> None:
    services = models["gpu"]["services"]
    config = load_yaml(PROMETHEUS_CONFIG)
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
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
    # rule_files are relative to the configuration file: mounted beside it
    assert config["rule_files"] == [ALERT_RULES.name]
    assert ("./deploy/prometheus/alerts.yml", "/etc/prometheus/alerts.yml", True) in mounts


def _promtool(*args: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    result = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_config_with_promtool() -> None:
    _promtool("check", "config", str(PROMETHEUS_CONFIG))  # also reads its rule files


def test_alert_rules_with_promtool(tmp_path: Path) -> None:
    _promtool("check", "rules", str(ALERT_RULES))
    operator_rules = tmp_path / "prometheusrule-groups.yml"
    operator_rules.write_text(yaml.safe_dump(load_yaml(PROMETHEUS_RULE)["spec"]))
    _promtool("check", "rules", str(operator_rules))


def test_triton_restarted_rule_with_promtool(tmp_path: Path) -> None:
    """FacerecTritonRestarted fires on one restart and stops 15 minutes later: the gateway that exports the
    counter runs its own tritonserver, which the live stack of test_alerts.py does not, so promtool's rule
    unit test feeds it the series a hung restart gives (`tests/service/test_hung.py` counts it for real)."""
    series = "facerec_triton_restarts_total{job='gateway', instance='gw:8080', reason='hung'}"
    case = {
        "rule_files": [str(ALERT_RULES)],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            # no restart for 10 minutes, one at minute 10, none after
            "input_series": [{"series": series, "values": "0x9 1x40"}],
            "alert_rule_test": [
                {"eval_time": "9m", "alertname": "FacerecTritonRestarted", "exp_alerts": []},
                {"eval_time": "12m", "alertname": "FacerecTritonRestarted", "exp_alerts": [{
                    "exp_labels": {"severity": "warning", "job": "gateway", "instance": "gw:8080",
                                   "reason": "hung"},
                    "exp_annotations": {key: value.replace("{{ $labels.instance }}", "gw:8080")
                                        .replace("{{ $labels.reason }}", "hung")
                                        for key, value in restarted_rule()["annotations"].items()},
                }]},
                {"eval_time": "40m", "alertname": "FacerecTritonRestarted", "exp_alerts": []},
            ],
        }],
    }
    tests = tmp_path / "restarted-test.yml"
    tests.write_text(yaml.safe_dump(case))
    _promtool("test", "rules", str(tests))


def restarted_rule() -> dict[str, Any]:
    (rule,) = (rule for rule in alert_rules() if rule["alert"] == "FacerecTritonRestarted")
    return rule


@pytest.fixture(scope="module")
def gateway_metrics() -> dict[str, set[str]]:
    """Sample names the gateway exports (as exposed: _total, _bucket, ...) -> their labels."""
    from types import SimpleNamespace

    from facecore.probe import ProbeResult
    from service.admission import Admission
    from service.metrics import ChangeLogPositions, Metrics, TritonRestarts

    metrics = Metrics()
    metrics.requests.labels("GET", "/health/live", "200").inc()
    metrics.latency.labels("GET", "/health/live").observe(0.01)
    metrics.triton_latency.observe(0.01)
    metrics.faces.observe(2)
    metrics.watch_admission(Admission(4))
    metrics.watch_gallery(lambda: {"default": 3}, lambda: (0, {"chosen": 1, "outdated": 0, "failed": 0}))
    metrics.watch_probe(SimpleNamespace(triton_ready=True, last=ProbeResult(True, "ok", 0.0), failures=0))
    positions = ChangeLogPositions(lambda: 5, lambda: 5)
    positions.refresh()  # the head is read in a thread in the gateway
    metrics.registry.register(positions)
    metrics.registry.register(TritonRestarts(lambda: {"exited": 0, "hung": 1}))  # python -m service's
    names: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(set(sample.labels) - {"le"})
    return names


def test_metric_name_check_can_fail() -> None:
    assert metric_names('sum by (route) (rate(facerec_bogus_total{route=~"a.b"}[5m])) / 1e-9') == \
        {"facerec_bogus_total"}
    expr = "histogram_quantile(0.99, sum by (le) (rate(x_bucket[$__rate_interval])))"
    assert metric_names(expr) == {"x_bucket"}
    assert metric_names("label_values(facerec_http_requests_total, route)") >= {"facerec_http_requests_total"}


def test_dashboard_queries_use_existing_metrics(gateway_metrics: dict[str, set[str]]) -> None:
    known = {**gateway_metrics, **TRITON_METRICS}
    used: set[str] = set()
    for expr in [query.expr for query in panel_queries()] + variable_queries():
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
    board = dashboard()
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    provisioning = DEPLOY / "grafana" / "provisioning"
    datasources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    source = datasources["datasources"][0]
    # every query goes through the datasource variable, so an imported copy works with any Prometheus
    # (Kubernetes users import the file into their own Grafana); compose's provisioned one is the default
    (variable,) = (v for v in board["templating"]["list"] if v["type"] == "datasource")
    assert variable["query"] == "prometheus" and source["isDefault"] is True
    chosen = {"type": "prometheus", "uid": f"${{{variable['name']}}}"}
    assert all(v["datasource"] == chosen for v in board["templating"]["list"] if "datasource" in v)
    for panel in board["panels"]:
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


# --- alerting rules ----------------------------------------------------------------------------------------

#: Labels every series carries once scraped (the target's), beside its own.
TARGET_LABELS = {"job", "instance"}


def test_alert_rules_use_existing_metrics(gateway_metrics: dict[str, set[str]]) -> None:
    known = {**gateway_metrics, **TRITON_METRICS, "up": set()}
    used: set[str] = set()
    for rule in alert_rules():
        names = metric_names(rule["expr"])
        unknown = names - set(known)
        assert not unknown, f"{rule['alert']}: unknown metrics {unknown}"
        labels = set().union(*(known[n] for n in names)) | TARGET_LABELS | {"le"}
        assert grouping_labels(rule["expr"]) <= labels, f"{rule['alert']}: grouping by absent labels"
        assert set(re.findall(r"\$labels\.(\w+)", str(rule["annotations"]))) <= labels, rule["alert"]
        used |= names
    assert {"up", "facerec_triton_ready", "facerec_recognition_probe_ok", "facerec_http_requests_total",
            "facerec_http_request_duration_seconds_bucket", "facerec_shed_requests_total",
            "facerec_gallery_changelog_head", "facerec_gallery_changelog_applied",
            "facerec_gallery_snapshot_failures_total", "facerec_triton_restarts_total"} <= used


def test_alert_rules_are_named_graded_and_documented() -> None:
    rules = alert_rules()
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names)) and all(name.startswith("Facerec") for name in names)
    assert {"FacerecTritonDown", "FacerecTritonNotReady", "FacerecRecognitionProbeFailing",
            "FacerecTritonRestarted", "FacerecErrorRate", "FacerecLatencyAboveSLO", "FacerecLoadShedding",
            "FacerecFollowerLagging", "FacerecSnapshotFailing"} <= set(names)
    deploy = (ROOT / "docs" / "deploy.md").read_text()
    operations = deploy[deploy.index("\n## Operations\n"):]
    operations = operations[:operations.find("\n## ", 1)] if "\n## " in operations[1:] else operations
    documented = re.findall(r"^### (Facerec\w+)$", operations, flags=re.MULTILINE)
    assert documented == names, "docs/deploy.md's Operations: one `### <alert>` per rule, in the rules' order"
    for rule in rules:
        assert rule["labels"]["severity"] in {"critical", "warning"}, rule["alert"]
        assert set(rule["annotations"]) == {"summary", "description", "runbook"}, rule["alert"]
        assert rule["annotations"]["runbook"] == f"docs/deploy.md#{rule['alert'].lower()}"
        assert re.fullmatch(r"\d+[smh]", rule.get("for", "0s")), rule["alert"]


def test_prometheus_rule_holds_the_same_rules() -> None:
    """The rules live once: the PrometheusRule's spec is alerts.yml's groups, and the operator's
    kustomization applies it with the label its ServiceMonitors carry."""
    resource = load_yaml(PROMETHEUS_RULE)
    assert (resource["apiVersion"], resource["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert set(resource) == {"apiVersion", "kind", "metadata", "spec"}
    assert resource["spec"] == load_yaml(ALERT_RULES), \
        "prometheusrule.yaml's spec differs from deploy/prometheus/alerts.yml: copy its groups into it"
    folder = K8S / "prometheus-operator"
    assert PROMETHEUS_RULE.name in load_yaml(folder / "kustomization.yaml")["resources"]
    monitors = list(yaml.safe_load_all((folder / "servicemonitor.yaml").read_text()))
    releases = {monitor["metadata"]["labels"]["release"] for monitor in monitors}
    assert releases == {resource["metadata"]["labels"]["release"]}
