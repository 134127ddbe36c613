"""TensorRT engine building: profile checks run everywhere; the real build runs only where TensorRT is
installed (the NGC image or a GPU host). The repository's engine lifecycle:
tests/export/test_engine_cache.py."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from export import __main__ as cli
from export.engine_cache import EngineSlot, build_repository_engines
from export.precision import PrecisionCheck
from export.tensorrt_build import (
    EngineProfile,
    TensorRTUnavailable,
    build_engine,
    item_shape,
    read_config,
    repository_profile,
    tensorrt_available,
)

HAS_TENSORRT = tensorrt_available()
needs_tensorrt = pytest.mark.skipif(
    not HAS_TENSORRT,
    reason="TensorRT is not installed here (it cannot be installed from PyPI on this machine); "
    "runs in the NGC image or on a GPU host",
)
without_tensorrt = pytest.mark.skipif(HAS_TENSORRT, reason="TensorRT is installed here")

TRT_CONFIG = """# written by a test
name: "{name}"
platform: "tensorrt_plan"
max_batch_size: {max_batch}
input {{ name: "input" data_type: TYPE_FP32 dims: [3, 8, 8] }}
output {{ name: "output" data_type: TYPE_FP32 dims: [3, 8, 8] }}
"""


def tiny_onnx(path: Path, batch: str | int = "batch", size: int | str = 8) -> Path:
    """input [batch, 3, size, size] -> Relu -> output."""
    shape = [batch, 3, size, size]
    graph = helper.make_graph(
        [helper.make_node("Relu", ["input"], ["output"])], "tiny",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, shape)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)
    return path


def trt_model(repository: Path, name: str, max_batch: int = 8, versions: tuple[int, ...] = (1,)) -> Path:
    (repository / name).mkdir(parents=True)
    (repository / name / "config.pbtxt").write_text(TRT_CONFIG.format(name=name, max_batch=max_batch))
    for version in versions:
        tiny_onnx(repository / name / str(version) / "model.onnx")
    return repository / name


Batches = tuple[int, int, int]


@pytest.mark.parametrize(("batches", "shape"), [
    ((1, 1, 1), None), ((1, 8, 16), (3, 640, 640)), ((4, 4, 4), None),
])
def test_profile_accepts_ordered_batches(batches: Batches, shape: tuple[int, int, int] | None) -> None:
    profile = EngineProfile(*batches, shape)
    assert (profile.min_batch, profile.opt_batch, profile.max_batch) == batches


@pytest.mark.parametrize(("batches", "shape"), [
    ((0, 1, 1), None), ((2, 1, 4), None), ((1, 8, 4), None), ((1, 2, 4), (3, 0, 112)), ((1, 2, 4), (3, 112)),
    ((1.0, 2, 4), None), ((1, 2, 4), (3, 112.0, 112)),
])
def test_profile_rejects_bad_values(batches: Batches, shape: tuple[int, ...] | None) -> None:
    with pytest.raises(ValueError):
        EngineProfile(*batches, shape)  # type: ignore[arg-type]


def test_item_shape_from_onnx_or_profile() -> None:
    assert item_shape((-1, 3, 112, 112), EngineProfile(1, 2, 4)) == (3, 112, 112)
    assert item_shape((-1, 3, -1, -1), EngineProfile(1, 2, 4, (3, 640, 480))) == (3, 640, 480)
    with pytest.raises(ValueError, match="give the item shape"):
        item_shape((-1, 3, -1, -1), EngineProfile(1, 2, 4))
    with pytest.raises(ValueError, match="does not fit"):
        item_shape((-1, 3, 112, 112), EngineProfile(1, 2, 4, (3, 96, 96)))
    with pytest.raises(ValueError, match="batch axis is fixed"):
        item_shape((1, 3, 112, 112), EngineProfile(1, 2, 4))


def test_repository_without_tensorrt_models_builds_nothing(tmp_path: Path) -> None:
    (tmp_path / "face_pipeline" / "1").mkdir(parents=True)
    (tmp_path / "face_pipeline" / "config.pbtxt").write_text('name: "face_pipeline"\nbackend: "python"\n')
    (tmp_path / "face_embedder").mkdir()
    (tmp_path / "face_embedder" / "config.pbtxt").write_text('platform: "onnxruntime_onnx"\n')
    tiny_onnx(tmp_path / "face_embedder" / "1" / "model.onnx")
    assert build_repository_engines(tmp_path) == {}


def test_repository_profiles_come_from_the_config(tmp_path: Path) -> None:
    model = trt_model(tmp_path, "face_detector", max_batch=16)
    assert repository_profile("face_detector", read_config(model / "config.pbtxt")) == (
        "input", EngineProfile(1, 8, 16, (3, 8, 8)))
    (model / "config.pbtxt").write_text(TRT_CONFIG.format(name="x", max_batch=0))
    with pytest.raises(ValueError, match="max_batch_size"):
        repository_profile("x", read_config(model / "config.pbtxt"))


@without_tensorrt
def test_build_without_tensorrt_explains_where_to_build(tmp_path: Path) -> None:
    onnx_path = tiny_onnx(tmp_path / "tiny.onnx")
    with pytest.raises(TensorRTUnavailable, match="NGC") as error:
        build_engine(onnx_path, tmp_path / "tiny.plan", EngineProfile(1, 2, 4))
    assert isinstance(error.value, RuntimeError) and "pip install tensorrt" in str(error.value)
    assert not (tmp_path / "tiny.plan").exists()
    model = trt_model(tmp_path / "repo", "face_detector")
    with pytest.raises(TensorRTUnavailable):
        build_repository_engines(tmp_path / "repo", gpus=["NVIDIA H100"], tensorrt="10.5.0")
    assert not (model / "1" / "model.plan").exists()


@without_tensorrt
def test_cli_reports_missing_tensorrt(tmp_path: Path) -> None:
    onnx_path = tiny_onnx(tmp_path / "tiny.onnx")
    assert cli.main(["tensorrt", "--onnx", str(onnx_path), "--out", str(tmp_path / "tiny.plan")]) == 1


@needs_tensorrt
def test_build_real_engine(tmp_path: Path) -> None:
    import tensorrt as trt

    onnx_path = tiny_onnx(tmp_path / "tiny.onnx")
    plan = build_engine(onnx_path, tmp_path / "tiny.plan", EngineProfile(1, 2, 4), fp16=False)
    engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(plan.read_bytes())
    assert engine is not None
    shapes = [tuple(s) for s in engine.get_tensor_profile_shape("input", 0)]
    assert shapes == [(1, 3, 8, 8), (2, 3, 8, 8), (4, 3, 8, 8)]
    dynamic = tiny_onnx(tmp_path / "dynamic.onnx", size="side")
    build_engine(dynamic, tmp_path / "dynamic.plan", EngineProfile(1, 1, 2, (3, 16, 16)), input_name="input")
    trt_model(tmp_path / "repo", "face_detector", max_batch=4)

    def accept(slot: EngineSlot, precision: str) -> PrecisionCheck:  # the real check: test_engine_check.py
        return PrecisionCheck("detector", "tensorrt", precision, True, 0, 1.0)

    outcome = build_repository_engines(tmp_path / "repo", "fp32", check=accept)
    assert outcome == {"face_detector/1": "built fp32"}
    assert (tmp_path / "repo/face_detector/1/model.plan").is_file()
