"""PyTorch checkpoints -> ONNX: RetinaFace (Pytorch_Retinaface) and IResNet (arcface_torch).

Each export writes ``<out>`` (ONNX, dynamic batch) and a model description ``<out stem>.toml``
beside it that ``facecore.spec.load_spec`` reads. Uses torch's TorchScript-based exporter
(``dynamo=False``): it needs no ``onnxscript`` and keeps ``dynamic_axes``.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import onnx
import torch
from torch import Tensor, nn

from export.torch_models.iresnet import INPUT_SIZE, LAYERS, IResNet
from export.torch_models.retinaface import CONFIGS, RetinaFace
from facecore.files import sha256_of
from facecore.spec import load_spec

log = logging.getLogger(__name__)

OPSET = 17
_STATE_KEYS = ("state_dict", "state_dict_backbone")
_PREFIX = "module."
_SHOWN_KEYS = 12
_MIN_VARIANCE = 0.25
_OUTPUTS = {"loc": 4, "conf": 2, "landmarks": 10}  # RetinaFace outputs and their widths
_RETINAFACE = {
    "mobilenet0.25": ("retinaface_mnet025", "MobileNet-0.25"),
    "resnet50": ("retinaface_r50", "ResNet-50"),
}

TomlValue = str | int | float | bool | Sequence[str | int | float]
Model = TypeVar("Model", bound=nn.Module)


def _key_list(kind: str, keys: Sequence[str]) -> str:
    shown = ", ".join(keys[:_SHOWN_KEYS])
    more = f" (+{len(keys) - _SHOWN_KEYS} more)" if len(keys) > _SHOWN_KEYS else ""
    return f"{kind} keys ({len(keys)}): {shown}{more}"


def _state_dict(path: Path) -> dict[str, Tensor]:
    """The checkpoint's tensors, unwrapped from ``state_dict`` and stripped of ``module.``."""
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} not found")
    loaded = torch.load(path, map_location="cpu", weights_only=True)
    for key in _STATE_KEYS:
        if isinstance(loaded, Mapping) and key in loaded:
            loaded = loaded[key]
            break
    if not isinstance(loaded, Mapping) or not all(isinstance(v, Tensor) for v in loaded.values()):
        raise ValueError(f"{path}: not a state dict of tensors")
    return {(k[len(_PREFIX):] if k.startswith(_PREFIX) else k): v for k, v in loaded.items()}


def load_checkpoint(model: nn.Module, path: Path) -> None:
    """Load ``path`` into ``model``; every parameter and buffer must match (ValueError otherwise).

    A missing ``num_batches_tracked`` (checkpoints older than PyTorch 0.4.1) is taken from the
    model: eval mode does not use it.
    """
    state = _state_dict(Path(path))
    expected = model.state_dict()
    for key, value in expected.items():
        if key.endswith("num_batches_tracked"):
            state.setdefault(key, value)
    problems = [_key_list(kind, keys) for kind, keys in (
        ("missing", [k for k in expected if k not in state]),
        ("unexpected", [k for k in state if k not in expected]),
        ("mis-shaped", [f"{k} {tuple(v.shape)} (model {tuple(expected[k].shape)})"
                        for k, v in state.items() if k in expected and v.shape != expected[k].shape]),
    ) if keys]
    if problems:
        raise ValueError(f"{path}: checkpoint does not match {type(model).__name__}; " + "; ".join(problems))
    model.load_state_dict(state, strict=True)
    log.info("loaded %d tensors from %s", len(state), path)


def randomize(model: nn.Module, example: Tensor) -> None:
    """Make a randomly initialized network a meaningful export test.

    Every affine batch-norm weight and bias and every PReLU slope is drawn at random; batch-norm
    statistics are measured on ``example`` so that activations keep a sensible scale. Variances are
    floored at ``_MIN_VARIANCE``: nearly dead channels of a random network would otherwise amplify
    float32 rounding far beyond what a trained network does.
    """
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    with torch.no_grad():
        for norm in norms:
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.normal_(0.0, 0.2)
            norm.reset_running_stats()
            norm.momentum = None  # cumulative average: the statistics of the one calibration pass
        for module in model.modules():
            if isinstance(module, nn.PReLU):
                module.weight.uniform_(0.05, 0.5)
        model.train()
        model(example)
        model.eval()
        for norm in norms:
            norm.momentum = 0.1
            norm.running_var.clamp_(min=_MIN_VARIANCE)  # type: ignore[union-attr]


def _initialize(model: Model, checkpoint: Path | None, example: Tensor) -> Model:
    if checkpoint is not None:
        load_checkpoint(model, checkpoint)
    else:
        randomize(model, example)
    return model.eval()


def build_retinaface(backbone: str, checkpoint: Path | None, *, seed: int | None = None) -> RetinaFace:
    """RetinaFace in eval mode: from ``checkpoint``, or random (``seed``, default 0) when it is None."""
    if backbone not in CONFIGS:
        raise ValueError(f"unknown RetinaFace backbone {backbone!r}; choose from {sorted(CONFIGS)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0 if seed is None else seed)
        return _initialize(RetinaFace(backbone), checkpoint, torch.randn(2, 3, 64, 96) * 60.0)


def build_iresnet(depth: int, checkpoint: Path | None, *, embedding_dim: int = 512,
                  seed: int | None = None) -> IResNet:
    """IResNet in eval mode: from ``checkpoint``, or random (``seed``, default 0) when it is None."""
    if depth not in LAYERS:
        raise ValueError(f"unsupported IResNet depth {depth}; choose from {sorted(LAYERS)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0 if seed is None else seed)
        return _initialize(IResNet(depth, embedding_dim), checkpoint,
                           torch.rand(4, 3, INPUT_SIZE, INPUT_SIZE) * 2.0 - 1.0)


def _replace_atomically(tmp: Path, out: Path) -> None:
    os.replace(tmp, out)
    log.info("wrote %s", out)


def _declare_output_shapes(path: Path, shapes: Mapping[str, Sequence[str | int]]) -> None:
    """Write known output shapes into the graph (the tracer leaves reshaped axes unnamed)."""
    model = onnx.load(str(path))
    for output in model.graph.output:
        if output.name in shapes:
            dims = output.type.tensor_type.shape.dim
            del dims[:]
            for size in shapes[output.name]:
                dim = dims.add()
                if isinstance(size, str):
                    dim.dim_param = size
                else:
                    dim.dim_value = size
    onnx.save(model, str(path))


def _export_onnx(model: nn.Module, example: Tensor, out: Path, dynamic_axes: dict[str, dict[int, str]],
                 output_shapes: Mapping[str, Sequence[str | int]], *, declare_shapes: bool = False) -> None:
    """Trace ``model`` to ``out`` (tmp file, check, rename).

    ``output_shapes`` names the outputs in order; with ``declare_shapes`` they are written into the graph.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter's notice
            torch.onnx.export(model, (example,), str(tmp), input_names=["input"],
                              output_names=list(output_shapes), opset_version=OPSET,
                              dynamic_axes=dynamic_axes, do_constant_folding=True, dynamo=False)
        if declare_shapes:
            _declare_output_shapes(tmp, output_shapes)
        onnx.checker.check_model(str(tmp))
        _replace_atomically(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def _toml_value(value: TomlValue) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    return "[" + ", ".join(_toml_value(v) for v in value) + "]"


def write_description(onnx_path: Path, header: str, values: dict[str, TomlValue],
                      comments: Mapping[str, str] | None = None) -> Path:
    """Write ``<onnx stem>.toml`` (``onnx`` relative to it, plus its sha256) and check it loads."""
    path = onnx_path.with_suffix(".toml")
    lines = [f"# {line}" if line else "#" for line in header.splitlines()] + ["[model]"]
    values = {**values, "onnx": onnx_path.name, "sha256": sha256_of(onnx_path)}
    for key, value in values.items():
        if comments and key in comments:
            lines += [f"# {line}" for line in comments[key].splitlines()]
        lines.append(f"{key} = {_toml_value(value)}")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
        load_spec(tmp)
        _replace_atomically(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _check_out(out: Path) -> Path:
    out = Path(out)
    if out.suffix == ".toml":
        raise ValueError(f"{out}: the ONNX output cannot end in .toml (the description goes there)")
    return out


def _source(checkpoint: Path | None, seed: int | None, project: str) -> str:
    if checkpoint is None:
        return f"random initialization (seed {0 if seed is None else seed}): for tests only"
    return f"{project} checkpoint {Path(checkpoint).name}, exported by export/torch_export.py"


def export_retinaface(backbone: str, checkpoint: Path | None, out: Path, *, seed: int | None = None) -> Path:
    """Pytorch_Retinaface checkpoint -> ONNX ``input`` [N,3,H,W] -> ``loc``, ``conf``, ``landmarks``."""
    out = _check_out(out)
    model = build_retinaface(backbone, checkpoint, seed=seed)
    shapes: dict[str, Sequence[str | int]] = {name: ("batch", "anchors", k) for name, k in _OUTPUTS.items()}
    axes = {name: {0: "batch", 1: "anchors"} for name in shapes}
    axes["input"] = {0: "batch", 2: "height", 3: "width"}
    _export_onnx(model, torch.zeros(2, 3, 160, 192), out, axes, shapes, declare_shapes=True)
    name, trunk = _RETINAFACE[backbone]
    header = f"RetinaFace {trunk}, exported from PyTorch by `python -m export torch-retinaface`."
    write_description(out, header, {
        "name": name,
        "role": "detector",
        "architecture": f"RetinaFace {trunk} (FPN + SSH, 2 anchors per cell, steps 8/16/32)",
        "license": "as the checkpoint's (Pytorch_Retinaface's published weights: MIT)",
        "source": _source(checkpoint, seed, "Pytorch_Retinaface"),
        "input_name": "input",
        "output_names": list(_OUTPUTS),
        "color_order": "BGR",
        "mean": [104.0, 117.0, 123.0],
        "std": [1.0, 1.0, 1.0],
        "input_size": [640, 640],
        "conf_softmax": True,
    }, {"input_size": "The ONNX graph takes any height and width; the pipeline letterboxes to this size."})
    return out


def export_iresnet(depth: int, checkpoint: Path | None, out: Path, *, embedding_dim: int = 512,
                   seed: int | None = None) -> Path:
    """arcface_torch IResNet checkpoint -> ONNX ``input`` [N,3,112,112] -> ``embedding`` [N,D]."""
    out = _check_out(out)
    model = build_iresnet(depth, checkpoint, embedding_dim=embedding_dim, seed=seed)
    axes = {"input": {0: "batch"}, "embedding": {0: "batch"}}
    example = torch.zeros(2, 3, INPUT_SIZE, INPUT_SIZE)
    _export_onnx(model, example, out, axes, {"embedding": ("batch", embedding_dim)})
    header = f"ArcFace IResNet-{depth}, exported from PyTorch by `python -m export torch-iresnet`."
    write_description(out, header, {
        "name": f"arcface_r{depth}",
        "role": "embedder",
        "architecture": f"ArcFace IResNet-{depth} (arcface_torch), {embedding_dim}-d, 112x112 input",
        "license": "as the checkpoint's",
        "source": _source(checkpoint, seed, "arcface_torch"),
        "input_name": "input",
        "output_names": ["embedding"],
        "color_order": "RGB",
        "mean": [127.5, 127.5, 127.5],
        "std": [127.5, 127.5, 127.5],
        "input_size": [INPUT_SIZE, INPUT_SIZE],
        "embedding_dim": embedding_dim,
        "match_threshold": 0.3,
    }, {"match_threshold": "Placeholder: calibrate it for this checkpoint on labelled verification pairs\n"
                           "(it depends on the training data and loss)."})
    return out
