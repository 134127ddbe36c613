"""Typed gRPC clients for ``face_pipeline`` and the embedder behind it: blocking (tools, tests,
benchmarks, the importer's re-embedding) and asyncio (the gateway, the importer).

Requests and results follow ``facecore.contract``; every Triton error becomes a ``PipelineError``.
The ``face_pipeline`` call, the one every recognition request makes, is sent on the channel with its
request serialized and its response read here (``request_bytes``, ``faces_from_response``): tritonclient's
``InferInput`` / ``InferResult`` wrappers around the same protobuf messages cost the gateway more CPU per
call, and protobuf's own serializer copies the photo where one join around it is enough
(measured side by side in docs/benchmarks/README.md).
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any, Protocol

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
from google.protobuf import json_format
from numpy.typing import NDArray
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from facecore.contract import (
    EMBEDDER_MODEL,
    OUTPUT_NAMES,
    PIPELINE_MODEL,
    DataType,
    Faces,
    Input,
    RequestOptions,
)
from facecore.processing import l2_normalize, to_tensor
from facecore.spec import ModelSpec, spec_from_dict


class PipelineError(Exception):
    """``face_pipeline`` refused or failed a request. ``invalid_input`` is the caller's mistake."""

    def __init__(self, message: str, status: str | None) -> None:
        super().__init__(message)
        self.status = status or ""

    @property
    def invalid_input(self) -> bool:
        return self.status == "StatusCode.INVALID_ARGUMENT"

    @property
    def timed_out(self) -> bool:
        return self.status == "StatusCode.DEADLINE_EXCEEDED"

    @classmethod
    def from_exception(cls, exc: InferenceServerException) -> PipelineError:
        return cls(str(exc.message()), exc.status())

    @classmethod
    def from_rpc_error(cls, exc: grpc.RpcError) -> PipelineError:
        """The same message and status tritonclient gives for this error (``StatusCode.NAME``)."""
        call: Any = exc  # a grpc.Call as well; grpc's RpcError is untyped
        return cls(str(call.details() or ""), str(call.code()))


def _input(name: str, array: NDArray[Any], dtype: DataType) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), dtype.value)
    tensor.set_data_from_numpy(array)
    return tensor


#: The most a channel waits between attempts to reconnect to a Triton that went away. gRPC's default grows
#: to 120 s, and a call does not bring the next attempt forward: after an outage the gateway went on
#: answering 503 long after Triton was back up. Reconnecting to one known server every 2 s at most costs
#: nothing.
MAX_RECONNECT_BACKOFF_MS = 2000
#: Keepalive: a ping after KEEPALIVE_TIME_MS in which nothing came from Triton, and the connection closed
#: when it is not acknowledged within KEEPALIVE_TIMEOUT_MS; its calls then fail UNAVAILABLE (the gateway's
#: 503 with Retry-After) and free their in-flight slots. Without it (tritonclient's default is 2^31 ms), a
#: Triton that freezes or whose host vanishes without a reset left every call waiting out its 30 s timeout.
#: Triton must accept pings this often, with and without calls (service/launcher.py's ``keepalive_args``,
#: deploy/), or it answers GOAWAY too_many_pings after the third.
KEEPALIVE_TIME_MS = 2000
KEEPALIVE_TIMEOUT_MS = 2000


def channel_options() -> list[tuple[str, int]]:
    """The options of every channel to Triton: messages up to 2 GiB (as tritonclient's own clients), a
    reconnect backoff capped at ``MAX_RECONNECT_BACKOFF_MS``, and keepalive (``KEEPALIVE_TIME_MS``)."""
    return [
        ("grpc.initial_reconnect_backoff_ms", min(1000, MAX_RECONNECT_BACKOFF_MS)),
        ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
        ("grpc.max_send_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
        ("grpc.max_receive_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        # gRPC core waits for the ack of a ping already in flight up to this (1 minute by default), also
        # when keepalive's own timeout is shorter: without it a frozen Triton was noticed after 60 s
        ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        # idle channels too (no call in flight, pings without data in between): the gateway learns that
        # Triton went away before a request has to wait for it
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def infer_request(image: bytes, options: RequestOptions) -> service_pb2.ModelInferRequest:
    """``face_pipeline``'s request: the encoded image (a BYTES tensor [1, 1]: a 4-byte little-endian
    length, then the bytes), whichever per-request options are set, and every output asked for."""
    request = service_pb2.ModelInferRequest(model_name=PIPELINE_MODEL)
    request.inputs.add(name=Input.IMAGE.value, datatype=DataType.BYTES.value, shape=[1, 1])
    request.raw_input_contents.append(len(image).to_bytes(4, "little") + image)
    for name, dtype, array in options.tensors():
        request.inputs.add(name=name, datatype=dtype.value, shape=list(array.shape))
        request.raw_input_contents.append(array.tobytes())
    for name in OUTPUT_NAMES:
        request.outputs.add(name=name)
    return request


#: The method every face_pipeline call takes, and the tag of ``raw_input_contents`` (field 7,
#: length-delimited) in a serialized ``ModelInferRequest``.
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
_RAW_INPUT_TAG = b"\x3a"


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


@lru_cache(maxsize=256)
def _request_parts(options: RequestOptions) -> tuple[bytes, bytes]:
    """The serialized request without any tensor contents, and the options' contents as serialized fields."""
    request = infer_request(b"", options)
    contents = list(request.raw_input_contents)[1:]
    del request.raw_input_contents[:]
    fields = b"".join(_RAW_INPUT_TAG + _varint(len(raw)) + raw for raw in contents)
    return request.SerializeToString(), fields


def request_bytes(image: bytes, options: RequestOptions) -> bytes:
    """``infer_request(image, options)`` serialized, built with one copy of the image: the message's other
    fields serialized once per set of options, then the image's ``raw_input_contents`` field appended by
    hand, then the options' (a parser reads a repeated field's values in the order they come)."""
    header, options_fields = _request_parts(options)
    length = len(image)
    return b"".join((header, _RAW_INPUT_TAG, _varint(length + 4), length.to_bytes(4, "little"), image,
                     options_fields))


def faces_from_response(response: service_pb2.ModelInferResponse) -> Faces:
    """The faces of one ``face_pipeline`` response (its raw outputs, batch of one, read without a copy)."""
    arrays: dict[str, NDArray[np.generic]] = {}
    if len(response.outputs) != len(response.raw_output_contents):
        raise PipelineError(f"{PIPELINE_MODEL} returned {len(response.outputs)} outputs and "
                            f"{len(response.raw_output_contents)} output buffers", None)
    for output, raw in zip(response.outputs, response.raw_output_contents, strict=True):
        try:
            dtype = DataType(output.datatype).numpy
            arrays[output.name] = np.frombuffer(raw, dtype=dtype).reshape(tuple(output.shape))
        except (ValueError, TypeError) as exc:  # an unknown type, or a buffer that does not fit the shape
            raise PipelineError(f"{PIPELINE_MODEL} returned an unreadable {output.name} "
                                f"({output.datatype} {list(output.shape)}): {exc}", None) from exc

    def out(name: str) -> NDArray[np.generic]:
        array = arrays.get(name)
        if array is None or array.ndim == 0 or len(array) != 1:
            raise PipelineError(f"{PIPELINE_MODEL} returned no {name} for its one image", None)
        first: NDArray[np.generic] = array[0]
        return first

    return Faces.from_arrays(out)


def embedder_from_config(config: dict[str, Any]) -> ModelSpec:
    """The embedder description ``export`` recorded in face_pipeline's config parameters."""
    parameters = config.get("config", config).get("parameters", {})
    try:
        return spec_from_dict(json.loads(parameters["embedder"]["string_value"]))
    except (KeyError, ValueError) as exc:
        message = f"{PIPELINE_MODEL} config has no valid embedder description: {exc}"
        raise PipelineError(message, None) from exc


def _options(score_threshold: float | None, max_faces: int | None, min_face_size: float | None,
             return_crops: bool) -> RequestOptions:
    return RequestOptions(score_threshold, max_faces, min_face_size, return_crops)


class AsyncPipeline(Protocol):
    """What the use cases need of ``face_pipeline`` (``AsyncPipelineClient``, or a test double)."""

    async def infer(self, image: bytes, *, score_threshold: float | None = None, max_faces: int | None = None,
                    min_face_size: float | None = None, return_crops: bool = False) -> Faces: ...

    async def embedder(self) -> ModelSpec: ...


class PipelineClient:
    """Blocking client (tools, tests, benchmarks, re-embedding)."""

    def __init__(self, url: str, timeout_s: float | None = 30.0) -> None:
        self._client = grpcclient.InferenceServerClient(url, channel_args=channel_options())
        # face_pipeline's calls on a channel of their own, requests serialized here (see the module's doc)
        self._channel = grpc.insecure_channel(url, options=channel_options())
        self._infer = self._channel.unary_unary(MODEL_INFER, request_serializer=None,
                                                response_deserializer=service_pb2.ModelInferResponse.FromString)
        self._timeout = timeout_s

    def infer(self, image: bytes, *, score_threshold: float | None = None, max_faces: int | None = None,
              min_face_size: float | None = None, return_crops: bool = False) -> Faces:
        request = request_bytes(image, _options(score_threshold, max_faces, min_face_size, return_crops))
        try:
            response = self._infer(request, timeout=self._timeout)
        except grpc.RpcError as exc:
            raise PipelineError.from_rpc_error(exc) from exc
        return faces_from_response(response)

    def embedder(self) -> ModelSpec:
        """The embedding model served behind the pipeline (name, dimension, default threshold)."""
        try:
            config = self._client.get_model_config(PIPELINE_MODEL, as_json=True)
        except InferenceServerException as exc:
            raise PipelineError.from_exception(exc) from exc
        return embedder_from_config(config)

    def max_batch(self, model: str) -> int:
        """``model``'s ``max_batch_size`` as the server reports it (0: no batch dimension)."""
        try:
            config = self._client.get_model_config(model, as_json=True)["config"]
        except InferenceServerException as exc:
            raise PipelineError.from_exception(exc) from exc
        return int(config.get("max_batch_size", 0))

    def embed_crops(self, crops: NDArray[np.uint8], spec: ModelSpec, batch: int = 32) -> NDArray[np.float32]:
        """Aligned BGR crops [N, S, S, 3] -> L2-normalized embeddings, through ``face_embedder``, in calls of
        ``batch`` crops at most, and never more than the served model's ``max_batch_size``."""
        parts = []
        output = spec.output_names[0]
        batch = min(batch, self.max_batch(EMBEDDER_MODEL) or batch)
        for start in range(0, len(crops), batch):
            tensor = to_tensor(crops[start : start + batch], spec.swap_rb, spec.mean, spec.std)
            try:
                result = self._client.infer(EMBEDDER_MODEL, [_input(spec.input_name, tensor, DataType.FP32)],
                                            outputs=[grpcclient.InferRequestedOutput(output)],
                                            client_timeout=self._timeout)
            except InferenceServerException as exc:
                raise PipelineError.from_exception(exc) from exc
            parts.append(np.asarray(result.as_numpy(output), dtype=np.float32))
        return l2_normalize(np.concatenate(parts)) if parts else np.zeros((0, spec.embedding_dim), np.float32)

    def close(self) -> None:
        self._channel.close()
        self._client.close()


class AsyncPipelineClient:
    """asyncio client for the gateway and the importer; one per process, shared by requests. Every call
    goes through one channel: face_pipeline's with its request serialized here, the others through
    tritonclient's generated stub (see the module's doc)."""

    def __init__(self, url: str, timeout_s: float | None = 30.0) -> None:
        self._channel = grpc.aio.insecure_channel(url, options=channel_options())
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        self._infer = self._channel.unary_unary(MODEL_INFER, request_serializer=None,
                                                response_deserializer=service_pb2.ModelInferResponse.FromString)
        self._timeout = timeout_s

    async def infer(self, image: bytes, *, score_threshold: float | None = None, max_faces: int | None = None,
                    min_face_size: float | None = None, return_crops: bool = False) -> Faces:
        request = request_bytes(image, _options(score_threshold, max_faces, min_face_size, return_crops))
        try:
            response = await self._infer(request, timeout=self._timeout)
        except grpc.RpcError as exc:
            raise PipelineError.from_rpc_error(exc) from exc
        return faces_from_response(response)

    async def embedder(self) -> ModelSpec:
        try:
            response = await self._stub.ModelConfig(service_pb2.ModelConfigRequest(name=PIPELINE_MODEL),
                                                    timeout=self._timeout)
        except grpc.RpcError as exc:
            raise PipelineError.from_rpc_error(exc) from exc
        return embedder_from_config(json_format.MessageToDict(response, preserving_proto_field_name=True))

    async def ready(self, timeout: float | None = None) -> bool:
        """face_pipeline is ready in Triton; False also when Triton does not answer within ``timeout``
        (default: the client's, an inference's)."""
        try:
            response = await self._stub.ModelReady(service_pb2.ModelReadyRequest(name=PIPELINE_MODEL),
                                                   timeout=self._timeout if timeout is None else timeout)
        except grpc.RpcError:
            return False
        return bool(response.ready)

    async def close(self) -> None:
        await self._channel.close()
