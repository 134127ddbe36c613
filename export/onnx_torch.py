"""Run an ONNX graph with PyTorch operations, on any device PyTorch has: the path from the project's ONNX
files to a GPU where neither TensorRT nor onnxruntime-gpu can be installed (``bench/gpu.py`` measures
the gpu profile with it, standing in for TensorRT).

A small interpreter, not a converter: the graph's nodes run in their (topological) order, each as the
PyTorch operation with ONNX's semantics, for the operators the project's networks use (RetinaFace with
the served uint8 input, SFace, IResNet-style embedders). Shape arithmetic (``Shape``, ``Gather``, ``Slice``
... on int64 tensors) stays on the CPU, so a forward pass never waits for the device and can be captured
in a CUDA graph; float tensors live on ``device``. Reduced precision comes from ``torch.autocast`` around
the call (``torch_runner``). An operator outside the list raises ``NotImplementedError`` naming it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
import torch.nn.functional as F  # noqa: N812 - the usual name
from onnx import numpy_helper

Op = Callable[[dict[str, Any], list[Any]], list[Any]]

#: ONNX TensorProto data types -> torch dtypes (those the networks use).
DTYPES = {1: torch.float32, 2: torch.uint8, 3: torch.int8, 6: torch.int32, 7: torch.int64, 9: torch.bool,
          10: torch.float16, 11: torch.float64, 16: torch.bfloat16}


def _conv(a: dict[str, Any], x: list[Any]) -> list[Any]:
    weight = x[1]
    bias = x[2] if len(x) > 2 else None
    if a.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        raise NotImplementedError("Conv auto_pad")
    pads = a.get("pads", [0] * 2 * (weight.dim() - 2))
    half = len(pads) // 2
    inputs = x[0]
    if list(pads[:half]) != list(pads[half:]):  # asymmetric: pad explicitly (last dimension first)
        inputs = F.pad(inputs, [p for i in reversed(range(half)) for p in (pads[i], pads[i + half])])
        pads = [0] * len(pads)
    conv = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}[weight.dim()]
    return [conv(inputs, weight, bias, a.get("strides", 1), list(pads[:half]), a.get("dilations", 1),
                 a.get("group", 1))]


def _gather(a: dict[str, Any], x: list[Any]) -> list[Any]:
    data, indices = x
    axis = a.get("axis", 0) % data.dim()
    flat = indices.reshape(-1).to(torch.int64) % data.shape[axis]
    picked = data.index_select(axis, flat.to(data.device))
    return [picked.reshape((*data.shape[:axis], *indices.shape, *data.shape[axis + 1:]))]


def _unsqueeze(a: dict[str, Any], x: list[Any]) -> list[Any]:
    axes = a["axes"] if "axes" in a else x[1].tolist()
    out = x[0]
    rank = out.dim() + len(axes)
    for axis in sorted(ax % rank for ax in axes):
        out = out.unsqueeze(axis)
    return [out]


def _slice(a: dict[str, Any], x: list[Any]) -> list[Any]:
    data = x[0]
    starts, ends = x[1].tolist(), x[2].tolist()
    axes = x[3].tolist() if len(x) > 3 and x[3] is not None else list(range(len(starts)))
    steps = x[4].tolist() if len(x) > 4 and x[4] is not None else [1] * len(starts)
    index: list[slice] = [slice(None)] * data.dim()
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        if step < 1:
            raise NotImplementedError("Slice with a negative step")
        index[axis % data.dim()] = slice(start, end, step)
    return [data[tuple(index)]]


def _resize(a: dict[str, Any], x: list[Any]) -> list[Any]:
    data = x[0]
    sizes = x[3] if len(x) > 3 and x[3] is not None and x[3].numel() else None
    mode = a.get("mode", b"nearest")
    transform = a.get("coordinate_transformation_mode", b"half_pixel")
    if sizes is not None:
        target = [int(s) for s in sizes.tolist()[2:]]
    else:
        scales = x[2].tolist()
        target = [math.floor(n * s) for n, s in zip(data.shape[2:], scales[2:], strict=True)]
    nearest = a.get("nearest_mode", b"round_prefer_floor")
    if mode == b"nearest" and transform == b"asymmetric" and nearest == b"floor":
        return [F.interpolate(data, size=target, mode="nearest")]
    if mode == b"linear" and transform in (b"half_pixel", b"pytorch_half_pixel", b"align_corners"):
        return [F.interpolate(data, size=target, mode="bilinear" if data.dim() == 4 else "linear",
                              align_corners=transform == b"align_corners")]
    raise NotImplementedError(f"Resize mode {mode!r} with {transform!r}")


def _reshape(a: dict[str, Any], x: list[Any]) -> list[Any]:
    shape = x[1].tolist()
    if not a.get("allowzero", 0):
        shape = [x[0].shape[i] if s == 0 else s for i, s in enumerate(shape)]
    return [x[0].reshape(shape)]


def _softmax(a: dict[str, Any], x: list[Any], opset: int) -> list[Any]:
    data = x[0]
    axis = a.get("axis", -1 if opset >= 13 else 1) % data.dim()
    if opset >= 13 or axis == data.dim() - 1:
        return [torch.softmax(data, axis)]
    flat = data.reshape(*data.shape[:axis], -1)  # before opset 13: the trailing dimensions as one
    return [torch.softmax(flat, -1).reshape(data.shape)]


def _gemm(a: dict[str, Any], x: list[Any]) -> list[Any]:
    left = x[0].T if a.get("transA", 0) else x[0]
    right = x[1].T if a.get("transB", 0) else x[1]
    out = a.get("alpha", 1.0) * (left @ right)
    if len(x) > 2 and x[2] is not None:
        out = out + a.get("beta", 1.0) * x[2]
    return [out]


def _div(a: dict[str, Any], x: list[Any]) -> list[Any]:
    if x[0].is_floating_point():
        return [x[0] / x[1]]
    return [torch.div(x[0], x[1], rounding_mode="trunc")]


def _batch_norm(a: dict[str, Any], x: list[Any]) -> list[Any]:
    data, scale, bias, mean, var = x[:5]
    return [F.batch_norm(data, mean, var, scale, bias, False, 0.0, a.get("epsilon", 1e-5))]


def _flatten(a: dict[str, Any], x: list[Any]) -> list[Any]:
    axis = a.get("axis", 1) % max(x[0].dim(), 1)
    return [x[0].reshape(math.prod(x[0].shape[:axis]), -1)]


OPS: dict[str, Op] = {
    "Identity": lambda a, x: [x[0]],
    "Dropout": lambda a, x: [x[0]],
    "Conv": _conv,
    "Relu": lambda a, x: [F.relu(x[0])],
    "LeakyRelu": lambda a, x: [F.leaky_relu(x[0], a.get("alpha", 0.01))],
    "PRelu": lambda a, x: [torch.where(x[0] >= 0, x[0], x[0] * x[1])],
    "BatchNormalization": _batch_norm,
    "Add": lambda a, x: [x[0] + x[1]],
    "Sub": lambda a, x: [x[0] - x[1]],
    "Mul": lambda a, x: [x[0] * x[1]],
    "Div": _div,
    "Neg": lambda a, x: [-x[0]],
    "Cast": lambda a, x: [x[0].to(DTYPES[a["to"]])],
    "Transpose": lambda a, x: [x[0].permute(a.get("perm", list(reversed(range(x[0].dim())))))],
    "Reshape": _reshape,
    "Flatten": _flatten,
    "Concat": lambda a, x: [torch.cat(x, a["axis"])],
    "Shape": lambda a, x: [torch.tensor(x[0].shape[a.get("start", 0):a.get("end")], dtype=torch.int64)],
    "Gather": _gather,
    "Unsqueeze": _unsqueeze,
    "Slice": _slice,
    "Resize": _resize,
    "Gemm": _gemm,
    "MatMul": lambda a, x: [x[0] @ x[1]],
}


def _placed(array: np.ndarray[Any, Any], device: str) -> Any:
    """Float tensors on ``device``, integer ones (shapes, indices) on the CPU."""
    tensor = torch.from_numpy(np.array(array))
    return tensor.to(device) if tensor.is_floating_point() else tensor


class OnnxModule:
    """``module(*inputs)`` -> the graph's outputs, a list in the graph's output order."""

    def __init__(self, path: str | Path, device: str = "cpu") -> None:
        model = onnx.load(str(path))
        graph = model.graph
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
        self.constants = {t.name: _placed(numpy_helper.to_array(t), device) for t in graph.initializer}
        self.input_names = [i.name for i in graph.input if i.name not in self.constants]
        self.output_names = [o.name for o in graph.output]
        self.nodes: list[tuple[Op, list[str], list[str], dict[str, Any]]] = []
        for node in graph.node:
            attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            if node.op_type == "Constant":
                self.constants[node.output[0]] = _placed(numpy_helper.to_array(attributes["value"]), device)
                continue
            op = partial(_softmax, opset=self.opset) if node.op_type == "Softmax" else OPS.get(node.op_type)
            if op is None:
                raise NotImplementedError(f"ONNX operator {node.op_type} ({node.name}) is not supported")
            self.nodes.append((op, list(node.input), list(node.output), attributes))

    def __call__(self, *inputs: Any) -> list[Any]:
        values: dict[str, Any] = dict(self.constants)
        values.update(zip(self.input_names, inputs, strict=True))
        for op, names, outputs, attributes in self.nodes:
            args = [values[n] if n else None for n in names]
            values.update(zip(outputs, op(attributes, args), strict=False))
        return [values[n] for n in self.output_names]


def ordered(module: OnnxModule, names: Sequence[str]) -> list[int]:
    """Positions of ``names`` among the module's outputs."""
    return [module.output_names.index(n) for n in names]


def reduced_dtype(device: str) -> torch.dtype:
    """The reduced precision of a device: float16 on a GPU, bfloat16 on a CPU."""
    return torch.float16 if device.startswith("cuda") else torch.bfloat16


class CapturedGraph:
    """A captured CUDA graph and the outputs each of its replays rewrites."""

    def __init__(self, graph: Any, outputs: Any) -> None:
        self.graph, self.outputs = graph, outputs

    def replay(self) -> None:
        self.graph.replay()


def cuda_graph(call: Callable[[], Any]) -> CapturedGraph:
    """``call`` captured once as a CUDA graph, its input tensors fixed: a replay runs it with no Python or
    launch cost per operator."""
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up on a side stream, as capture requires
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = call()
    return CapturedGraph(graph, outputs)


Array = np.ndarray[Any, Any]


def torch_runner(path: Path, output_names: Sequence[str], device: str, reduced: bool = False,
                 graphs: bool = False) -> Callable[[Array], list[Array]]:
    """A ``facecore.runtimes.Runner`` over the ONNX file run by PyTorch: numpy in, numpy float32 out, in
    ``output_names`` order; ``reduced``: autocast to ``reduced_dtype``; ``graphs``: each input shape is
    captured once as a CUDA graph and replayed (a GPU only)."""
    torch.backends.cudnn.benchmark = True  # cuDNN times its kernels per shape, as an engine build would
    module = OnnxModule(path, device)
    order = ordered(module, output_names)
    captured: dict[tuple[Any, ...], tuple[CapturedGraph, Any]] = {}

    def forward(x: Any) -> list[Any]:
        with torch.inference_mode(), torch.autocast(device.split(":")[0], dtype=reduced_dtype(device),
                                                    enabled=reduced, cache_enabled=False):
            return module(x)

    def run(batch: Array) -> list[Array]:
        x = torch.from_numpy(np.ascontiguousarray(batch))
        if not graphs:
            outs = forward(x.to(device))
        else:
            key = (tuple(x.shape), x.dtype)
            if key not in captured:
                static = x.to(device)
                captured[key] = (cuda_graph(lambda: forward(static)), static)
            graph, static = captured[key]
            static.copy_(x)
            graph.replay()
            outs = graph.outputs
        return [outs[i].float().cpu().numpy() for i in order]

    return run
