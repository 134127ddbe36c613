"""The Dockerfiles, parsed with BuildKit's parser (the `dockerfile` package): pinned bases, non-root users,
healthchecks, COPY sources present and not excluded by .dockerignore, and the dependencies of what runs in
each image. See tests/deploy/test_compose.py for the other deployment checks."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from tests import ROOT
from tests.deploy.helpers import (
    DEPLOY,
    DOCKERFILES,
    base_images,
    exposed_ports,
    final_stage,
    instruction_text,
    need,
    parse_dockerfile,
    pyproject,
    stage_names,
)

FIRST_PARTY = {"facecore", "export", "service", "gallery", "recognition"}
#: Imported only when installed (inside try/except), so an image may lack them.
OPTIONAL_IMPORTS = {"watchfiles",  # uvicorn: --reload
                    "pygments"}  # mako (alembic's templates): syntax highlighting


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


def test_triton_image() -> None:
    instructions = parse_dockerfile(DOCKERFILES["triton"])
    assert base_images(instructions)[-1] == "nvcr.io/nvidia/tritonserver:24.10-py3"
    final = final_stage(DOCKERFILES["triton"])
    assert exposed_ports(DOCKERFILES["triton"]) == {"8000", "8001", "8002"}
    entrypoint = [v for i in final if i.cmd == "ENTRYPOINT" for v in i.value]
    assert entrypoint[-1] == "/opt/facerec/entrypoint.py"
    copies = instruction_text(final, "COPY")
    assert "deploy/triton/entrypoint.py /opt/facerec/entrypoint.py" in copies
    runs = instruction_text(instructions, "RUN")
    assert "python -m export defaults --profiles gpu" in runs
    assert '"numpy>=1.26,<2"' in runs and '"opencv-python-headless>=4.9,<4.12"' in runs
    assert "pip install --no-deps /tmp/facerec" in runs
    # The stub must come from the same Triton release as the bundled server (the `server` extra).
    pinned = (DEPLOY / "triton" / "pytriton-requirements.txt").read_text()
    requirement = re.search(r"^(nvidia-pytriton==[\d.]+) --hash=sha256:[0-9a-f]{64}$", pinned, re.MULTILINE)
    assert requirement and requirement[1] in pyproject()["project"]["optional-dependencies"]["server"]


def test_gateway_image() -> None:
    final = final_stage(DOCKERFILES["gateway"])
    instructions = parse_dockerfile(DOCKERFILES["gateway"])
    runs = instruction_text(instructions, "RUN")
    assert '".[cpu]"' in runs and "pytriton" not in runs and "[server" not in runs
    assert exposed_ports(DOCKERFILES["gateway"]) == {"8080"}
    assert "/health/live" in instruction_text(final, "HEALTHCHECK")
    command = [v for i in final if i.cmd == "CMD" for v in i.value]
    assert command[:2] == ["python", "/opt/facerec/entrypoint.py"] and "0.0.0.0" in command


def test_cpu_triton_image() -> None:
    """The NGC CPU variant: the NGC tritonserver image (its entrypoint kept), the `ngc-cpu` repository
    written by the exporter at build, OpenVINO in the venv for the Python-backend networks."""
    stages = parse_dockerfile(DOCKERFILES["cpu-triton"])
    final = final_stage(DOCKERFILES["cpu-triton"])
    froms = [i.value[0] for i in stages if i.cmd == "FROM"]
    assert froms[-1] == "${TRITON_IMAGE}" and not [i for i in final if i.cmd == "ENTRYPOINT"]
    args = dict(i.value[0].split("=", 1) for i in stages if i.cmd == "ARG" and "=" in i.value[0])
    assert args["TRITON_IMAGE"].startswith("nvcr.io/nvidia/tritonserver:")
    assert args["TRITON_IMAGE"].endswith("-py3")
    build = instruction_text(stages, "RUN")
    assert "--profiles ngc-cpu" in build and "--repository /out" in build
    runs = instruction_text(final, "RUN")
    assert "openvino>=" in runs and "numpy>=1.26,<2" in runs
    assert "test -d /opt/tritonserver/backends/openvino" in runs
    command = [v for i in final if i.cmd == "CMD" for v in i.value]
    assert command[0] == "tritonserver"
    assert "--model-repository=/opt/facerec/model_repository/ngc-cpu" in command


def _requirement_names(requirements: Sequence[str]) -> dict[str, set[str]]:
    """Normalized distribution name -> requested extras."""
    packaging_requirements = need("packaging.requirements", "packaging")
    names: dict[str, set[str]] = {}
    for text in requirements:
        requirement = packaging_requirements.Requirement(text)
        names.setdefault(_normalize(requirement.name), set()).update(requirement.extras)
    return names


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(roots: dict[str, set[str]]) -> set[str]:
    """The distributions that installing ``roots`` brings (as installed here), following markers."""
    packaging_requirements = need("packaging.requirements", "packaging")
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
    project = pyproject()["project"]
    text = instruction_text(parse_dockerfile(DOCKERFILES["gateway"]), "RUN")
    extras = [e for group in re.findall(r'pip install (?:-e )?"\.(?:\[([\w,]*)\])?"', text)
              for e in group.split(",") if e]
    optional = project["optional-dependencies"]
    requirements = [*project["dependencies"], *(r for e in extras for r in optional[e]),
                    *(a for a in _pip_arguments(DOCKERFILES["gateway"]) if not a.startswith("."))]
    allowed = _closure(_requirement_names(requirements))
    imported = _imported_distributions(
        "import service.app, gallery.store.db, gallery.gallery, faiss, uvicorn")
    assert imported - allowed == set(), "the gateway image does not install these"


def test_triton_image_installs_what_face_pipeline_and_the_engine_build_import() -> None:
    args = _pip_arguments(DOCKERFILES["triton"], lambda stage: stage == 1)
    allowed = _closure(_requirement_names(args))
    imported = _imported_distributions(
        "import facecore.pipeline, facecore.processing, facecore.triton_config, facecore.probe, "
        "export.__main__, export.tensorrt_build, export.engine_cache, export.engine_check, "
        "export.tensorrt_runner")
    assert imported - allowed == set(), "the Triton image does not install these"

