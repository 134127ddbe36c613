"""The ONNX interpreter on PyTorch (``export/onnx_torch.py``), checked against ONNX Runtime on the gpu
profile's served networks and on single operators."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from export.defaults import DefaultModels
from export.onnx_torch import OnnxModule, ordered, torch_runner
from export.profiles import Profile
from export.served import latest_version
from tests.conftest import exported


@pytest.fixture(scope="module")
def gpu_repository(default_models: DefaultModels, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return exported(Profile.GPU, default_models, tmp_path_factory)


def _served(repository: Path, network: str) -> Path:
    return latest_version(repository / f"face_{network}") / "model.onnx"


def _onnxruntime(path: Path, batch: np.ndarray) -> list[np.ndarray]:  # type: ignore[type-arg]
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: batch})  # type: ignore[no-any-return]


def _interpreted(path: Path, batch: np.ndarray) -> list[np.ndarray]:  # type: ignore[type-arg]
    with torch.inference_mode():
        return [t.numpy() for t in OnnxModule(path)(torch.from_numpy(batch))]


@pytest.mark.parametrize("network", ["detector", "embedder"])
def test_the_interpreter_computes_what_onnxruntime_does(gpu_repository: Path, network: str) -> None:
    rng = np.random.default_rng(3)
    path = _served(gpu_repository, network)
    if network == "detector":  # the served detector: uint8 NHWC
        batch = rng.integers(0, 256, (2, 640, 640, 3), dtype=np.uint8)
    else:
        batch = (rng.random((3, 3, 112, 112)) * 255).astype(np.float32)
    expected, got = _onnxruntime(path, batch), _interpreted(path, batch)
    assert [e.shape for e in expected] == [g.shape for g in got]
    for e, g in zip(expected, got, strict=True):
        assert np.abs(e - g).max() <= 1e-4 * max(1.0, float(np.abs(e).max()))


def test_the_runner_gives_numpy_outputs_in_the_order_asked(gpu_repository: Path) -> None:
    """``torch_runner`` is a ``facecore.runtimes.Runner``: numpy in, float32 numpy out, by output name."""
    path = _served(gpu_repository, "detector")
    batch = np.random.default_rng(4).integers(0, 256, (1, 640, 640, 3), dtype=np.uint8)
    names = ["landmarks", "loc"]
    got = torch_runner(path, names, "cpu")(batch)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for expected, value in zip(session.run(names, {session.get_inputs()[0].name: batch}), got, strict=True):
        assert value.dtype == np.float32 and value.shape == expected.shape
        assert np.abs(value - expected).max() <= 1e-4 * max(1.0, float(np.abs(expected).max()))


def test_the_interpreter_runs_the_unserved_detector_at_any_size(default_models: DefaultModels) -> None:
    """The exported detector (float NCHW, free height and width): Shape/Gather/Slice/Resize on real sizes."""
    batch = np.random.default_rng(5).random((1, 3, 320, 256), dtype=np.float32) * 100
    path = default_models.detector_file
    for e, g in zip(_onnxruntime(path, batch), _interpreted(path, batch), strict=True):
        assert e.shape == g.shape
        assert np.abs(e - g).max() <= 1e-4 * max(1.0, float(np.abs(e).max()))


def _graph(node: helper.NodeProto, shape: list[int], opset: int) -> Path:
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return graph, helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])  # type: ignore[return-value]


@pytest.mark.parametrize("opset", [11, 13])
def test_softmax_follows_each_opsets_semantics(tmp_path: Path, opset: int) -> None:
    """Before opset 13 Softmax flattens the dimensions from ``axis`` on; from 13 it is along ``axis``."""
    import onnx

    _, model = _graph(helper.make_node("Softmax", ["x"], ["y"], axis=1), [2, 3, 4], opset)
    model.ir_version = 8
    path = tmp_path / "softmax.onnx"
    onnx.save(model, str(path))
    x = np.random.default_rng(1).random((2, 3, 4), dtype=np.float32)
    np.testing.assert_allclose(_interpreted(path, x)[0], _onnxruntime(path, x)[0], rtol=1e-5, atol=1e-6)


def test_shape_takes_its_start_and_end(tmp_path: Path) -> None:
    """Opset 15 added ``start`` and ``end`` to Shape."""
    import onnx

    node = helper.make_node("Shape", ["x"], ["y"], start=1, end=-1)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4, 5])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.INT64, None)]
    graph = helper.make_graph([node], "g", inputs, outputs)
    path = tmp_path / "shape.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)], ir_version=8), str(path))
    x = np.zeros((2, 3, 4, 5), np.float32)
    assert _interpreted(path, x)[0].tolist() == _onnxruntime(path, x)[0].tolist() == [3, 4]


def test_an_operator_it_does_not_know_is_named(tmp_path: Path) -> None:
    import onnx

    _, model = _graph(helper.make_node("Erf", ["x"], ["y"], name="the_erf"), [2], 13)
    path = tmp_path / "erf.onnx"
    onnx.save(model, str(path))
    with pytest.raises(NotImplementedError, match=r"Erf.*the_erf"):
        OnnxModule(path)


def test_outputs_are_found_by_name(gpu_repository: Path) -> None:
    module = OnnxModule(_served(gpu_repository, "detector"))
    assert ordered(module, ["landmarks", "loc"]) == [module.output_names.index("landmarks"),
                                                     module.output_names.index("loc")]
