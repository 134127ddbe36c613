"""``export/onnx_tools.py`` against ONNX's reference implementation and ONNX Runtime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from numpy.typing import NDArray
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from export.defaults import DefaultModels
from export.onnx_tools import (
    dequantize,
    describe,
    fold_weight_dequantization,
    make_batch_dynamic,
    output_layers,
    save_checked,
    split_output_weights,
    to_bfloat16,
    uint8_nhwc_input,
)
from facecore.onnx_runtime import create_session
from facecore.processing import to_tensor

OPSET = 21
IR_VERSION = 10
INT_TYPES = {np.dtype(np.int8): TensorProto.INT8, np.dtype(np.uint8): TensorProto.UINT8}


def reference_dequantize(
    quantized: NDArray[np.generic],
    scale: NDArray[np.float32],
    zero_point: NDArray[np.generic] | None,
    axis: int,
    block_size: int,
) -> NDArray[np.float32]:
    """One DequantizeLinear node (opset 21) run by ``onnx.reference``."""
    names = ["x", "s"] + (["z"] if zero_point is not None else [])
    node = helper.make_node("DequantizeLinear", names, ["y"], axis=axis, block_size=block_size)
    inputs = [
        helper.make_tensor_value_info("x", INT_TYPES[quantized.dtype], quantized.shape),
        helper.make_tensor_value_info("s", TensorProto.FLOAT, scale.shape),
    ]
    feeds = {"x": quantized, "s": scale}
    if zero_point is not None:
        inputs.append(helper.make_tensor_value_info("z", INT_TYPES[zero_point.dtype], zero_point.shape))
        feeds["z"] = zero_point
    output = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph([node], "dq", inputs, [output])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)
    return np.asarray(ReferenceEvaluator(model).run(None, feeds)[0])


CASES = [
    # (shape, axis, block_size, scale shape)
    ((6, 5), 1, 0, ()),  # per tensor, scalar scale
    ((6, 5), 1, 0, (1,)),  # per tensor, one-element scale
    ((4, 3, 5), 1, 0, (3,)),  # per axis
    ((6, 5), 0, 0, (6,)),
    ((6, 5), -1, 0, (5,)),
    ((5, 7), 1, 3, (5, 3)),  # blocked, 7 = 3 + 3 + 1
    ((7, 4), 0, 2, (4, 4)),  # blocked along axis 0, 7 = 2 + 2 + 2 + 1
    ((10, 3), 0, 4, (3, 3)),
    ((2, 11, 3), 1, 5, (2, 3, 3)),
    ((3, 8), 1, 4, (3, 2)),  # evenly divided
    ((3, 8), -1, 3, (3, 3)),
]


@pytest.mark.parametrize("dtype", [np.int8, np.uint8])
@pytest.mark.parametrize("with_zero", [True, False])
@pytest.mark.parametrize(("shape", "axis", "block_size", "scale_shape"), CASES)
def test_dequantize_matches_onnx_reference(
    dtype: type[np.integer],
    with_zero: bool,
    shape: tuple[int, ...],
    axis: int,
    block_size: int,
    scale_shape: tuple[int, ...],
) -> None:
    rng = np.random.default_rng([*shape, axis + 10, block_size, int(with_zero)])
    info = np.iinfo(dtype)
    quantized = rng.integers(info.min, info.max + 1, size=shape).astype(dtype)
    scale = rng.uniform(0.001, 0.5, size=scale_shape).astype(np.float32)
    zero = rng.integers(info.min, info.max + 1, size=scale_shape).astype(dtype) if with_zero else None
    expected = reference_dequantize(quantized, scale, zero, axis, block_size)
    actual = dequantize(quantized, scale, zero, axis, block_size)
    assert actual.dtype == np.float32
    assert actual.shape == shape
    np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=0)


def test_dequantize_blocked_by_hand() -> None:
    quantized = np.array([[10, 20, 30, 40, 50]], np.int8)
    scale = np.array([[0.5, 2.0]], np.float32)
    zero = np.array([[10, -10]], np.int8)
    # Blocks of 3 along axis 1: columns 0-2 use (0.5, 10), columns 3-4 use (2.0, -10).
    np.testing.assert_array_equal(dequantize(quantized, scale, zero, 1, 3), [[0, 5, 10, 100, 120]])


# --------------------------------------------------------------------------------------------
# Folding a block-quantized model


QuantizedWeight = tuple[NDArray[np.int8], NDArray[np.float32], NDArray[np.int8]]


def quantized_weight(rng: np.random.Generator) -> QuantizedWeight:
    """int8 weight [2, 12], blocks of 5 along axis 1 (12 = 5 + 5 + 2)."""
    weight = rng.integers(-128, 128, size=(2, 12)).astype(np.int8)
    scale = rng.uniform(0.01, 0.1, size=(2, 3)).astype(np.float32)
    zero = rng.integers(-5, 6, size=(2, 3)).astype(np.int8)
    return weight, scale, zero


def build_model(fan_out: bool = False) -> onnx.ModelProto:
    """x [1, 4] -> MatMul(x, Reshape(DequantizeLinear(w_q), [4, 6])) + b -> Reshape [1, 2, 3] -> y.

    ``b`` is an initializer that is also listed as a graph input (old exporters did that). With
    ``fan_out`` the dequantized weight [4, 6] feeds the MatMul directly and a Reshape of it (to
    [24]) feeds a second output, so the DequantizeLinear result has two consumers.
    """
    rng = np.random.default_rng(42)
    weight, scale, zero = quantized_weight(rng)
    bias = rng.normal(size=6).astype(np.float32)
    if fan_out:
        weight = weight.reshape(4, 6)
        scale = rng.uniform(0.01, 0.1, size=(4, 2)).astype(np.float32)  # blocks of 5 along 6 columns
        zero = rng.integers(-5, 6, size=(4, 2)).astype(np.int8)
    initializers = [
        numpy_helper.from_array(weight, "w_q"),
        numpy_helper.from_array(scale, "w_scale"),
        numpy_helper.from_array(zero, "w_zero"),
        numpy_helper.from_array(bias, "b"),
        numpy_helper.from_array(np.array([4, 6], np.int64), "w_shape"),
        numpy_helper.from_array(np.array([1, 2, 3], np.int64), "out_shape"),
        numpy_helper.from_array(np.array([24], np.int64), "flat_shape"),
    ]
    dq = helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zero"], ["w_dq"], axis=1, block_size=5)
    nodes = [dq]
    if fan_out:
        nodes += [
            helper.make_node("MatMul", ["x", "w_dq"], ["mm"]),
            helper.make_node("Reshape", ["w_dq", "flat_shape"], ["w_flat"]),
        ]
    else:
        nodes += [
            helper.make_node("Reshape", ["w_dq", "w_shape"], ["w"]),
            helper.make_node("MatMul", ["x", "w"], ["mm"]),
        ]
    nodes += [
        helper.make_node("Add", ["mm", "b"], ["sum"]),
        helper.make_node("Reshape", ["sum", "out_shape"], ["y"]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 3])]
    if fan_out:
        outputs.append(helper.make_tensor_value_info("w_flat", TensorProto.FLOAT, [24]))
    graph = helper.make_graph(
        nodes,
        "tiny",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, [6]),
        ],
        outputs,
        initializer=initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)
    onnx.checker.check_model(model)
    return model


def copy(model: onnx.ModelProto) -> onnx.ModelProto:
    duplicate = onnx.ModelProto()
    duplicate.CopyFrom(model)
    return duplicate


def run(model: onnx.ModelProto, x: NDArray[np.float32]) -> list[NDArray[np.float32]]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return [np.asarray(out) for out in session.run(None, {"x": x})]


def test_fold_and_make_batch_dynamic() -> None:
    original = build_model()
    converted = make_batch_dynamic(fold_weight_dequantization(copy(original)))
    onnx.checker.check_model(converted, full_check=True)

    graph = converted.graph
    assert [node.op_type for node in graph.node] == ["MatMul", "Add", "Reshape"]
    assert all(node.op_type != "DequantizeLinear" for node in graph.node)
    initializers = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    assert sorted(initializers) == ["b", "out_shape", "w"]
    assert initializers["w"].dtype == np.float32
    assert initializers["w"].shape == (4, 6)
    assert initializers["b"].dtype == np.float32
    assert all(array.dtype in (np.float32, np.int64) for array in initializers.values())
    assert initializers["out_shape"].tolist() == [-1, 2, 3]

    # The folded weight is the dequantized one, reshaped.
    weight, scale, zero = quantized_weight(np.random.default_rng(42))
    np.testing.assert_array_equal(initializers["w"], dequantize(weight, scale, zero, 1, 5).reshape(4, 6))

    # Only the real input remains; batch axes are dynamic.
    assert [value.name for value in graph.input] == ["x"]
    for value in [*graph.input, *graph.output]:
        assert value.type.tensor_type.shape.dim[0].dim_param == "batch"
        assert not value.type.tensor_type.shape.dim[0].HasField("dim_value")
    assert [d.dim_value for d in graph.input[0].type.tensor_type.shape.dim[1:]] == [4]
    assert [d.dim_value for d in graph.output[0].type.tensor_type.shape.dim[1:]] == [2, 3]

    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 4)).astype(np.float32)
    (before,) = run(original, x[:1])
    (after,) = run(converted, x[:1])
    assert after.shape == (1, 2, 3)
    np.testing.assert_allclose(after, before, rtol=1e-6, atol=1e-6)

    (batch,) = run(converted, x)
    assert batch.shape == (3, 2, 3)
    for i in range(3):
        np.testing.assert_allclose(batch[i : i + 1], run(original, x[i : i + 1])[0], rtol=1e-6, atol=1e-6)


def test_fold_works_in_place() -> None:
    original = build_model()
    folded = fold_weight_dequantization(original)
    assert folded is original  # works in place and returns the same model


def test_fold_dequantized_weight_with_two_consumers() -> None:
    original = build_model(fan_out=True)
    converted = fold_weight_dequantization(copy(original))
    onnx.checker.check_model(converted, full_check=True)
    x = np.random.default_rng(1).normal(size=(1, 4)).astype(np.float32)
    for before, after in zip(run(original, x), run(converted, x), strict=True):
        np.testing.assert_allclose(after, before, rtol=1e-6, atol=1e-6)


def test_fold_keeps_constants_still_used_elsewhere() -> None:
    rng = np.random.default_rng(3)
    initializers = [
        numpy_helper.from_array(rng.integers(-128, 128, size=(4, 6)).astype(np.int8), "w_q"),
        numpy_helper.from_array(rng.uniform(0.01, 0.1, size=4).astype(np.float32), "w_scale"),
        numpy_helper.from_array(np.array([6, 4], np.int64), "shape"),  # shared by both Reshapes
    ]
    nodes = [
        helper.make_node("DequantizeLinear", ["w_q", "w_scale"], ["w_dq"], axis=0),
        helper.make_node("Reshape", ["w_dq", "shape"], ["w"]),
        helper.make_node("Reshape", ["x", "shape"], ["x2"]),
        helper.make_node("Add", ["x2", "w"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "shared_shape",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [24])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [6, 4])],
        initializer=initializers,
    )
    original = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)
    onnx.checker.check_model(original)
    converted = fold_weight_dequantization(copy(original))
    onnx.checker.check_model(converted, full_check=True)
    x = np.random.default_rng(4).normal(size=24).astype(np.float32)
    np.testing.assert_allclose(run(converted, x)[0], run(original, x)[0], rtol=1e-6, atol=1e-6)


def test_make_batch_dynamic_reshape_with_inferred_axis() -> None:
    shape = numpy_helper.from_array(np.array([1, -1], np.int64), "shape")
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"])],
        "flatten",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6])],
        initializer=[shape],
    )
    model = make_batch_dynamic(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)
    )
    assert numpy_helper.to_array(model.graph.initializer[0]).tolist() == [0, -1]
    x = np.arange(24, dtype=np.float32).reshape(4, 2, 3)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], x.reshape(4, 6))


def test_describe(tmp_path: Path) -> None:
    path = tmp_path / "tiny.onnx"
    onnx.save(build_model(), str(path))
    text = describe(path)
    lines = text.splitlines()
    assert lines[0] == str(path)
    assert lines[1] == "  opsets: ai.onnx 21"
    assert "  input  x [1, 4]" in lines
    assert "  output y [1, 2, 3]" in lines
    assert not any(line.startswith("  input  b") for line in lines)  # initializer, not a real input

    converted = make_batch_dynamic(fold_weight_dequantization(build_model()))
    onnx.save(converted, str(path))
    lines = describe(path).splitlines()
    assert lines[2:] == ["  input  x [batch, 4]", "  output y [batch, 2, 3]"]


def test_rewrite_prelu_is_exact_for_any_slope(tmp_path: Path) -> None:
    from export.onnx_tools import optimize_file, rewrite_prelu

    slope = np.array([-0.8, 0.0, 0.25, 1.0, 1.3], np.float32).reshape(5, 1, 1)
    graph = helper.make_graph(
        [helper.make_node("PRelu", ["x", "a"], ["y"], name="act")],
        "prelu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 5, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 5, 4, 4])],
        initializer=[numpy_helper.from_array(slope, "a")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=IR_VERSION)
    path = tmp_path / "prelu.onnx"
    onnx.save(model, str(path))
    optimized = optimize_file(path, tmp_path / "fast.onnx")
    assert "PRelu" not in {n.op_type for n in onnx.load(str(optimized)).graph.node}
    x = np.random.default_rng(5).normal(size=(3, 5, 4, 4)).astype(np.float32)
    expected = np.where(x > 0, x, x * slope)
    got = ort.InferenceSession(str(optimized), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, expected)
    assert "PRelu" not in {n.op_type for n in rewrite_prelu(model).graph.node}


def test_uint8_nhwc_detector_input_equals_the_float_path(default_models: DefaultModels,
                                                         tmp_path: Path) -> None:
    """The graph edit moves Cast, mean, std, channel order and the transpose into the network: the same
    outputs as the float NCHW path on the same pixels, for BGR and for a network that wants RGB."""
    spec = default_models.detector
    pixels = np.random.default_rng(3).integers(0, 256, (2, 192, 256, 3), dtype=np.uint8)
    original = create_session(default_models.detector_file)
    for swap_rb, std in ((False, (1.0, 1.0, 1.0)), (True, (58.0, 57.0, 57.5))):
        edited = uint8_nhwc_input(onnx.load(str(default_models.detector_file)), spec.input_name, swap_rb,
                                  spec.mean, std)
        path = save_checked(edited, tmp_path / f"u8_{swap_rb}.onnx")
        session = create_session(path)
        assert session.get_inputs()[0].type == "tensor(uint8)"
        expected = original.run(None, {spec.input_name: to_tensor(pixels, swap_rb, spec.mean, std)})
        got = session.run(None, {spec.input_name: pixels})
        for a, b in zip(expected, got, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)


def test_uint8_detector_input_does_its_arithmetic_on_nchw_planes(default_models: DefaultModels) -> None:
    """Cast first (TensorRT takes a uint8 input only into a cast), then the transpose, then the channel
    order, mean and std as one constant per plane: a [3] mean broadcast along NHWC's innermost axis cost
    OpenVINO (bf16) 2.2 ms and ONNX Runtime 2.8 ms more per 512x640 image, for the same floats."""
    spec = default_models.detector
    edited = uint8_nhwc_input(onnx.load(str(default_models.detector_file)), spec.input_name, True,
                              spec.mean, (58.0, 57.0, 57.5))
    prefix = list(edited.graph.node[:5])
    assert [node.op_type for node in prefix] == ["Cast", "Transpose", "Gather", "Sub", "Div"]
    assert list(prefix[0].input) == [spec.input_name]
    assert onnx.helper.get_attribute_value(prefix[2].attribute[0]) == 1  # Gather on the channel axis
    constants = {i.name: numpy_helper.to_array(i) for i in edited.graph.initializer}
    for node in prefix[3:]:
        assert constants[node.input[1]].shape == (1, 3, 1, 1), node.name


def test_to_bfloat16_rounds_to_nearest_even_like_ml_dtypes() -> None:
    import ml_dtypes

    rng = np.random.default_rng(11)
    values = np.concatenate([rng.normal(size=10_000).astype(np.float32) * 10.0 ** rng.integers(-6, 6, 10_000),
                             np.array([0.0, -0.0, 1.0, 1.00390625, 1.01171875, 3.0e38, 1e-40], np.float32)])
    expected = values.astype(ml_dtypes.bfloat16).astype(np.float32)
    got = to_bfloat16(values)
    np.testing.assert_array_equal(got, expected)
    assert not (got.view(np.uint32) & 0xFFFF).any()


def test_output_layers_are_the_weighted_nodes_next_to_the_outputs(default_models: DefaultModels) -> None:
    """RetinaFace: the nine 1x1 convolutions of its class, box and landmark heads (three levels each), reached
    through the transposes, reshapes (and their Shape-computed sizes), concatenations and softmax."""
    model = onnx.load(str(default_models.detector_file))
    names = sorted(node.name for node in output_layers(model))
    assert len(names) == 9
    assert all(name.startswith(("/class_head/", "/bbox_head/", "/landmark_head/")) for name in names), names
    # A chain of two weighted layers before an output: only the last counts.
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    weights = [numpy_helper.from_array(np.ones((4, 4), np.float32), "w1"),
               numpy_helper.from_array(np.ones((4, 3), np.float32), "w2")]
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w1"], ["h"], name="first"),
                               helper.make_node("Relu", ["h"], ["r"], name="relu"),
                               helper.make_node("MatMul", ["r", "w2"], ["y"], name="last")],
                              "chain", [x], [y], weights)
    assert [n.name for n in output_layers(helper.make_model(graph))] == ["last"]


def test_bfloat16_weight_pairs_change_nothing_in_f32(default_models: DefaultModels, tmp_path: Path) -> None:
    """The split detector gives the original's outputs in f32 (ONNX Runtime); every high half is a
    bfloat16 value and high + low is the original weight exactly."""
    original = onnx.load(str(default_models.detector_file))
    weights = {init.name: numpy_helper.to_array(init) for init in original.graph.initializer}
    heads = {node.input[1] for node in output_layers(original)}
    split, count = split_output_weights(onnx.load(str(default_models.detector_file)))
    assert count == 9
    after = {init.name: numpy_helper.to_array(init) for init in split.graph.initializer}
    assert not heads & set(after)  # the originals are gone (no other node read them)
    for name in heads:
        high, low = after[f"{name}__bf16_high"], after[f"{name}__bf16_low"]
        assert not (high.view(np.uint32) & 0xFFFF).any()
        np.testing.assert_array_equal(high + low, weights[name])
        assert np.abs(low).max() > 0  # the rounding is not a no-op on these weights
    path = save_checked(split, tmp_path / "split.onnx")
    pixels = np.random.default_rng(4).normal(0, 60, (2, 3, 192, 256)).astype(np.float32)
    spec = default_models.detector
    expected = create_session(default_models.detector_file).run(None, {spec.input_name: pixels})
    got = create_session(path).run(None, {spec.input_name: pixels})
    for a, b in zip(expected, got, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_a_weight_shared_with_another_layer_keeps_its_original_there() -> None:
    """The same initializer read by a hidden layer and by the output layer: the output layer gets the pair,
    the hidden layer still reads the original, whole weight."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    w = np.random.default_rng(8).normal(size=(4, 4)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["h"], name="hidden"),
                               helper.make_node("MatMul", ["h", "w"], ["y"], name="out")],
                              "shared", [x], [y], [numpy_helper.from_array(w, "w")])
    model, count = split_output_weights(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                                                          ir_version=IR_VERSION))
    assert count == 1
    assert [list(n.input) for n in model.graph.node if n.op_type == "MatMul"] == [
        ["x", "w"], ["h", "w__bf16_high"], ["h", "w__bf16_low"]]
    feed = np.random.default_rng(9).normal(size=(2, 4)).astype(np.float32)
    np.testing.assert_allclose(ReferenceEvaluator(model).run(None, {"x": feed})[0], feed @ w @ w,
                               rtol=1e-5, atol=1e-5)


def test_a_split_layer_with_a_bias_adds_it_once() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    rng = np.random.default_rng(6)
    w, b = rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=3).astype(np.float32)
    graph = helper.make_graph([helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="fc")], "fc", [x], [y],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model, count = split_output_weights(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                                                          ir_version=IR_VERSION))
    assert count == 1 and [n.op_type for n in model.graph.node] == ["Gemm", "Gemm", "Add"]
    feed = rng.normal(size=(2, 4)).astype(np.float32)
    got = ReferenceEvaluator(model).run(None, {"x": feed})[0]
    np.testing.assert_allclose(got, feed @ w + b, rtol=1e-5, atol=1e-6)
