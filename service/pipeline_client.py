"""Typed gRPC client for ``face_pipeline`` (sync for tools and tests, asyncio for the gateway)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from numpy.typing import NDArray
from tritonclient.utils import InferenceServerException

from facecore.spec import ModelSpec, spec_from_dict

MODEL = "face_pipeline"
OUTPUTS = ("BOXES", "SCORES", "LANDMARKS", "EMBEDDINGS", "BLUR", "IMAGE_SIZE", "CROPS")


class PipelineError(Exception):
    """``face_pipeline`` refused or failed a request. ``invalid_input`` is the caller's mistake."""

    def __init__(self, message: str, status: str | None) -> None:
        super().__init__(message)
        self.status = status or ""

    @property
    def invalid_input(self) -> bool:
        return self.status == "StatusCode.INVALID_ARGUMENT"

    @classmethod
    def from_exception(cls, exc: InferenceServerException) -> PipelineError:
        return cls(str(exc.message()), exc.status())


@dataclass(frozen=True)
class PipelineFaces:
    """All faces of one image, in its pixel coordinates; embeddings are L2-normalized."""

    boxes: NDArray[np.float32]  # [N, 4] x1, y1, x2, y2
    scores: NDArray[np.float32]  # [N]
    landmarks: NDArray[np.float32]  # [N, 5, 2]
    embeddings: NDArray[np.float32]  # [N, D]
    blur: NDArray[np.float32]  # [N]
    crops: NDArray[np.uint8]  # [N, 112, 112, 3] BGR when asked for, else [0, ...]
    width: int
    height: int

    def __len__(self) -> int:
        return int(self.scores.shape[0])


def build_inputs(
    image: bytes,
    score_threshold: float | None = None,
    max_faces: int | None = None,
    min_face_size: float | None = None,
    return_crops: bool = False,
) -> list[grpcclient.InferInput]:
    """Request tensors: the encoded image and whichever per-request settings are given."""
    encoded = grpcclient.InferInput("IMAGE", [1, 1], "BYTES")
    encoded.set_data_from_numpy(np.array([[image]], dtype=np.object_))
    inputs = [encoded]
    optional = {
        "SCORE_THRESHOLD": (score_threshold, np.float32, "FP32"),
        "MAX_FACES": (max_faces, np.int32, "INT32"),
        "MIN_FACE_SIZE": (min_face_size, np.float32, "FP32"),
        "RETURN_CROPS": (True if return_crops else None, np.bool_, "BOOL"),
    }
    for name, (value, dtype, triton_type) in optional.items():
        if value is not None:
            tensor = grpcclient.InferInput(name, [1, 1], triton_type)
            tensor.set_data_from_numpy(np.array([[value]], dtype=dtype))
            inputs.append(tensor)
    return inputs


def requested_outputs() -> list[grpcclient.InferRequestedOutput]:
    return [grpcclient.InferRequestedOutput(name) for name in OUTPUTS]


def parse_result(result: grpcclient.InferResult) -> PipelineFaces:
    def out(name: str) -> NDArray[np.generic]:
        array = result.as_numpy(name)
        if array is None:
            raise PipelineError(f"{MODEL} returned no {name}", None)
        first: NDArray[np.generic] = array[0]  # tritonclient is untyped
        return first

    width, height = (int(v) for v in out("IMAGE_SIZE"))
    return PipelineFaces(
        boxes=out("BOXES").astype(np.float32), scores=out("SCORES").astype(np.float32),
        landmarks=out("LANDMARKS").astype(np.float32), embeddings=out("EMBEDDINGS").astype(np.float32),
        blur=out("BLUR").astype(np.float32), crops=out("CROPS").astype(np.uint8), width=width, height=height,
    )


def embedder_from_config(config: dict[str, Any]) -> ModelSpec:
    """The embedder description ``export`` recorded in face_pipeline's config parameters."""
    parameters = config.get("config", config).get("parameters", {})
    try:
        return spec_from_dict(json.loads(parameters["embedder"]["string_value"]))
    except (KeyError, ValueError) as exc:
        raise PipelineError(f"{MODEL} config has no valid embedder description: {exc}", None) from exc


class PipelineClient:
    """Blocking client (tools, tests, benchmarks)."""

    def __init__(self, url: str, timeout_s: float | None = 30.0) -> None:
        self._client = grpcclient.InferenceServerClient(url)
        self._timeout = timeout_s

    def infer(self, image: bytes, **settings: float | int | bool | None) -> PipelineFaces:
        try:
            result = self._client.infer(MODEL, build_inputs(image, **settings),  # type: ignore[arg-type]
                                        outputs=requested_outputs(), client_timeout=self._timeout)
        except InferenceServerException as exc:
            raise PipelineError.from_exception(exc) from exc
        return parse_result(result)

    def embedder(self) -> ModelSpec:
        """The embedding model served behind the pipeline (name, dimension, default threshold)."""
        try:
            config = self._client.get_model_config(MODEL, as_json=True)
        except InferenceServerException as exc:
            raise PipelineError.from_exception(exc) from exc
        return embedder_from_config(config)

    def close(self) -> None:
        self._client.close()


class AsyncPipelineClient:
    """asyncio client for the gateway; one per process, shared by requests."""

    def __init__(self, url: str, timeout_s: float | None = 30.0) -> None:
        self._client = aioclient.InferenceServerClient(url)
        self._timeout = timeout_s

    async def infer(self, image: bytes, **settings: float | int | bool | None) -> PipelineFaces:
        try:
            result = await self._client.infer(MODEL, build_inputs(image, **settings),  # type: ignore[arg-type]
                                              outputs=requested_outputs(), client_timeout=self._timeout)
        except InferenceServerException as exc:
            raise PipelineError.from_exception(exc) from exc
        return parse_result(result)

    async def embedder(self) -> ModelSpec:
        try:
            config = await self._client.get_model_config(MODEL, as_json=True)
        except InferenceServerException as exc:
            raise PipelineError.from_exception(exc) from exc
        return embedder_from_config(config)

    async def ready(self) -> bool:
        try:
            return bool(await self._client.is_model_ready(MODEL))
        except InferenceServerException:
            return False

    async def close(self) -> None:
        await self._client.close()
