"""The GPU deployment: Triton healthchecks that run the recognition probe, the NGC entrypoint chain,
the engine lifecycle in the image's entrypoint, and the face_pipeline instance count sized to the host.

Static and offline, like tests/test_deploy.py: nothing here builds an image or needs a GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dockerfile
import yaml

from facecore.probe import PROBE_FILE
from tests.conftest import ROOT

DEPLOY = ROOT / "deploy"
GPU_REPOSITORY = "/opt/facerec/model_repository/gpu"
CPU_REPOSITORY = "/opt/facerec/model_repository/ngc-cpu"


class _TaggedLoader(yaml.SafeLoader):  # type: ignore[misc]  # untyped without types-PyYAML
    """Compose's ``!reset`` / ``!override`` read as None (this file only reads the healthchecks)."""


for _tag in ("!reset", "!override"):
    _TaggedLoader.add_constructor(_tag, lambda _loader, _node: None)


def compose_service(path: Path, name: str) -> dict[str, Any]:
    service: dict[str, Any] = yaml.load(path.read_text(), Loader=_TaggedLoader)["services"][name]
    return service


def dockerfile_final(path: Path, cmd: str) -> list[list[str]]:
    """The values of every ``cmd`` instruction of the last stage."""
    commands = list(dockerfile.parse_file(str(path)))
    last = max(i for i, c in enumerate(commands) if c.cmd.upper() == "FROM")
    return [list(c.value) for c in commands[last:] if c.cmd.upper() == cmd]


def probe_image_of(command: list[str]) -> str:
    """The ``--image`` of a ``python -m facecore.probe`` command line."""
    assert command[command.index("-m") + 1] == "facecore.probe", command
    assert command[command.index("--url") + 1] == "127.0.0.1:8001", command
    return command[command.index("--image") + 1]


def test_every_triton_healthcheck_runs_the_recognition_probe() -> None:
    gpu_photo, cpu_photo = f"{GPU_REPOSITORY}/{PROBE_FILE}", f"{CPU_REPOSITORY}/{PROBE_FILE}"
    gpu = compose_service(ROOT / "docker-compose.yml", "triton")["healthcheck"]["test"]
    cpu = compose_service(ROOT / "docker-compose.cpu.yml", "triton")["healthcheck"]["test"]
    assert gpu[0] == cpu[0] == "CMD"
    assert probe_image_of(gpu[1:]) == gpu_photo and probe_image_of(cpu[1:]) == cpu_photo
    (gpu_image,) = dockerfile_final(DEPLOY / "triton" / "Dockerfile", "HEALTHCHECK")
    (cpu_image,) = dockerfile_final(DEPLOY / "cpu-triton" / "Dockerfile", "HEALTHCHECK")
    assert gpu_image[0] == cpu_image[0] == "CMD"
    assert gpu_image[1:] == gpu[1:] and cpu_image[1:] == cpu[1:], "the image and compose check the same"
    k8s = next(d for d in yaml.safe_load_all((DEPLOY / "k8s" / "triton.yaml").read_text())
               if d["kind"] == "Deployment")
    container = k8s["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["exec"]["command"] == gpu[1:]
    assert container["readinessProbe"]["timeoutSeconds"] >= 10


def test_the_probe_photo_is_in_the_repository_baked_into_each_image() -> None:
    """The images' repositories are written by ``python -m export defaults`` (which writes the photo)
    and copied to where the healthchecks look."""
    gpu = [c for c in dockerfile_final(DEPLOY / "triton" / "Dockerfile", "COPY") if c[-1] == GPU_REPOSITORY]
    assert gpu == [["/out/gpu", GPU_REPOSITORY]]
    copies = dockerfile_final(DEPLOY / "cpu-triton" / "Dockerfile", "COPY")
    assert [c for c in copies if c[-1] == CPU_REPOSITORY] == [["/out/ngc-cpu", CPU_REPOSITORY]]
