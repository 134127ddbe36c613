"""Paths and small parsers shared by the deployment tests (tests/deploy/); their fixtures are in
tests/deploy/fixtures.py, the Compose loader in tests/deploy/compose_files.py."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests import ROOT

DEPLOY = ROOT / "deploy"
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_CPU = ROOT / "docker-compose.cpu.yml"
ENV_EXAMPLE = DEPLOY / ".env.example"
K8S = DEPLOY / "k8s"
DOCKERFILES = {
    "triton": DEPLOY / "triton" / "Dockerfile",
    "gateway": DEPLOY / "gateway" / "Dockerfile",
    "cpu-triton": DEPLOY / "cpu-triton" / "Dockerfile",
}


def need(module: str, requirement: str) -> ModuleType:
    """A dev dependency; a failure (not a skip) that names the requirement when it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError:
        pytest.fail(f"`{module}` is missing: install the dev extra ({requirement!r} in pyproject.toml)")


def load_module(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def clear_facerec_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("FACEREC_"):
            monkeypatch.delenv(name)


def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


# --- Dockerfiles --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Instruction:
    cmd: str
    flags: tuple[str, ...]
    value: tuple[str, ...]
    stage: int


def parse_dockerfile(path: Path) -> list[Instruction]:
    dockerfile = need("dockerfile", "dockerfile==3.4.0")
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



def final_stage(path: Path) -> list[Instruction]:
    instructions = parse_dockerfile(path)
    final = max(i.stage for i in instructions)
    return [i for i in instructions if i.stage == final]


def instruction_text(instructions: Sequence[Instruction], cmd: str) -> str:
    return "\n".join(" ".join(i.value) for i in instructions if i.cmd == cmd)


def container_port(service: dict[str, Any], port: str) -> bool:
    """Whether a compose service's image (built from a Dockerfile here) exposes ``port``."""
    dockerfile = ROOT / service["build"]["dockerfile"] if "build" in service else None
    return dockerfile is not None and port in exposed_ports(dockerfile)
