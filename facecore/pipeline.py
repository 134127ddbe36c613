"""The face pipeline as plain functions: decode -> detect -> align -> embed, for a batch of images.

The two network calls are injected (``Detector`` / ``Embedder``): inside Triton they are BLS calls
(``model_repository/face_pipeline``), in tools and benchmarks they are ONNX Runtime sessions.
The detector is called once per detector input size among the batch's images (one call for all of
them when the input size is fixed, as for TensorRT engines), and the embedder once for every face of
every image; each call is split only when above the model's maximum batch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from facecore.contract import DETECTOR_MODEL, EMBEDDER_MODEL, Faces
from facecore.limits import DEFAULT_LIMITS
from facecore.processing import (
    Detections,
    DetectOptions,
    FloatArray,
    ImageArray,
    align_faces,
    blur_scores,
    l2_normalize,
    letterbox,
    postprocess_detections,
    softmax,
    to_tensor,
)
from facecore.spec import InputLayout, ModelSpec, Role, spec_from_dict

#: A network's input batch: float32 NCHW, or uint8 NHWC (``InputLayout``).
NetworkInput = NDArray[np.float32] | NDArray[np.uint8]


class Detector(Protocol):
    def __call__(self, batch: NetworkInput) -> tuple[FloatArray, FloatArray, FloatArray]:
        """Letterboxed images -> (loc [N,A,4], conf [N,A,2], landmarks [N,A,10])."""
        ...


class Embedder(Protocol):
    def __call__(self, batch: NetworkInput) -> FloatArray:
        """Aligned faces -> raw embeddings [N, D]."""
        ...


def network_input(images: ImageArray, spec: ModelSpec) -> NetworkInput:
    """NHWC uint8 BGR images [N, H, W, 3] -> the tensor the network takes (see ``InputLayout``)."""
    if spec.input_layout is InputLayout.NHWC_UINT8:
        return np.ascontiguousarray(images)
    return to_tensor(images, spec.swap_rb, spec.mean, spec.std)


@dataclass(frozen=True)
class PipelineSettings:
    """Everything ``face_pipeline`` reads from its config.pbtxt parameters."""

    detector: ModelSpec
    embedder: ModelSpec
    detector_max_batch: int = 8
    embedder_max_batch: int = 64
    score_threshold: float = 0.5
    nms_iou: float = 0.4
    max_faces: int = DEFAULT_LIMITS.max_faces
    min_face_size: float = 0.0
    max_pixels: int = DEFAULT_LIMITS.max_pixels
    detector_model: str = DETECTOR_MODEL
    embedder_model: str = EMBEDDER_MODEL
    #: True: the detector input follows each image's aspect ratio (multiples of 32, longer side at most
    #: the description's size) and shrinks when a minimum face size allows. False: always the fixed
    #: size (TensorRT engines built for 640x640).
    dynamic_input: bool = True
    #: Smallest face, in detector-input pixels, that the detector still finds reliably.
    detectable_face: float = 32.0
    #: JPEGs whose longer side is at least twice this are decoded at 1/2, 1/4 or 1/8 scale (never
    #: below this side). 0 disables reduced decoding.
    decode_min_side: int = 0
    #: Threads OpenCV's own parallel loops (resize, colour conversion, warps of large images) may use in
    #: each instance; 0 keeps OpenCV's default, one per CPU, in every instance.
    opencv_threads: int = 0

    def __post_init__(self) -> None:
        if self.detector.role is not Role.DETECTOR or self.embedder.role is not Role.EMBEDDER:
            raise ValueError("detector/embedder descriptions have the wrong roles")
        if min(self.detector_max_batch, self.embedder_max_batch, self.max_faces, self.max_pixels) < 1:
            raise ValueError("batch sizes, max_faces and max_pixels must be positive")
        if self.opencv_threads < 0:
            raise ValueError("opencv_threads must be >= 0 (0: OpenCV's default)")
        if not 0.0 <= self.score_threshold <= 1.0 or not 0.0 < self.nms_iou <= 1.0:
            raise ValueError("score_threshold must be in [0, 1] and nms_iou in (0, 1]")

    @property
    def default_options(self) -> DetectOptions:
        return DetectOptions(self.score_threshold, self.nms_iou, self.max_faces, self.min_face_size)

    def to_parameters(self) -> dict[str, str]:
        """String parameters for a Triton model config (specs as JSON)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {
            key: json.dumps(asdict(value)) if isinstance(value, ModelSpec) else str(value)
            for key, value in values.items()
        }

    @classmethod
    def from_parameters(cls, parameters: Mapping[str, str]) -> PipelineSettings:
        """Inverse of ``to_parameters``; unknown keys are ignored, bad values raise ValueError."""
        values: dict[str, object] = {}
        for f in fields(cls):
            if f.name not in parameters:
                continue
            raw = parameters[f.name]
            if f.name in ("detector", "embedder"):
                values[f.name] = spec_from_dict(json.loads(raw))
            else:
                kinds: dict[str, Callable[[str], object]] = {"int": int, "float": float, "str": str,
                                                             "bool": _parse_bool}
                kind = kinds[str(f.type)]
                try:
                    values[f.name] = kind(raw)
                except ValueError as exc:
                    raise ValueError(f"parameter {f.name}={raw!r} is not a valid {kind.__name__}") from exc
        if "detector" not in values or "embedder" not in values:
            raise ValueError("parameters 'detector' and 'embedder' (model descriptions) are required")
        return cls(**values)  # type: ignore[arg-type]


def _parse_bool(raw: str) -> bool:
    if raw.strip().lower() in ("true", "1", "yes"):
        return True
    if raw.strip().lower() in ("false", "0", "no"):
        return False
    raise ValueError(f"not a boolean: {raw!r}")


def validate_options(
    settings: PipelineSettings,
    score_threshold: float | None = None,
    max_faces: int | None = None,
    min_face_size: float | None = None,
) -> DetectOptions:
    """Per-request settings merged over the defaults; ValueError names a bad one."""
    defaults = settings.default_options
    threshold = defaults.score_threshold if score_threshold is None else float(score_threshold)
    faces = defaults.max_faces if max_faces is None else int(max_faces)
    min_size = defaults.min_face_size if min_face_size is None else float(min_face_size)
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"score_threshold must be in [0, 1], got {threshold}")
    if not 1 <= faces <= settings.max_faces:
        raise ValueError(f"max_faces must be in [1, {settings.max_faces}], got {faces}")
    if not 0.0 <= min_size <= 1e5:
        raise ValueError(f"min_face_size must be in [0, 100000] pixels, got {min_size}")
    return DetectOptions(threshold, defaults.nms_iou, faces, min_size)


def _chunks(count: int, size: int) -> list[slice]:
    return [slice(start, min(start + size, count)) for start in range(0, count, size)]


def detector_input_size(image_size: tuple[int, int], settings: PipelineSettings, min_face_size: float
                        ) -> tuple[int, int]:
    """Network input (width, height) for one image: fixed, or sized to the image (see PipelineSettings)."""
    max_w, max_h = settings.detector.input_size
    if not settings.dynamic_input:
        return max_w, max_h
    width, height = image_size
    scale = min(max_w / width, max_h / height)
    if min_face_size > 0:  # the smallest wanted face still lands at `detectable_face` pixels
        scale = min(scale, settings.detectable_face / min_face_size)
    return (min(max_w, max(32, -(-round(width * scale) // 32) * 32)),
            min(max_h, max(32, -(-round(height * scale) // 32) * 32)))


def detect(
    images: Sequence[ImageArray],
    options: Sequence[DetectOptions],
    settings: PipelineSettings,
    detector: Detector,
) -> list[Detections]:
    """Letterbox every image to its detector input size, run the detector once per input size (split
    above the max batch), post-process. With a fixed input size that is one call for all images."""
    spec = settings.detector
    fill = spec.mean[::-1] if spec.swap_rb else spec.mean  # canvas is BGR; pad with the mean colour
    sizes = [detector_input_size((image.shape[1], image.shape[0]), settings, option.min_face_size)
             for image, option in zip(images, options, strict=True)]
    found: list[Detections | None] = [None] * len(images)
    for size in dict.fromkeys(sizes):
        members = [i for i, s in enumerate(sizes) if s == size]
        boxed = [letterbox(images[i], size[0], size[1], fill) for i in members]
        batch = network_input(np.stack([canvas for canvas, _ in boxed]), spec)
        outputs = [detector(batch[part]) for part in _chunks(len(members), settings.detector_max_batch)]
        loc, conf, landms = (np.concatenate([out[k] for out in outputs]) for k in range(3))
        if not spec.conf_softmax:  # the description says the network gives class logits
            conf = softmax(conf)
        for k, (i, (_, scale)) in enumerate(zip(members, boxed, strict=True)):
            image = images[i]
            found[i] = postprocess_detections(loc[k], conf[k], landms[k], size, scale,
                                              (image.shape[1], image.shape[0]), options[i])
    return [f for f in found if f is not None]


def embed(crops: ImageArray, settings: PipelineSettings, embedder: Embedder) -> FloatArray:
    """Aligned crops [N,S,S,3] BGR -> L2-normalized embeddings [N, D]; no call when N = 0."""
    spec = settings.embedder
    if crops.shape[0] == 0:
        return np.zeros((0, spec.embedding_dim), dtype=np.float32)
    batch = network_input(crops, spec)
    parts = _chunks(len(batch), settings.embedder_max_batch)
    raw = np.concatenate([embedder(batch[part]) for part in parts])
    if raw.shape != (len(batch), spec.embedding_dim):
        raise ValueError(
            f"embedder returned shape {raw.shape}, expected ({len(batch)}, {spec.embedding_dim})"
        )
    return l2_normalize(raw)


def _to_original(faces: Faces, size: tuple[int, int]) -> Faces:
    """Map a result computed on a reduced decode back to the original image's pixels."""
    factors = np.array([size[0] / faces.width, size[1] / faces.height], dtype=np.float32)
    return replace(faces, boxes=faces.boxes * np.tile(factors, 2), landmarks=faces.landmarks * factors,
                   width=size[0], height=size[1])


def run_pipeline(
    images: Sequence[ImageArray],
    options: Sequence[DetectOptions],
    settings: PipelineSettings,
    detector: Detector,
    embedder: Embedder,
    original_sizes: Sequence[tuple[int, int]] | None = None,
) -> list[Faces]:
    """Decoded BGR images -> faces with embeddings, one result per image, in order.

    ``original_sizes`` (width, height) are given when images were decoded at reduced scale: options
    are then in original pixels, and so are the results.
    """
    if not images:
        return []
    if original_sizes is not None:
        options = [replace(o, min_face_size=o.min_face_size * image.shape[1] / size[0])
                   for o, image, size in zip(options, images, original_sizes, strict=True)]
    detections = detect(images, options, settings, detector)
    size = settings.embedder.input_size[0]
    crops = [align_faces(image, found.landmarks, size)
             for image, found in zip(images, detections, strict=True)]
    all_crops = np.concatenate(crops) if crops else np.zeros((0, size, size, 3), np.uint8)
    embeddings = embed(all_crops, settings, embedder)
    blur = blur_scores(all_crops)
    bounds = np.cumsum([0, *(len(found) for found in detections)])
    results = [
        Faces(
            boxes=found.boxes,
            scores=found.scores,
            landmarks=found.landmarks,
            embeddings=embeddings[bounds[i] : bounds[i + 1]],
            blur=blur[bounds[i] : bounds[i + 1]],
            crops=crops[i],
            width=int(image.shape[1]),
            height=int(image.shape[0]),
        )
        for i, (image, found) in enumerate(zip(images, detections, strict=True))
    ]
    if original_sizes is None:
        return results
    return [_to_original(r, s) if (r.width, r.height) != tuple(s) else r
            for r, s in zip(results, original_sizes, strict=True)]
