"""The images' entrypoints, run here with fakes: the Triton engine cache (deploy/triton/entrypoint.py),
the stub extraction, and the gateway's settings from the compose environment
(deploy/gateway/entrypoint.py). See tests/test_deploy.py for the other deployment checks."""

from __future__ import annotations

import hashlib
import io
import re
import zipfile
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.deploy_helpers import DEPLOY, ROOT, clear_facerec_env, load_module

pytest_plugins = ["tests.deploy_fixtures"]


@pytest.fixture(scope="module")
def triton_entry() -> ModuleType:
    return load_module(DEPLOY / "triton" / "entrypoint.py", "facerec_triton_entrypoint")


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
    extract_stub = load_module(DEPLOY / "triton" / "extract_stub.py", "facerec_extract_stub")
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


def test_gateway_settings_from_compose_environment(gateway_entry: ModuleType, models: dict[str, Any],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from sqlalchemy.engine import make_url

    clear_facerec_env(monkeypatch)
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
    clear_facerec_env(monkeypatch)
    monkeypatch.setenv("FACEREC_DB_HOST", "postgres")
    monkeypatch.setenv("FACEREC_DB_PASSWORD", "secret-password")
    with pytest.raises(SystemExit, match="security") as raised:
        gateway_entry.load_settings()
    assert "secret-password" not in str(raised.value)
    monkeypatch.setenv("FACEREC_SECURITY__ADMIN_KEY", "short")
    with pytest.raises(SystemExit, match="16 characters"):
        gateway_entry.load_settings()


def test_probe_and_scrape_paths_exist_in_the_app(app_routes: set[str], models: dict[str, Any]) -> None:
    assert {"/health/live", "/health/ready", "/metrics"} <= app_routes
    check = " ".join(models["gpu"]["services"]["gateway"]["healthcheck"]["test"])
    assert re.search(r"127\.0\.0\.1:8080(/health/\w+)", check)[1] in app_routes  # type: ignore[index]
