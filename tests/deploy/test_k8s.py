"""Kubernetes (deploy/k8s): every manifest against the official schemas (kubernetes-validate, strict), the
ServiceMonitor CRD structurally, and the references between the objects. See tests/deploy/test_compose.py for
the other deployment checks."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from tests.deploy.compose_files import read_env_file
from tests.deploy.helpers import DOCKERFILES, K8S, clear_facerec_env, exposed_ports, need

pytest_plugins = ["tests.deploy.fixtures"]

#: Oldest and newest Kubernetes minor versions the manifests are validated against.
K8S_VERSIONS = ("1.27", "1.37")


def _k8s_documents(folder: Path = K8S) -> dict[tuple[str, str], dict[str, Any]]:
    documents = {}
    for path in sorted(folder.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for document in yaml.safe_load_all(path.read_text()):
            documents[(document["kind"], document["metadata"]["name"])] = document
    return documents


@pytest.fixture(scope="module")
def k8s() -> dict[tuple[str, str], dict[str, Any]]:
    return _k8s_documents()


@pytest.fixture(scope="module")
def kubernetes_validate() -> ModuleType:
    return need("kubernetes_validate", "kubernetes-validate==1.37.0")


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_k8s_manifests_match_the_official_schemas(version: str, k8s: dict[tuple[str, str], dict[str, Any]],
                                                  kubernetes_validate: ModuleType) -> None:
    for (kind, name), document in k8s.items():
        try:
            kubernetes_validate.validate(document, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(map(str, exc.path))
            pytest.fail(f"{kind}/{name} (Kubernetes {version}): {where}: {exc.message}")


def test_k8s_schema_check_can_fail(k8s: dict[tuple[str, str], dict[str, Any]],
                                   kubernetes_validate: ModuleType) -> None:
    broken = json.loads(json.dumps(k8s[("Deployment", "gateway")]))
    broken["spec"]["replica"] = 3
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)
    broken = json.loads(json.dumps(k8s[("Deployment", "triton")]))
    broken["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["httpGet"]["port"] = [8000]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[0], strict=True)


def _kustomization(folder: Path = K8S) -> dict[str, Any]:
    data = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert isinstance(data, dict)
    return data


def test_kustomization(k8s: dict[tuple[str, str], dict[str, Any]]) -> None:
    kustomization = _kustomization()
    resources = kustomization["resources"]
    assert sorted(resources) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    namespace = kustomization["namespace"]
    assert ("Namespace", namespace) in k8s
    generator = kustomization["secretGenerator"][0]
    example = read_env_file(K8S / (generator["envs"][0] + ".example"))
    assert set(example) == {"FACEREC_SECURITY__ADMIN_KEY", "FACEREC_DB_PASSWORD"}
    assert all("change-me" in value for value in example.values())
    images = {image["name"] for image in kustomization["images"]}
    containers = [c for d in k8s.values() if d["kind"] in ("Deployment", "StatefulSet")
                  for c in d["spec"]["template"]["spec"]["containers"]]
    assert images == {c["image"].split(":")[0] for c in containers if c["image"].startswith("facerec/")}
    for container in containers:
        for ref in (e["valueFrom"]["secretKeyRef"] for e in container.get("env", [])
                    if "secretKeyRef" in e.get("valueFrom", {})):
            assert ref["name"] == generator["name"] and ref["key"] in example
        for source in container.get("envFrom", []):
            if "secretRef" in source:
                assert source["secretRef"]["name"] == generator["name"]
            else:
                assert ("ConfigMap", source["configMapRef"]["name"]) in k8s


def _pod(document: dict[str, Any]) -> dict[str, Any]:
    pod = document["spec"]["template"]
    assert isinstance(pod, dict)
    return pod


def _container(document: dict[str, Any]) -> dict[str, Any]:
    container = _pod(document)["spec"]["containers"][0]
    assert isinstance(container, dict)
    return container


def test_k8s_triton(k8s: dict[tuple[str, str], dict[str, Any]]) -> None:
    deployment = k8s[("Deployment", "triton")]
    container, pod = _container(deployment), _pod(deployment)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["startupProbe"]["httpGet"]["path"].startswith("/v2/health/")
    for probe in ("readinessProbe", "livenessProbe"):  # the recognition probe; more in test_gpu.py
        assert "/opt/facerec/healthcheck.py" in container[probe]["exec"]["command"]
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 900, "first start: engine build"
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    env = {e["name"]: e.get("value") for e in container["env"]}
    # sized by the pod's CPU request: without a CPU limit the entrypoint's "auto" would see the whole node
    (instances,) = (e["valueFrom"]["resourceFieldRef"] for e in container["env"]
                    if e["name"] == "FACEREC_PIPELINE_INSTANCES")
    assert instances == {"containerName": container["name"], "resource": "requests.cpu"}
    assert int(container["resources"]["requests"]["cpu"]) >= 2
    engines = volumes[mounts[env["FACEREC_ENGINE_CACHE"]]]
    assert ("PersistentVolumeClaim", engines["persistentVolumeClaim"]["claimName"]) in k8s
    assert env["FACEREC_MODEL_REPOSITORY"].startswith(next(p for p in mounts if p == "/models") + "/")
    assert {str(p["containerPort"]) for p in container["ports"]} == exposed_ports(DOCKERFILES["triton"])
    assert pod["spec"]["securityContext"]["runAsUser"] == 10001
    assert deployment["spec"]["strategy"]["type"] == "Recreate"


def test_k8s_gateway(k8s: dict[tuple[str, str], dict[str, Any]], app_routes: set[str],
                     gateway_entry: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    deployment = k8s[("Deployment", "gateway")]
    container = _container(deployment)
    assert deployment["spec"]["replicas"] == 3
    assert container["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] in app_routes
    assert container["resources"]["requests"]["cpu"], "the CPU autoscaler needs a CPU request"
    # a stop lets requests finish, then writes the final snapshot: the pod must not be killed before
    assert _pod(deployment)["spec"]["terminationGracePeriodSeconds"] > gateway_entry.GRACEFUL_SHUTDOWN_S
    assert {str(p["containerPort"]) for p in container["ports"]} == exposed_ports(DOCKERFILES["gateway"])
    hpa = k8s[("HorizontalPodAutoscaler", "gateway")]
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "gateway")
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    assert hpa["spec"]["minReplicas"] == deployment["spec"]["replicas"]
    config = k8s[("ConfigMap", "facerec-gateway")]["data"]
    host, port = config["FACEREC_TRITON__URL"].split(":")
    assert int(port) in {p["port"] for p in k8s[("Service", host)]["spec"]["ports"] if p["name"] == "grpc"}
    database = k8s[("Service", config["FACEREC_DB_HOST"])]
    assert int(config["FACEREC_DB_PORT"]) == database["spec"]["ports"][0]["port"]
    clear_facerec_env(monkeypatch)
    secrets = {"FACEREC_SECURITY__ADMIN_KEY": "k" * 24, "FACEREC_DB_PASSWORD": "pw"}
    for name, value in {**config, **secrets}.items():
        monkeypatch.setenv(name, value)
    settings = gateway_entry.load_settings()
    assert settings.database.url.startswith("postgresql+psycopg://facerec:pw@postgres:5432/facerec")
    assert "change log" in (K8S / "gateway.yaml").read_text(), "explain why replicas stay consistent"


def test_k8s_postgres(k8s: dict[tuple[str, str], dict[str, Any]]) -> None:
    statefulset = k8s[("StatefulSet", "postgres")]
    service = k8s[("Service", statefulset["spec"]["serviceName"])]
    assert service["spec"]["clusterIP"] == "None"
    templates = statefulset["spec"]["volumeClaimTemplates"]
    mounts = {m["name"] for m in _container(statefulset)["volumeMounts"]}
    assert {t["metadata"]["name"] for t in templates} <= mounts
    assert "pg_isready" in _container(statefulset)["readinessProbe"]["exec"]["command"]
    # every gateway the HPA may run (plus a rollout's surge) with its engine's whole pool, and a few more
    # (migrations, python -m gallery, an operator's psql)
    from gallery.store.db import create_db_engine

    pool = create_db_engine("postgresql+psycopg://u@localhost/db").pool
    per_gateway = pool.size() + pool._max_overflow  # type: ignore[attr-defined]
    gateways = k8s[("HorizontalPodAutoscaler", "gateway")]["spec"]["maxReplicas"] + int(
        k8s[("Deployment", "gateway")]["spec"]["strategy"]["rollingUpdate"]["maxSurge"])
    args = _container(statefulset)["args"]
    limit = int(next(a.split("=")[1] for a in args if a.startswith("max_connections=")))
    assert limit >= gateways * per_gateway + 10, (limit, gateways, per_gateway)


def test_k8s_services_select_pods_and_ports(k8s: dict[tuple[str, str], dict[str, Any]]) -> None:
    workloads = [d for d in k8s.values() if d["kind"] in ("Deployment", "StatefulSet")]
    for (kind, name), service in k8s.items():
        if kind != "Service":
            continue
        selector = service["spec"]["selector"].items()
        matched = [w for w in workloads if selector <= _pod(w)["metadata"]["labels"].items()]
        assert len(matched) == 1, f"Service {name} selects {len(matched)} workloads"
        names = {p["name"] for p in _container(matched[0])["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in names, f"Service {name}: no container port {port['targetPort']}"
    for workload in workloads:
        labels = _pod(workload)["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
        annotations = _pod(workload)["metadata"].get("annotations", {})
        if annotations.get("prometheus.io/scrape") == "true":
            ports = {str(p["containerPort"]) for p in _container(workload)["ports"]}
            assert annotations["prometheus.io/port"] in ports


def test_k8s_service_monitors(k8s: dict[tuple[str, str], dict[str, Any]], kubernetes_validate: ModuleType,
                              app_routes: set[str]) -> None:
    folder = K8S / "prometheus-operator"
    kustomization = _kustomization(folder)
    assert "../" in kustomization["resources"]
    monitors = [d for d in yaml.safe_load_all((folder / "servicemonitor.yaml").read_text())]
    assert monitors
    assert set(kustomization["resources"]) == {"../", "servicemonitor.yaml", "prometheusrule.yaml"}
    # A CRD: not in the Kubernetes schemas, so checked here field by field.
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(monitors[0], K8S_VERSIONS[-1], strict=True)
    for monitor in monitors:
        assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "ServiceMonitor")
        assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
        assert set(monitor["spec"]) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}
        selector = monitor["spec"]["selector"]["matchLabels"].items()
        services = [d for (kind, _), d in k8s.items()
                    if kind == "Service" and selector <= d["metadata"]["labels"].items()]
        assert len(services) == 1, monitor["metadata"]["name"]
        ports = {p["name"] for p in services[0]["spec"]["ports"]}
        for endpoint in monitor["spec"]["endpoints"]:
            assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "scheme"}
            assert endpoint["port"] in ports and endpoint["path"] == "/metrics"
            assert re.fullmatch(r"\d+[smh]", endpoint["interval"])
