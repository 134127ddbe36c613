"""Typed gRPC clients for ``face_pipeline`` and the embedder behind it: blocking (tools, tests,
benchmarks, the importer's re-embedding) and asyncio (the gateway, the importer).

Requests and results follow ``facecore.contract``; every Triton error becomes a ``PipelineError``.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from numpy.typing import NDArray
from tritonclient.utils import InferenceServerException

from facecore.contract import (
    EMBEDDER_MODEL,
    OUTPUT_NAMES,
    PIPELINE_MODEL,
    DataType,
    Faces,
    Input,
    RequestOptions,
    image_tensor,
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


def _input(name: str, array: NDArray[Any], dtype: DataType) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), dtype.value)
    tensor.set_data_from_numpy(array)
    return tensor


def build_inputs(image: bytes, options: RequestOptions) -> list[grpcclient.InferInput]:
    """Request tensors: the encoded image and whichever per-request options are set."""
    inputs = [_input(Input.IMAGE.value, image_tensor(image), DataType.BYTES)]
    inputs += [_input(name, array, dtype) for name, dtype, array in options.tensors()]
    return inputs


def requested_outputs() -> list[grpcclient.InferRequestedOutput]:
    return [grpcclient.InferRequestedOutput(name) for name in OUTPUT_NAMES]


def parse_result(result: grpcclient.InferResult) -> Faces:
    def out(name: str) -> NDArray[np.generic]:
        array = result.as_numpy(name)
        if array is None:
            raise PipelineError(f"{PIPELINE_MODEL} returned no {name}", None)
        first: NDArray[np.generic] = array[0]  # tritonclient is untyped
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
        self._client = grpcclient.InferenceServerClient(url)
        self._timeout = timeout_s

    def infer(self, image: bytes, *, score_threshold: float | None = None, max_faces: int | None = None,
              min_face_size: float | None = None, return_crops: bool = False) -> Faces:
        options = _options(score_threshold, max_faces, min_face_size, return_crops)
        try:
            result = self._client.infer(PIPELINE_MODEL, build_inputs(image, options),
                                        outputs=requested_outputs(), client_timeout=self._timeout)
        except InferenceServerException as exc:
            raise PipelineError.from_exception(exc) from exc
        return parse_result(result)

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
        self._client.close()


class AsyncPipelineClient:
    """asyncio client for the gateway and the importer; one per process, shared by requests."""

    def __init__(self, url: str, timeout_s: float | None = 30.0) -> None:
        self._client = aioclient.InferenceServerClient(url)
        self._timeout = timeout_s

    async def infer(self, image: bytes, *, score_threshold: float | None = None, max_faces: int | None = None,
                    min_face_size: float | None = None, return_crops: bool = False) -> Faces:
        options = _options(score_threshold, max_faces, min_face_size, return_crops)
        try:
            result = await self._client.infer(PIPELINE_MODEL, build_inputs(image, options),
                                              outputs=requested_outputs(), client_timeout=self._timeout)
        except InferenceServerException as exc:
            raise PipelineError.from_exception(exc) from exc
        return parse_result(result)

    async def embedder(self) -> ModelSpec:
        try:
            config = await self._client.get_model_config(PIPELINE_MODEL, as_json=True)
        except InferenceServerException as exc:
            raise PipelineError.from_exception(exc) from exc
        return embedder_from_config(config)

    async def ready(self) -> bool:
        try:
            return bool(await self._client.is_model_ready(PIPELINE_MODEL))
        except InferenceServerException:
            return False

    async def close(self) -> None:
        await self._client.close()
