"""PyTorch -> ONNX export of RetinaFace and IResNet: ONNX Runtime must reproduce PyTorch.

Random weights (fixed seeds, batch norms calibrated and randomized) stand in for the published
checkpoints, which are not downloaded in tests; their key layout is checked instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from numpy.typing import NDArray

torch = pytest.importorskip(
    "torch", reason="PyTorch is not installed: the export extra is missing (pip install -e '.[export]')"
)

from export.torch_export import (  # noqa: E402
    build_iresnet,
    build_retinaface,
    export_iresnet,
    export_retinaface,
    load_checkpoint,
)
from facecore.processing import prior_boxes  # noqa: E402
from facecore.spec import ColorOrder, Role, load_spec  # noqa: E402

Array = NDArray[np.float32]

pytestmark = pytest.mark.torch

ATOL = 1e-4
SEED = 7
RETINAFACE_SHAPES = [(2, 3, 96, 128), (1, 3, 100, 140)]  # the second has odd strides-32 sizes
# Parameter counts of the published models (Pytorch_Retinaface's mobilenet0.25 / Resnet50).
RETINAFACE_PARAMETERS = {"mobilenet0.25": 426_608, "resnet50": 27_293_600}


def _session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _run_both(model: Any, path: Path, x: Array) -> tuple[list[Array], list[Array]]:
    """PyTorch's and ONNX Runtime's outputs for ``x``."""
    with torch.no_grad():
        result = model(torch.from_numpy(x))
    expected = [t.numpy() for t in (result if isinstance(result, tuple) else (result,))]
    return expected, list(_session(path).run(None, {"input": x}))


@pytest.fixture(scope="module", params=["mobilenet0.25", "resnet50"])
def retinaface(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    backbone = str(request.param)
    out = tmp_path_factory.mktemp("retinaface") / f"{backbone}.onnx"
    return backbone, export_retinaface(backbone, None, out, seed=SEED)


def test_retinaface_onnx_matches_torch(retinaface: tuple[str, Path]) -> None:
    backbone, path = retinaface
    model = build_retinaface(backbone, None, seed=SEED)
    rng = np.random.default_rng(0)
    for shape in RETINAFACE_SHAPES:
        x = (rng.standard_normal(shape) * 60.0).astype(np.float32)
        expected, got = _run_both(model, path, x)
        anchors = prior_boxes(shape[2], shape[3]).shape[0]
        outputs = zip(("loc", "conf", "landmarks"), expected, got, (4, 2, 10), strict=True)
        for name, want, have, width in outputs:
            assert have.shape == (shape[0], anchors, width), name
            np.testing.assert_allclose(have, want, atol=ATOL, rtol=0, err_msg=f"{backbone} {name} {shape}")
        np.testing.assert_allclose(got[1].sum(axis=-1), 1.0, atol=1e-5)
        assert got[1][..., 1].std() > 0.01, "random weights should give varied scores"


def test_retinaface_graph_has_dynamic_axes(retinaface: tuple[str, Path]) -> None:
    graph = onnx.load(retinaface[1]).graph
    (tensor,) = graph.input
    assert tensor.name == "input"
    dims = tensor.type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in dims] == ["batch", 3, "height", "width"]
    outputs = {o.name: [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim]
               for o in graph.output}
    assert list(outputs) == ["loc", "conf", "landmarks"]
    assert list(outputs.values()) == [["batch", "anchors", k] for k in (4, 2, 10)]


def test_retinaface_description(retinaface: tuple[str, Path]) -> None:
    path = retinaface[1]
    spec = load_spec(path.with_suffix(".toml"))
    assert spec.role is Role.DETECTOR and spec.onnx == str(path.resolve())
    assert (spec.input_name, spec.output_names) == ("input", ("loc", "conf", "landmarks"))
    assert spec.color_order is ColorOrder.BGR and spec.mean == (104.0, 117.0, 123.0) and spec.std == (1, 1, 1)
    assert spec.input_size == (640, 640) and spec.conf_softmax
    assert "random" in spec.source and len(spec.sha256) == 64


def test_retinaface_key_layout() -> None:
    mobile = build_retinaface("mobilenet0.25", None).state_dict()
    resnet = build_retinaface("resnet50", None).state_dict()
    for key in ("body.stage1.0.0.weight", "body.stage3.1.3.weight", "fpn.merge2.0.weight",
                "ssh3.conv7x7_3.1.running_var", "LandmarkHead.2.conv1x1.bias"):
        assert key in mobile, key
    for key in ("body.conv1.weight", "body.layer1.0.downsample.1.running_mean", "body.layer4.2.conv3.weight",
                "ssh1.conv5X5_1.0.weight", "ClassHead.0.conv1x1.weight", "BboxHead.1.conv1x1.weight"):
        assert key in resnet, key
    assert not any(k.startswith(("body.fc", "body.avg")) for k in {**mobile, **resnet})
    for backbone, count in RETINAFACE_PARAMETERS.items():
        model = build_retinaface(backbone, None)
        assert sum(p.numel() for p in model.parameters()) == count


@pytest.mark.parametrize(("depth", "dim"), [(50, 256), (100, 512)])
def test_iresnet_onnx_matches_torch(tmp_path: Path, depth: int, dim: int) -> None:
    path = export_iresnet(depth, None, tmp_path / f"r{depth}.onnx", embedding_dim=dim, seed=SEED)
    model = build_iresnet(depth, None, embedding_dim=dim, seed=SEED)
    rng = np.random.default_rng(1)
    for batch in (3, 1):
        x = rng.uniform(-1.0, 1.0, (batch, 3, 112, 112)).astype(np.float32)
        (want,), (have,) = _run_both(model, path, x)
        assert have.shape == (batch, dim)
        np.testing.assert_allclose(have, want, atol=ATOL, rtol=0, err_msg=f"IResNet-{depth} batch {batch}")
    spec = load_spec(path.with_suffix(".toml"))
    assert spec.role is Role.EMBEDDER and spec.onnx == str(path.resolve()) and spec.embedding_dim == dim
    assert (spec.input_name, spec.output_names, spec.input_size) == ("input", ("embedding",), (112, 112))
    assert spec.color_order is ColorOrder.RGB and spec.mean == (127.5,) * 3 and spec.std == (127.5,) * 3
    assert spec.match_threshold == 0.3 and "calibrate" in path.with_suffix(".toml").read_text()


def test_load_checkpoint_strips_module_prefix(tmp_path: Path) -> None:
    source = build_retinaface("mobilenet0.25", None, seed=1)
    state = {f"module.{k}": v for k, v in source.state_dict().items()}
    for name, payload in (("plain.pth", state), ("wrapped.pth", {"state_dict": state, "epoch": 3})):
        torch.save(payload, tmp_path / name)
        target = build_retinaface("mobilenet0.25", None, seed=2)
        load_checkpoint(target, tmp_path / name)
        for key, value in source.state_dict().items():
            assert torch.equal(target.state_dict()[key], value), key


def test_export_from_checkpoint(tmp_path: Path) -> None:
    source = build_retinaface("mobilenet0.25", None, seed=3)
    torch.save(source.state_dict(), tmp_path / "mobilenet0.25_Final.pth")
    path = export_retinaface("mobilenet0.25", tmp_path / "mobilenet0.25_Final.pth", tmp_path / "det.onnx")
    x = np.random.default_rng(2).uniform(-120, 130, (1, 3, 64, 64)).astype(np.float32)
    for want, have in zip(*_run_both(source, path, x), strict=True):
        np.testing.assert_allclose(have, want, atol=ATOL, rtol=0)
    assert "mobilenet0.25_Final.pth" in load_spec(tmp_path / "det.toml").source


def test_load_checkpoint_names_missing_and_unexpected_keys(tmp_path: Path) -> None:
    state = build_iresnet(18, None).state_dict()
    del state["features.weight"]
    state["head.weight"] = torch.zeros(1)
    torch.save(state, tmp_path / "bad.pth")
    expected = r"missing keys \(1\): features\.weight.*unexpected keys \(1\): head\.weight"
    with pytest.raises(ValueError, match=expected):
        load_checkpoint(build_iresnet(18, None), tmp_path / "bad.pth")


def test_load_checkpoint_rejects_other_architecture(tmp_path: Path) -> None:
    torch.save(build_iresnet(18, None, embedding_dim=128).state_dict(), tmp_path / "r18_128.pth")
    expected = r"mis-shaped keys \(6\): fc\.weight \(128, 25088\) \(model \(512, 25088\)\)"
    with pytest.raises(ValueError, match=expected):
        load_checkpoint(build_iresnet(18, None), tmp_path / "r18_128.pth")
    with pytest.raises(ValueError, match=r"missing keys \(\d+\): layer1\.2\.bn1\.weight"):
        load_checkpoint(build_iresnet(34, None, embedding_dim=128), tmp_path / "r18_128.pth")
    with pytest.raises(ValueError, match="missing keys"):
        load_checkpoint(build_retinaface("mobilenet0.25", None), tmp_path / "r18_128.pth")


def test_invalid_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="backbone"):
        export_retinaface("mobilenet1.0", None, tmp_path / "x.onnx")
    with pytest.raises(ValueError, match="depth"):
        export_iresnet(101, None, tmp_path / "x.onnx")
    with pytest.raises(FileNotFoundError):
        export_iresnet(18, tmp_path / "absent.pth", tmp_path / "x.onnx")
    assert not list(tmp_path.iterdir())
