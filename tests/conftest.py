"""Shared fixtures: real photos, the default models, and one real Triton server per test session."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from export.defaults import DefaultModels, prepare_default_models
from export.fetch import fetch_photos
from export.profiles import Profile
from export.repository import RepositoryPlan, write_repository
from facecore.client import PipelineClient
from service.launcher import TritonPorts, TritonServer
from tests import ROOT

ARTIFACTS = ROOT / "artifacts"


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@pytest.fixture(scope="session")
def photos() -> dict[str, Path]:
    """Real photos fetched by pinned version + sha256 (see export/fetch.py)."""
    return fetch_photos(ARTIFACTS / "downloads", ARTIFACTS / "photos")


@pytest.fixture(scope="session")
def photo_bytes(photos: dict[str, Path]) -> dict[str, bytes]:
    return {name: path.read_bytes() for name, path in photos.items()}


@pytest.fixture(scope="session")
def default_models() -> DefaultModels:
    return prepare_default_models(ARTIFACTS)


def exported(profile: Profile, models: DefaultModels, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh repository of ``profile`` written by the exporter into a new temporary folder."""
    out = tmp_path_factory.mktemp("repository") / profile.value
    plan = RepositoryPlan(profile, models.detector, models.embedder)
    return write_repository(plan, out, models.detector_file, models.embedder_file)


@pytest.fixture(scope="session")
def cpu_repository(default_models: DefaultModels, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh CPU-profile repository written by the exporter, private to this test session."""
    return exported(Profile.CPU, default_models, tmp_path_factory)


@pytest.fixture(scope="session")
def exported_precisions(cpu_repository: Path) -> dict[str, str]:
    """The precision the export chose for each network on this machine, as its configs record it: bf16
    where the CPU executes it natively, faster than f32, and the accuracy check accepts it; f32 elsewhere."""
    from export.served import read_config

    return {role: read_config(cpu_repository / f"face_{role}").parameters["precision"].string_value
            for role in ("detector", "embedder")}


@pytest.fixture(scope="session")
def served_runtime(exported_precisions: dict[str, str]) -> str:
    """How the benchmark reports name the served runtime with the precisions the export chose here."""
    return f"openvino: detector {exported_precisions['detector']}, embedder {exported_precisions['embedder']}"


@pytest.fixture(scope="session")
def triton(cpu_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    """The tritonserver from the nvidia-pytriton wheel serving the three models."""
    log_file = tmp_path_factory.mktemp("triton") / "tritonserver.log"
    server = TritonServer(cpu_repository, TritonPorts(*free_ports(3)), log_file=log_file)
    with server:
        yield server


@pytest.fixture(scope="session")
def pipeline(triton: TritonServer) -> Iterator[PipelineClient]:
    client = PipelineClient(triton.grpc_url)
    yield client
    client.close()


@pytest.fixture(scope="session")
def broken_triton(cpu_repository: Path, default_models: DefaultModels,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    """A real Triton whose models all load and report ready, but whose face_pipeline fails every
    request with faces: face_embedder (and, in the in_process layout, face_pipeline's own embedder) serves
    the detector's ONNX file (its input is not ``data``) with ONNX Runtime, without the warm-up that would
    have refused it at load time."""
    import shutil

    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    root = tmp_path_factory.mktemp("broken")
    repository = Path(shutil.copytree(cpu_repository, root / "cpu",
                                      ignore=shutil.ignore_patterns("__pycache__")))
    embedder = repository / "face_embedder"
    shutil.copyfile(default_models.detector_file, embedder / "1" / "model.onnx")
    config = text_format.Parse((embedder / "config.pbtxt").read_text(), mc.ModelConfig())
    config.ClearField("model_warmup")
    # ONNX Runtime opens any ONNX file and fails at run time (OpenVINO would refuse the outputs at load)
    config.parameters["runtime"].string_value = "onnxruntime"
    (embedder / "config.pbtxt").write_text(text_format.MessageToString(config))
    pipeline = repository / "face_pipeline"
    config = text_format.Parse((pipeline / "config.pbtxt").read_text(), mc.ModelConfig())
    if config.parameters["layout"].string_value == "in_process":  # it runs its own copy of the embedder
        shutil.copyfile(default_models.detector_file, pipeline / "1" / "embedder.onnx")
        config.parameters["embedder_runtime"].string_value = "onnxruntime"
        (pipeline / "config.pbtxt").write_text(text_format.MessageToString(config))
    server = TritonServer(repository, TritonPorts(*free_ports(3)), log_file=root / "tritonserver.log")
    with server:
        yield server
