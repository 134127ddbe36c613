"""ONNX graph surgery: fold block-quantized weights to fp32, make the batch axis dynamic, inspect."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from numpy.typing import NDArray
from onnx import helper, numpy_helper


def _attribute(node: onnx.NodeProto, name: str, default: int) -> int:
    for attribute in node.attribute:
        if attribute.name == name:
            return int(helper.get_attribute_value(attribute))
    return default


def dequantize(
    quantized: NDArray[np.generic], scale: NDArray[np.float32], zero_point: NDArray[np.generic] | None,
    axis: int, block_size: int,
) -> NDArray[np.float32]:
    """DequantizeLinear (opset 21) in numpy: per-tensor, per-axis or blocked along ``axis``."""
    values = quantized.astype(np.float32)
    zero = np.zeros_like(scale) if zero_point is None else zero_point.astype(np.float32)
    if scale.size == 1:
        return np.asarray((values - zero.reshape(())) * scale.reshape(()), dtype=np.float32)
    axis = axis % values.ndim
    if block_size == 0:  # per axis
        shape = [1] * values.ndim
        shape[axis] = -1
        return np.asarray((values - zero.reshape(shape)) * scale.reshape(shape), dtype=np.float32)
    length = values.shape[axis]
    full_scale = np.repeat(scale, block_size, axis=axis).take(range(length), axis=axis)
    full_zero = np.repeat(zero, block_size, axis=axis).take(range(length), axis=axis)
    return np.asarray((values - full_zero) * full_scale, dtype=np.float32)


def fold_weight_dequantization(model: onnx.ModelProto) -> onnx.ModelProto:
    """Replace DequantizeLinear (and a Reshape of its result) on constant weights by fp32 initializers.

    Folded tensors still read by a remaining node become initializers; initializers no remaining node
    reads are removed, as are graph inputs that are initializers (an old exporter habit) or unused.
    """
    graph = model.graph
    constants = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    folded: dict[str, NDArray[np.float32]] = {}
    remaining: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.op_type == "DequantizeLinear" and all(name in constants for name in node.input if name):
            zero = constants[node.input[2]] if len(node.input) > 2 and node.input[2] else None
            folded[node.output[0]] = dequantize(
                constants[node.input[0]], constants[node.input[1]], zero,
                _attribute(node, "axis", 1), _attribute(node, "block_size", 0),
            )
        elif node.op_type == "Reshape" and node.input[0] in folded and node.input[1] in constants:
            shape = tuple(int(v) for v in constants[node.input[1]])
            folded[node.output[0]] = folded[node.input[0]].reshape(shape)
        else:
            remaining.append(node)
    del graph.node[:]
    graph.node.extend(remaining)
    used = {name for node in remaining for name in node.input} | {o.name for o in graph.output}
    initializers = [init for init in graph.initializer if init.name in used]
    initializers += [numpy_helper.from_array(array, name) for name, array in folded.items() if name in used]
    del graph.initializer[:]
    graph.initializer.extend(initializers)
    constant_names = {init.name for init in initializers}
    inputs = [i for i in graph.input if i.name not in constant_names and i.name in used]
    del graph.input[:]
    graph.input.extend(inputs)
    return model


def make_batch_dynamic(model: onnx.ModelProto, name: str = "batch") -> onnx.ModelProto:
    """First axis of every graph input and output becomes a named dynamic dimension.

    Intermediate shapes that pin the batch (a Reshape to [1, ...]) are rewritten to -1 / 0 where the
    constant's first entry is 1.
    """
    for value in [*model.graph.input, *model.graph.output]:
        dims = value.type.tensor_type.shape.dim
        if dims:
            dims[0].ClearField("dim_value")
            dims[0].dim_param = name
    del model.graph.value_info[:]
    constants = {init.name: init for init in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Reshape" and node.input[1] in constants:
            shape = numpy_helper.to_array(constants[node.input[1]]).copy()
            if shape.size and shape[0] == 1:
                shape[0] = -1 if -1 not in shape[1:] else 0
                constants[node.input[1]].CopyFrom(numpy_helper.from_array(shape, node.input[1]))
    return model


def rewrite_prelu(model: onnx.ModelProto) -> onnx.ModelProto:
    """PRelu(x, a) -> Relu(x) - a * Relu(-x): the same values, computed with ONNX Runtime's fast kernels.

    On CPU, ONNX Runtime's PRelu with a per-channel slope is a slow broadcast and forces NCHWc layout
    reorders around it: on SFace it dominated the whole network's time. The rewrite is
    exact (slopes of any sign), unlike the common ``Max(x, a * x)`` which needs 0 <= a <= 1.
    """
    nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        if node.op_type != "PRelu":
            nodes.append(node)
            continue
        x, slope = node.input
        y = node.output[0]
        positive, negated, negative, scaled = (f"{y}__relu", f"{y}__neg", f"{y}__relu_neg", f"{y}__scaled")
        nodes += [
            helper.make_node("Relu", [x], [positive], name=f"{node.name}__relu"),
            helper.make_node("Neg", [x], [negated], name=f"{node.name}__neg"),
            helper.make_node("Relu", [negated], [negative], name=f"{node.name}__relu_neg"),
            helper.make_node("Mul", [negative, slope], [scaled], name=f"{node.name}__mul"),
            helper.make_node("Sub", [positive, scaled], [y], name=f"{node.name}__sub"),
        ]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


def uint8_nhwc_input(model: onnx.ModelProto, input_name: str, swap_rb: bool,
                     mean: tuple[float, float, float], std: tuple[float, float, float]) -> onnx.ModelProto:
    """Take uint8 NHWC BGR images instead of normalized float NCHW: the conversion moves into the graph.

    The new input keeps the old name; ``Cast -> Transpose(0, 3, 1, 2) -> [Gather channels when the network
    wants RGB] -> Sub mean -> [Div std]`` feeds the nodes that read the old one. 4x fewer bytes cross
    between the pipeline and the network (shared memory on CPU, PCIe on GPU), and the pipeline does no
    per-pixel arithmetic. ``mean``/``std`` are in the network's channel order, as in the description.

    The arithmetic runs on the NCHW planes, a [1, C, 1, 1] constant per plane, and the Cast comes first
    (TensorRT takes a uint8 input only into a cast): on ONNX Runtime, subtracting a [C] mean along the
    innermost axis of NHWC before the transpose was several times slower, with the same floats
    (docs/benchmarks/README.md).
    """
    graph = model.graph
    (old,) = [i for i in graph.input if i.name == input_name]
    dims = old.type.tensor_type.shape.dim
    batch, height, width = (d.dim_param or d.dim_value for d in (dims[0], dims[2], dims[3]))
    inner = f"{input_name}__nchw"
    for node in graph.node:
        node.input[:] = [inner if name == input_name else name for name in node.input]
    prefix = f"{input_name}__u8"
    nodes = [helper.make_node("Cast", [input_name], [f"{prefix}_f32"], to=onnx.TensorProto.FLOAT,
                              name=f"{prefix}_cast"),
             helper.make_node("Transpose", [f"{prefix}_f32"], [f"{prefix}_planes"], perm=[0, 3, 1, 2],
                              name=f"{prefix}_planes")]
    current = f"{prefix}_planes"
    per_plane = (1, 3, 1, 1)
    constants = [numpy_helper.from_array(np.asarray(mean, np.float32).reshape(per_plane), f"{prefix}_mean")]
    if swap_rb:
        constants.append(numpy_helper.from_array(np.array([2, 1, 0], np.int64), f"{prefix}_rgb"))
        nodes.append(helper.make_node("Gather", [current, f"{prefix}_rgb"], [f"{prefix}_swapped"], axis=1,
                                      name=f"{prefix}_swap"))
        current = f"{prefix}_swapped"
    scaled = any(v != 1.0 for v in std)
    centred = f"{prefix}_centred" if scaled else inner
    nodes.append(helper.make_node("Sub", [current, f"{prefix}_mean"], [centred], name=f"{prefix}_sub"))
    if scaled:
        std_planes = np.asarray(std, np.float32).reshape(per_plane)
        constants.append(numpy_helper.from_array(std_planes, f"{prefix}_std"))
        nodes.append(helper.make_node("Div", [centred, f"{prefix}_std"], [inner],
                                      name=f"{prefix}_div"))
    new_input = helper.make_tensor_value_info(input_name, onnx.TensorProto.UINT8, [batch, height, width, 3])
    graph.input.remove(old)
    graph.input.insert(0, new_input)
    graph.initializer.extend(constants)
    existing = list(graph.node)
    del graph.node[:]
    graph.node.extend([*nodes, *existing])
    return model


#: Ops whose arithmetic OpenVINO's CPU plugin runs at the bf16 inference precision (it keeps the graph's
#: tail, from the outputs back to the first of these, in f32).
_WEIGHTED = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})


def to_bfloat16(values: NDArray[np.float32]) -> NDArray[np.float32]:
    """``values`` rounded to the nearest bfloat16 (ties to even), as float32."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


def output_layers(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The weighted nodes (convolutions, matrix products) that produce the graph's outputs: walking back
    from every output through the nodes without weights (reshapes, transposes, concatenations, softmax),
    the first weighted node met on each path."""
    producer = {name: node for node in model.graph.node for name in node.output}
    found: dict[str, onnx.NodeProto] = {}
    seen: set[str] = set()
    pending = [o.name for o in model.graph.output]
    while pending:
        name = pending.pop()
        node = producer.get(name)
        if node is None or name in seen:
            continue
        seen.add(name)
        if node.op_type in _WEIGHTED:
            found.setdefault(node.name or node.output[0], node)
        else:
            pending.extend(node.input)
    return list(found.values())


def split_output_weights(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """Carry the weights of the output layers as a bfloat16 pair: ``W = W_hi + W_lo`` with ``W_hi``
    ``W`` rounded to bfloat16, and ``conv(x, W) = conv(x, W_hi) + conv(x, W_lo)``. Returns the model and
    how many layers were split.

    In bf16, OpenVINO rounds every weight to 8 significant bits. A detector's regression heads (box and
    landmark offsets) are sums with much cancellation, so that rounding moves landmarks of small faces by
    pixels (RetinaFace-mnet0.25: one embedding drifted to cosine 0.965, a decision changed); the pair keeps
    16 bits of every weight, and the sum lies in the f32 tail OpenVINO keeps after the last convolution.
    In f32 the two products add up to the original within rounding; the heads are ~1 % of the work.
    Only layers whose weight is a float32 initializer are split; a weight other nodes share keeps its
    original for them (the pair is new initializers).
    """
    graph = model.graph
    weights = {init.name: init for init in graph.initializer}
    pairs: dict[str, tuple[str, str]] = {}  # weight -> (high, low) initializer names
    split = 0
    nodes: list[onnx.NodeProto] = []
    targets = {node.output[0] for node in output_layers(model)}
    for node in graph.node:
        weight_index = 0 if node.op_type == "MatMul" and node.input[0] in weights else 1
        name = node.input[weight_index] if len(node.input) > weight_index else ""
        if (node.output[0] not in targets or name not in weights
                or weights[name].data_type != onnx.TensorProto.FLOAT):
            nodes.append(node)
            continue
        if name not in pairs:
            full = numpy_helper.to_array(weights[name])
            high = to_bfloat16(full)
            pairs[name] = (f"{name}__bf16_high", f"{name}__bf16_low")
            graph.initializer.extend([numpy_helper.from_array(high, pairs[name][0]),
                                      numpy_helper.from_array(np.asarray(full - high, np.float32),
                                                              pairs[name][1])])
        output = node.output[0]
        halves = []
        for half, weight in zip(("high", "low"), pairs[name], strict=True):
            part = onnx.NodeProto()
            part.CopyFrom(node)
            part.name = f"{node.name}__{half}"
            inputs = list(node.input)
            inputs[weight_index] = weight
            if half == "low" and node.op_type in ("Conv", "ConvTranspose", "Gemm"):
                inputs = inputs[:2]  # the bias is added once, by the high half
            del part.input[:]
            part.input.extend(inputs)
            part.output[:] = [f"{output}__{half}"]
            halves.append(part)
        nodes += [*halves, helper.make_node("Add", [h.output[0] for h in halves], [output],
                                            name=f"{node.name}__bf16_pair")]
        split += 1
    del graph.node[:]
    graph.node.extend(nodes)
    used = {name for node in graph.node for name in node.input}
    kept = [init for init in graph.initializer if init.name in used or init.name not in pairs]
    del graph.initializer[:]
    graph.initializer.extend(kept)  # a split weight no other node reads is gone
    return model, split


def save_checked(model: onnx.ModelProto, target: Path) -> Path:
    """Check the model, then write it atomically (temporary file, rename)."""
    onnx.checker.check_model(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    onnx.save(model, str(partial))
    partial.replace(target)
    return target


def optimize_file(source: Path, target: Path) -> Path:
    """``rewrite_prelu`` on an ONNX file (for user-supplied ArcFace/IResNet embedders, which use PReLU)."""
    return save_checked(rewrite_prelu(onnx.load(str(source))), target)


def convert_sface(source: Path, target: Path) -> Path:
    """SFace int8 block-quantized (opset 21, batch 1) -> fp32 weights, dynamic batch, fast PReLU."""
    return save_checked(rewrite_prelu(make_batch_dynamic(fold_weight_dequantization(onnx.load(str(source))))),
                        target)


def describe(path: Path) -> str:
    """Inputs, outputs and opset of an ONNX file, for writing a model description."""
    model = onnx.load(str(path), load_external_data=False)

    def shape(value: onnx.ValueInfoProto) -> str:
        dims = value.type.tensor_type.shape.dim
        return "[" + ", ".join(d.dim_param or str(d.dim_value) for d in dims) + "]"

    initializers = {init.name for init in model.graph.initializer}
    opsets = ", ".join(f"{o.domain or 'ai.onnx'} {o.version}" for o in model.opset_import)
    lines = [str(path), f"  opsets: {opsets}"]
    lines += [f"  input  {i.name} {shape(i)}" for i in model.graph.input if i.name not in initializers]
    lines += [f"  output {o.name} {shape(o)}" for o in model.graph.output]
    return "\n".join(lines)
