"""The wire contract of ``face_pipeline``: model names, tensor names, dtypes and shapes, the request
options and the one result type, ``Faces``.

Defined here once and used by the exporter (``config.pbtxt``), by ``model_repository/face_pipeline``
(reading requests, writing responses) and by the clients in ``facecore.client``. Shapes are per
request, after the batch axis (every model has ``max_batch_size > 0``); -1 is a variable size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np
from numpy.typing import NDArray

PIPELINE_MODEL = "face_pipeline"
DETECTOR_MODEL = "face_detector"
EMBEDDER_MODEL = "face_embedder"


class DataType(StrEnum):
    """Triton's data type names (``TYPE_`` + this in a model config)."""

    BYTES = "BYTES"
    BOOL = "BOOL"
    UINT8 = "UINT8"
    INT32 = "INT32"
    FP32 = "FP32"

    @property
    def numpy(self) -> type[np.generic]:
        return _NUMPY[self]

    @property
    def config_name(self) -> str:
        """The name in ``config.pbtxt`` (``TYPE_STRING`` for BYTES)."""
        return "TYPE_STRING" if self is DataType.BYTES else f"TYPE_{self.value}"


_NUMPY: dict[DataType, type[np.generic]] = {
    DataType.BYTES: np.object_, DataType.BOOL: np.bool_, DataType.UINT8: np.uint8,
    DataType.INT32: np.int32, DataType.FP32: np.float32,
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: DataType
    dims: tuple[int, ...]
    optional: bool = False


class Input(StrEnum):
    IMAGE = "IMAGE"  # the encoded image (JPEG, PNG, WebP, BMP)
    SCORE_THRESHOLD = "SCORE_THRESHOLD"  # detector score at least this (default: the config's)
    MAX_FACES = "MAX_FACES"  # the best N faces at most
    MIN_FACE_SIZE = "MIN_FACE_SIZE"  # shorter box side at least this, in original pixels
    RETURN_CROPS = "RETURN_CROPS"  # fill CROPS with the aligned faces


class Output(StrEnum):
    BOXES = "BOXES"  # [N, 4] x1, y1, x2, y2 in original pixels
    SCORES = "SCORES"  # [N] detector scores, best first
    LANDMARKS = "LANDMARKS"  # [N, 5, 2] eyes, nose, mouth corners
    EMBEDDINGS = "EMBEDDINGS"  # [N, D] L2-normalized
    BLUR = "BLUR"  # [N] variance of the Laplacian of the aligned crop
    IMAGE_SIZE = "IMAGE_SIZE"  # [2] width, height of the original image
    CROPS = "CROPS"  # [N, S, S, 3] aligned crops, BGR, when RETURN_CROPS; else [0, S, S, 3]


_OPTION_TYPES = {Input.SCORE_THRESHOLD: DataType.FP32, Input.MAX_FACES: DataType.INT32,
                 Input.MIN_FACE_SIZE: DataType.FP32, Input.RETURN_CROPS: DataType.BOOL}


def pipeline_inputs() -> tuple[TensorSpec, ...]:
    options = tuple(TensorSpec(name.value, dtype, (1,), optional=True)
                    for name, dtype in _OPTION_TYPES.items())
    return (TensorSpec(Input.IMAGE.value, DataType.BYTES, (1,)), *options)


def pipeline_outputs(embedding_dim: int, crop_size: int) -> tuple[TensorSpec, ...]:
    shapes: dict[Output, tuple[DataType, tuple[int, ...]]] = {
        Output.BOXES: (DataType.FP32, (-1, 4)),
        Output.SCORES: (DataType.FP32, (-1,)),
        Output.LANDMARKS: (DataType.FP32, (-1, 5, 2)),
        Output.EMBEDDINGS: (DataType.FP32, (-1, embedding_dim)),
        Output.BLUR: (DataType.FP32, (-1,)),
        Output.IMAGE_SIZE: (DataType.INT32, (2,)),
        Output.CROPS: (DataType.UINT8, (-1, crop_size, crop_size, 3)),
    }
    return tuple(TensorSpec(name.value, dtype, dims) for name, (dtype, dims) in shapes.items())


@dataclass(frozen=True)
class RequestOptions:
    """Per-request settings of ``face_pipeline``; None leaves the model's configured default."""

    score_threshold: float | None = None
    max_faces: int | None = None
    min_face_size: float | None = None
    return_crops: bool = False

    def tensors(self) -> list[tuple[str, DataType, NDArray[np.generic]]]:
        """(name, type, array) of the optional inputs that are set, each shaped [1, 1] (a batch of one)."""
        values: dict[Input, object] = {
            Input.SCORE_THRESHOLD: self.score_threshold, Input.MAX_FACES: self.max_faces,
            Input.MIN_FACE_SIZE: self.min_face_size, Input.RETURN_CROPS: True if self.return_crops else None,
        }
        return [(name.value, _OPTION_TYPES[name], np.array([[value]], dtype=_OPTION_TYPES[name].numpy))
                for name, value in values.items() if value is not None]

    @classmethod
    def from_tensors(cls, get: Callable[[str], NDArray[np.generic] | None]) -> RequestOptions:
        """Inverse of ``tensors``: ``get(name)`` returns an input array, or None when absent."""

        def scalar(name: Input) -> float | None:
            array = get(name.value)
            return None if array is None else float(array.reshape(-1)[0])

        threshold, faces, size = (scalar(Input.SCORE_THRESHOLD), scalar(Input.MAX_FACES),
                                  scalar(Input.MIN_FACE_SIZE))
        return cls(threshold, None if faces is None else int(faces), size, bool(scalar(Input.RETURN_CROPS)))


@dataclass(frozen=True)
class Faces:
    """Every face of one image, in that image's pixels, best detector score first."""

    boxes: NDArray[np.float32]  # [N, 4] x1, y1, x2, y2
    scores: NDArray[np.float32]  # [N]
    landmarks: NDArray[np.float32]  # [N, 5, 2]
    embeddings: NDArray[np.float32]  # [N, D], L2-normalized
    blur: NDArray[np.float32]  # [N]
    crops: NDArray[np.uint8]  # [N, S, S, 3] BGR, or [0, S, S, 3] when not asked for
    width: int
    height: int

    def __len__(self) -> int:
        return int(self.scores.shape[0])

    def areas(self) -> NDArray[np.float32]:
        return np.asarray((self.boxes[:, 2] - self.boxes[:, 0]) * (self.boxes[:, 3] - self.boxes[:, 1]),
                          dtype=np.float32)

    def to_arrays(self, with_crops: bool = True) -> dict[str, NDArray[np.generic]]:
        """Output tensors without the batch axis (``face_pipeline`` adds it)."""
        return {
            Output.BOXES.value: self.boxes, Output.SCORES.value: self.scores,
            Output.LANDMARKS.value: self.landmarks, Output.EMBEDDINGS.value: self.embeddings,
            Output.BLUR.value: self.blur,
            Output.IMAGE_SIZE.value: np.array([self.width, self.height], dtype=np.int32),
            Output.CROPS.value: self.crops if with_crops else self.crops[:0],
        }

    @classmethod
    def from_arrays(cls, get: Callable[[str], NDArray[np.generic]]) -> Faces:
        """Inverse of ``to_arrays``: ``get(name)`` returns one output without the batch axis."""
        width, height = (int(v) for v in get(Output.IMAGE_SIZE.value))
        def array(name: Output, dtype: type[np.generic]) -> NDArray[Any]:
            return np.asarray(get(name.value), dtype=dtype)  # no copy when the type already matches

        return cls(
            boxes=array(Output.BOXES, np.float32), scores=array(Output.SCORES, np.float32),
            landmarks=array(Output.LANDMARKS, np.float32), embeddings=array(Output.EMBEDDINGS, np.float32),
            blur=array(Output.BLUR, np.float32), crops=array(Output.CROPS, np.uint8),
            width=width, height=height,
        )


OUTPUT_NAMES: tuple[str, ...] = tuple(name.value for name in Output)
