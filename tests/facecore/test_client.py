"""The ``face_pipeline`` request built by hand and its response read by hand (``facecore.client``),
against what tritonclient's own wrappers build and read from the same protobuf messages; the request's
bytes as the client sends them, against protobuf's own serialization of that message."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from google.protobuf.internal.encoder import _VarintBytes  # protobuf's own varint writer
from tritonclient.grpc import service_pb2
from tritonclient.grpc._utils import _get_inference_request  # what tritonclient's infer() sends

from facecore.client import PipelineError, _varint, faces_from_response, infer_request, request_bytes
from facecore.contract import OUTPUT_NAMES, PIPELINE_MODEL, DataType, Faces, Input, RequestOptions

IMAGE = bytes(range(256)) * 40 + b"\xff\xd9"


def tritonclient_request(image: bytes, options: RequestOptions) -> service_pb2.ModelInferRequest:
    inputs = []
    for name, dtype, array in [(Input.IMAGE.value, DataType.BYTES, np.array([[image]], dtype=np.object_)),
                               *options.tensors()]:
        tensor = grpcclient.InferInput(name, list(array.shape), dtype.value)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return _get_inference_request(
        model_name=PIPELINE_MODEL, inputs=inputs, model_version="", request_id="",
        outputs=[grpcclient.InferRequestedOutput(name) for name in OUTPUT_NAMES], sequence_id=0,
        sequence_start=False, sequence_end=False, priority=0, timeout=None, parameters=None)


@pytest.mark.parametrize("options", [
    RequestOptions(None, None, None, False),
    RequestOptions(None, 100, None, False),
    RequestOptions(0.75, 3, 40.0, True),
    RequestOptions(0.5, None, 20.5, False),
])
@pytest.mark.parametrize("image", [IMAGE, b"", b"\x00"])
def test_the_request_is_byte_for_byte_what_tritonclient_sends(image: bytes, options: RequestOptions) -> None:
    ours, theirs = infer_request(image, options), tritonclient_request(image, options)
    assert ours == theirs
    assert ours.SerializeToString(deterministic=True) == theirs.SerializeToString(deterministic=True)


@pytest.mark.parametrize("options", [
    RequestOptions(None, None, None, False),
    RequestOptions(None, 100, None, False),
    RequestOptions(0.75, 3, 40.0, True),
    RequestOptions(0.5, None, 20.5, False),
])
@pytest.mark.parametrize("image", [IMAGE, b"", b"\x00", bytes(123) * 1000 + b"\xff\xd9"])
def test_the_bytes_sent_parse_as_tritonclients_request(image: bytes, options: RequestOptions) -> None:
    """The image goes out as one join of its bytes with the rest of the message serialized ahead of it: a
    protobuf parser reads it back as tritonclient's request, the image the first raw input, the options after
    in order, and the bytes are as long as protobuf's own serialization."""
    sent = request_bytes(image, options)
    parsed = service_pb2.ModelInferRequest.FromString(sent)
    theirs = tritonclient_request(image, options)
    assert parsed == theirs
    assert parsed.raw_input_contents[0] == len(image).to_bytes(4, "little") + image
    assert len(sent) == len(theirs.SerializeToString())
    assert request_bytes(image, options) == sent  # the cached parts are not changed by a call


@pytest.mark.parametrize("value", [0, 1, 127, 128, 300, 16_383, 16_384, 280_004, 2**31 - 1])
def test_varints_are_written_as_protobuf_writes_them(value: int) -> None:
    assert _varint(value) == _VarintBytes(value)


def response(faces: Faces, drop: str | None = None) -> service_pb2.ModelInferResponse:
    """A face_pipeline response as Triton sends it: every output with a batch axis of one, raw buffers."""
    message = service_pb2.ModelInferResponse(model_name=PIPELINE_MODEL)
    for name, array in faces.to_arrays().items():
        if name == drop:
            continue
        batched = np.ascontiguousarray(array)[None]
        dtype = {np.dtype(np.float32): "FP32", np.dtype(np.int32): "INT32", np.dtype(np.uint8): "UINT8"}
        message.outputs.add(name=name, datatype=dtype[batched.dtype], shape=list(batched.shape))
        message.raw_output_contents.append(batched.tobytes())
    return message


def two_faces() -> Faces:
    rng = np.random.default_rng(7)
    embeddings = rng.normal(size=(2, 128)).astype(np.float32)
    return Faces(boxes=rng.uniform(0, 100, (2, 4)).astype(np.float32),
                 scores=np.array([0.99, 0.8], np.float32),
                 landmarks=rng.uniform(0, 100, (2, 5, 2)).astype(np.float32),
                 embeddings=embeddings / np.linalg.norm(embeddings, axis=1, keepdims=True),
                 blur=np.array([120.0, 30.0], np.float32), crops=np.zeros((0, 112, 112, 3), np.uint8),
                 width=640, height=480)


def test_a_response_reads_back_the_faces_it_carries() -> None:
    faces = two_faces()
    read = faces_from_response(response(faces))
    assert (read.width, read.height) == (640, 480) and len(read) == 2
    for name, array in faces.to_arrays().items():
        np.testing.assert_array_equal(read.to_arrays()[name], array, err_msg=name)


@pytest.mark.parametrize("damage", ["missing output", "extra buffer", "short buffer", "unknown type",
                                   "batch of two"])
def test_a_malformed_response_is_a_pipeline_error_not_a_crash(damage: str) -> None:
    message = response(two_faces(), drop="EMBEDDINGS" if damage == "missing output" else None)
    if damage == "extra buffer":
        message.raw_output_contents.append(b"")
    elif damage == "short buffer":
        message.raw_output_contents[0] = message.raw_output_contents[0][:-4]
    elif damage == "unknown type":
        message.outputs[0].datatype = "FP64"
    elif damage == "batch of two":
        message.outputs[0].shape[0] = 2
        message.outputs[0].shape[1] //= 2
    with pytest.raises(PipelineError) as caught:
        faces_from_response(message)
    assert not caught.value.invalid_input


def test_the_channel_reconnects_to_a_returning_triton_within_seconds() -> None:
    """gRPC's reconnect backoff grows to 120 s by default, and calls do not bring the next attempt forward:
    after a 45 s outage the gateway went on answering 503 for 27 s with Triton back. Both channels (the
    blocking and the asyncio client) cap it."""
    from facecore.client import MAX_RECONNECT_BACKOFF_MS, channel_options

    options = dict(channel_options())
    assert options["grpc.max_reconnect_backoff_ms"] == MAX_RECONNECT_BACKOFF_MS <= 5000
    assert options["grpc.initial_reconnect_backoff_ms"] <= MAX_RECONNECT_BACKOFF_MS
    assert options["grpc.max_receive_message_length"] == grpcclient.MAX_GRPC_MESSAGE_SIZE
