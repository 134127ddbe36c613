"""Static checks of the Milvus deployment: the compose profile (docker-compose.milvus.yml) and the
Kubernetes path through Milvus's own Helm chart (deploy/k8s/milvus). No Docker engine or cluster."""

from __future__ import annotations

import json
import re
import tomllib
from typing import Any

import pytest
import yaml

from tests import ROOT
from tests.deploy.compose_files import load_compose, load_model, plain, variables
from tests.deploy.helpers import COMPOSE, K8S, need
from tests.deploy.test_compose import SCHEMA, compose_problems

pytest_plugins = ["tests.deploy.fixtures"]

MILVUS_COMPOSE = ROOT / "docker-compose.milvus.yml"
HELM = K8S / "milvus"
MILVUS_SERVICES = {"milvus", "milvus-etcd", "milvus-minio"}


@pytest.fixture(scope="module")
def merged(example_env: dict[str, str]) -> dict[str, Any]:
    return load_model([COMPOSE, MILVUS_COMPOSE], example_env)


def test_milvus_profile_matches_the_compose_specification(merged: dict[str, Any],
                                                          example_env: dict[str, str]) -> None:
    jsonschema = need("jsonschema", "jsonschema>=4.23,<5")
    validator = jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))
    override = plain(load_model([MILVUS_COMPOSE], example_env))
    for model in (merged, override):
        errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(model)]
        assert errors == []


def test_milvus_profile_keeps_the_project_rules(merged: dict[str, Any]) -> None:
    assert set(merged["services"]) >= MILVUS_SERVICES
    assert compose_problems(merged) == []  # pinned images, healthchecks, service_healthy, declared volumes
    for name in MILVUS_SERVICES:
        service = merged["services"][name]
        assert service["profiles"] == ["milvus"], name  # opt-in: COMPOSE_PROFILES=milvus
        assert all(not str(v).startswith((".", "/")) for v in service.get("volumes", []))  # named volumes
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), (name, port)


def test_the_checks_can_fail(merged: dict[str, Any]) -> None:
    broken = json.loads(json.dumps(merged))
    del broken["services"]["milvus"]["healthcheck"]
    broken["services"]["milvus-minio"]["image"] = "minio/minio:latest"
    problems = compose_problems(broken)
    assert any("milvus: no healthcheck" in p for p in problems)
    assert any("gateway -> milvus" in p for p in problems)
    assert any("milvus-minio: pin the image tag" in p for p in problems)


def test_gateway_reaches_milvus_and_waits_for_it(merged: dict[str, Any]) -> None:
    gateway, milvus = merged["services"]["gateway"], merged["services"]["milvus"]
    env = gateway["environment"]
    assert env["FACEREC_GALLERY__BACKEND"] == "milvus"
    assert re.fullmatch(r"http://milvus:19530", env["FACEREC_GALLERY__MILVUS_URI"])
    assert gateway["depends_on"]["milvus"]["condition"] == "service_healthy"
    assert milvus["environment"]["ETCD_ENDPOINTS"].split(":")[0] in merged["services"]
    assert milvus["environment"]["MINIO_ADDRESS"].split(":")[0] in merged["services"]
    # the MinIO secret is required, and the same for MinIO and Milvus
    raw = load_compose(MILVUS_COMPOSE)
    required = {name for name, op, _ in variables(raw) if op in (":?", "?")}
    assert required == {"MINIO_ROOT_PASSWORD"}
    assert (milvus["environment"]["MINIO_SECRET_ACCESS_KEY"]
            == merged["services"]["milvus-minio"]["environment"]["MINIO_ROOT_PASSWORD"])


def milvus_tag(image: str) -> tuple[int, int]:
    match = re.fullmatch(r"milvusdb/milvus:v(\d+)\.(\d+)\.\d+", image)
    assert match, image
    return int(match.group(1)), int(match.group(2))


def test_server_versions_match_the_pinned_milvus_lite(merged: dict[str, Any]) -> None:
    """Compose, the Helm values and the tested engine (milvus-lite) are one Milvus line (2.4)."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    lite = next(r for r in extras["dev"] if r.startswith("milvus-lite=="))
    major, minor = (int(p) for p in lite.removeprefix("milvus-lite==").split(".")[:2])
    values = yaml.safe_load((HELM / "values.yaml").read_text())
    helm_image = f"{values['image']['all']['repository']}:{values['image']['all']['tag']}"
    assert milvus_tag(merged["services"]["milvus"]["image"]) == milvus_tag(helm_image) == (major, minor)


def gibibytes(quantity: str) -> float:
    number, unit = re.fullmatch(r"(\d+(?:\.\d+)?)(Gi|Mi)", quantity).groups()  # type: ignore[union-attr]
    return float(number) / (1024 if unit == "Mi" else 1)


def test_helm_values_are_a_durable_cluster_sized_for_ten_million_faces() -> None:
    values = yaml.safe_load((HELM / "values.yaml").read_text())
    assert values["cluster"]["enabled"] is True
    assert values["etcd"]["replicaCount"] >= 3 and values["etcd"]["persistence"]["enabled"] is True
    assert values["minio"]["mode"] == "distributed" and values["minio"]["persistence"]["enabled"] is True
    query = values["queryNode"]
    vectors_gib = 10_000_000 * 512 * 4 / 2**30  # FLAT keeps float32 vectors in the query nodes' memory
    assert query["replicas"] * gibibytes(query["resources"]["requests"]["memory"]) >= 1.3 * vectors_gib
    brokers = [name for name in ("pulsar", "pulsarv3", "kafka") if values[name]["enabled"]]
    assert brokers == ["pulsar"], brokers  # exactly one log broker, the one chart 4.2.24 wires Milvus 2.4 to
    # chart 4.2.4+ runs coordination in the mixCoordinator (the separate coordinators are off by default):
    # disabling it leaves a cluster with no coordinator at all
    assert values.get("mixCoordinator", {}).get("enabled", True) is True
    assert not any(values.get(f"{role}Coordinator", {}).get("enabled")
                   for role in ("root", "query", "data", "index"))
    # the chart release built for the pinned server, in the values' own command and in the docs
    assert values["image"]["all"]["tag"] == "v2.4.17"
    for text in ((HELM / "values.yaml").read_text(), (ROOT / "docs" / "deploy.md").read_text()):
        assert "milvus/milvus --namespace facerec --version 4.2.24 " in text


def test_kustomize_overlay_switches_the_gateways_to_the_chart_service(
        kubernetes_validate: Any = None) -> None:
    kustomization = yaml.safe_load((HELM / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["../"]
    (patch,) = kustomization["patches"]
    overlay = yaml.safe_load((HELM / patch["path"]).read_text())
    base = next(d for d in yaml.safe_load_all((K8S / "gateway.yaml").read_text())
                if d["kind"] == "ConfigMap" and d["metadata"]["name"] == overlay["metadata"]["name"])
    merged = {**base, "data": {**base["data"], **overlay["data"]}}
    validate = need("kubernetes_validate", "kubernetes-validate==1.37.0")
    validate.validate(merged, "1.37", strict=True)
    assert merged["data"]["FACEREC_GALLERY__BACKEND"] == "milvus"
    # `helm install facerec-milvus ...` (values.yaml) names the proxy Service facerec-milvus
    release = re.search(r"helm install (\S+) milvus/milvus", (HELM / "values.yaml").read_text())
    assert release and merged["data"]["FACEREC_GALLERY__MILVUS_URI"] == f"http://{release.group(1)}:19530"
    assert not any(p.name.endswith(".yaml") and "StatefulSet" in p.read_text() for p in HELM.iterdir())
