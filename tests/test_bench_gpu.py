"""The GPU benchmark (``bench/gpu.py``) and its ONNX interpreter (``bench/onnx_torch.py``), on the CPU.

The figures themselves need a GPU host (docs/gpu-plan.md); here the same code runs on tiny sizes, and the
interpreter is checked against ONNX Runtime on the served networks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from bench import gpu
from bench.onnx_torch import OnnxModule, ordered
from export.defaults import DefaultModels
from export.profiles import Profile
from tests.conftest import ARTIFACTS, ROOT, exported


@pytest.fixture(scope="module")
def gpu_repository(default_models: DefaultModels, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return exported(Profile.GPU, default_models, tmp_path_factory)


@pytest.fixture(scope="module")
def bundle(gpu_repository: Path, photos: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gpu.bundle(gpu_repository, ARTIFACTS / "photos", tmp_path_factory.mktemp("bundle"))


def _onnxruntime(path: Path, batch: np.ndarray) -> list[np.ndarray]:  # type: ignore[type-arg]
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: batch})  # type: ignore[no-any-return]


def _interpreted(path: Path, batch: np.ndarray) -> list[np.ndarray]:  # type: ignore[type-arg]
    with torch.inference_mode():
        return [t.numpy() for t in OnnxModule(path)(torch.from_numpy(batch))]


def test_the_bundle_holds_what_the_gpu_host_needs(bundle: Path) -> None:
    settings = gpu.load_settings(bundle)
    assert not settings.dynamic_input and settings.detector.input_size == (640, 640)
    assert (bundle / gpu.DETECTOR_FILE).stat().st_size > 10**6 and (bundle / gpu.EMBEDDER_FILE).exists()
    assert {"obama.jpg", "t1.jpg"} <= {p.name for p in (bundle / gpu.PHOTOS).iterdir()}


@pytest.mark.parametrize("network", ["detector", "embedder"])
def test_the_interpreter_computes_what_onnxruntime_does(bundle: Path, network: str) -> None:
    rng = np.random.default_rng(3)
    if network == "detector":  # the served detector: uint8 NHWC
        path, batch = bundle / gpu.DETECTOR_FILE, rng.integers(0, 256, (2, 640, 640, 3), dtype=np.uint8)
    else:
        path, batch = bundle / gpu.EMBEDDER_FILE, (rng.random((3, 3, 112, 112)) * 255).astype(np.float32)
    expected, got = _onnxruntime(path, batch), _interpreted(path, batch)
    assert [e.shape for e in expected] == [g.shape for g in got]
    for e, g in zip(expected, got, strict=True):
        assert np.abs(e - g).max() <= 1e-4 * max(1.0, float(np.abs(e).max()))


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


def test_outputs_are_found_by_name(bundle: Path) -> None:
    module = OnnxModule(bundle / gpu.DETECTOR_FILE)
    assert ordered(module, ["landmarks", "loc"]) == [module.output_names.index("landmarks"),
                                                     module.output_names.index("loc")]


def test_a_tiny_run_on_the_cpu_measures_every_part(bundle: Path, tmp_path: Path) -> None:
    """The command line, in its own process (PyTorch's threads and memory stay out of the test process)."""
    out = tmp_path / "gpu.json"
    command = [sys.executable, "-m", "bench.gpu", "run", "--bundle", str(bundle), "--device", "cpu", "--tiny",
               "--json", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = gpu.Report(**json.loads(out.read_text()))
    assert report.errors == [] and report.machine["cpus"]
    assert {(r["network"], r["batch"]) for r in report.networks} == {("detector", 1), ("embedder", 1),
                                                                      ("embedder", 2)}
    assert all(r["per_second"] > 0 for r in report.networks)
    # the same float32 arithmetic as ONNX Runtime: the TensorRT plan check passes on every face
    assert [(r["network"], r["passed"]) for r in report.precision] == [("detector", True), ("embedder", True)]
    assert all(r["faces"] > 10 and r["worst_cosine"] > 0.9999 for r in report.precision)
    detector = report.precision[0]
    assert detector["changed"] == [] and 0 <= detector["largest_change"]["blur"] < 0.01
    assert set(detector["largest_change"]) == {"face_size", "blur", "yaw", "pitch", "roll", "detection_score",
                                               "pair_cosine_absolute"}
    reduced = {r["decoded"] for r in report.decode if r["photo"] == "obama3.jpg"}
    assert reduced == {"1434x2333", "717x1167"}  # full size, and at 1/2 (decode_min_side 640)
    assert all(r["per_second_all_cores"] > 0 for r in report.decode)
    assert [(r["photo"], r["faces"], r["processes"], r["networks"]) for r in report.pipeline] == [
        ("obama.jpg", 1, 2, "eager"), ("t1.jpg", 6, 2, "eager")]
    assert all(r["photos_per_second"] > 0 for r in report.pipeline)
    assert {r["block"] for r in report.gallery} == {1, 4}
    assert all(0.5 <= r["recall_at_10_vs_float32"] <= 1.0 for r in report.gallery)


def test_a_failing_part_is_recorded_and_the_others_still_run(bundle: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in (gpu.SETTINGS, gpu.EMBEDDER_FILE):
        (broken / name).write_bytes((bundle / name).read_bytes())
    (broken / gpu.DETECTOR_FILE).write_bytes(b"not onnx")
    report = gpu.run(broken, "cpu", gpu.Sizes.tiny(), ["networks", "gallery"], tmp_path / "out.json")
    assert len(report.errors) == 1 and report.errors[0].startswith("networks:")
    assert report.gallery
    assert json.loads((tmp_path / "out.json").read_text())["errors"] == report.errors


def test_missing_inputs_are_named_with_the_command_that_makes_them(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"python -m export defaults"):
        gpu.main(["bundle", "--repository", str(tmp_path / "none"), "--out", str(tmp_path / "b")])
    with pytest.raises(SystemExit, match=r"python -m bench\.gpu bundle"):
        gpu.main(["run", "--bundle", str(tmp_path), "--device", "cpu"])
