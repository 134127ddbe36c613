"""Pure numpy pre- and post-processing for face detection and recognition.

Shared by the Triton models in ``model_repository/``, the export tools, the benchmarks and the
tests. Every function is stateless and allocates what it returns: nothing here keeps buffers
between calls, so it is safe from any thread. The only cache (``prior_boxes``) returns
read-only arrays.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import cv2
import numpy as np
from numpy.typing import NDArray
from PIL import Image

from facecore import jpeg

FloatArray = NDArray[np.float32]
ImageArray = NDArray[np.uint8]

#: Five-point template (left eye, right eye, nose, left mouth corner, right mouth corner) of the
#: 112x112 ArcFace crop, in pixels. Used by ArcFace, SFace and most open recognizers.
ARCFACE_TEMPLATE_112: FloatArray = np.array(
    [
        [38.2946, 51.6963],
        [73.5318, 51.5014],
        [56.0252, 71.7366],
        [41.5493, 92.3655],
        [70.7299, 92.2041],
    ],
    dtype=np.float32,
)

ACCEPTED_FORMATS = frozenset({"JPEG", "PNG", "WEBP", "BMP"})


class ImageError(ValueError):
    """The bytes are not an image this service accepts; the message says why."""


@dataclass(frozen=True)
class Detections:
    """Faces of one image, in that image's pixel coordinates, best score first."""

    boxes: FloatArray  # [N, 4] x1, y1, x2, y2
    scores: FloatArray  # [N]
    landmarks: FloatArray  # [N, 5, 2] x, y

    def __len__(self) -> int:
        return int(self.scores.shape[0])


@dataclass(frozen=True)
class DetectOptions:
    score_threshold: float = 0.5
    nms_iou: float = 0.4
    max_faces: int = 100
    min_face_size: float = 0.0  # shorter box side, in original pixels


@dataclass(frozen=True)
class PriorConfig:
    """Anchor layout of a RetinaFace-style detector (Pytorch_Retinaface conventions)."""

    steps: tuple[int, ...] = (8, 16, 32)
    min_sizes: tuple[tuple[int, ...], ...] = ((16, 32), (64, 128), (256, 512))
    variances: tuple[float, float] = (0.1, 0.2)


# --------------------------------------------------------------------------------------------
# Decoding and letterboxing


_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})


#: How much of a JPEG PIL reads when the marker walk could not find its size (junk between segments).
JPEG_HEADER_BYTES = 64 * 1024


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a JPEG's frame header (SOFn), walking the marker segments; None when the
    walk does not reach one (PIL then decides)."""
    for marker, position in jpeg.markers(data):
        if marker in _SOF:
            if position + 9 >= len(data):
                return None
            height, width = int.from_bytes(data[position + 5:position + 7], "big"), \
                int.from_bytes(data[position + 7:position + 9], "big")
            return (width, height) if width and height else None
        if marker in (-1, 0xD9, 0xDA):  # not a marker, end of image, or a scan before any frame header
            return None
    return None


def _fast_header(data: bytes) -> tuple[str, int, int] | None:
    """JPEG and PNG sizes without PIL (its open costs far more than this walk, paid by the gateway and the
    pipeline for every image); None for anything else or anything unusual."""
    if data[:3] == b"\xff\xd8\xff":
        size = _jpeg_size(data)
        return None if size is None else ("JPEG", *size)
    if data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and len(data) >= 24:
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        return ("PNG", width, height) if width and height else None
    return None


def image_header(data: bytes, max_pixels: int) -> tuple[str, int, int]:
    """Format, width and height from the header alone, before any pixel is decoded."""
    if not data:
        raise ImageError("empty image: no bytes were sent")
    fast = _fast_header(data)
    if fast is not None:
        if fast[1] * fast[2] > max_pixels:
            raise ImageError(f"image has {fast[1]}x{fast[2]} pixels, above the limit of {max_pixels} pixels")
        return fast
    # PIL steps over junk in a JPEG's headers one byte at a time (seconds for a crafted 10 MiB body): it is
    # given only the first bytes, where any frame header a walk with junk can find must be
    head = data[:JPEG_HEADER_BYTES] if data[:3] == b"\xff\xd8\xff" else data
    try:
        with Image.open(io.BytesIO(head)) as image:
            fmt, (width, height) = image.format or "", image.size
    except Image.DecompressionBombError as exc:
        raise ImageError(f"image too large: {exc}") from exc
    except (OSError, SyntaxError, ValueError) as exc:
        raise ImageError("not a decodable image (accepted: JPEG, PNG, WebP, BMP)") from exc
    if fmt not in ACCEPTED_FORMATS:
        raise ImageError(f"unsupported image format {fmt} (accepted: JPEG, PNG, WebP, BMP)")
    if width * height > max_pixels:
        raise ImageError(f"image has {width}x{height} pixels, above the limit of {max_pixels} pixels")
    return fmt, width, height


_REDUCED = {2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4, 8: cv2.IMREAD_REDUCED_COLOR_8}


def decode_image(data: bytes, max_pixels: int, min_side: int = 0, fast_jpeg: bool = True) -> ImageArray:
    """Encoded bytes -> HxWx3 uint8 BGR, EXIF orientation applied. Raises ImageError.

    With ``min_side`` > 0, a JPEG is decoded at 1/2, 1/4 or 1/8 scale (the DCT does the reduction,
    much cheaper than a full decode) as long as its longer side stays >= ``min_side``. Coordinates are
    then in the reduced image: ``decode_sized`` also returns the original size. JPEGs go through
    TurboJPEG (``facecore.jpeg``: the same pixels, less time) unless ``fast_jpeg`` is False (OpenCV
    alone: what the plain baseline does).
    """
    return decode_sized(data, max_pixels, min_side, fast_jpeg)[0]


def decode_sized(data: bytes, max_pixels: int, min_side: int = 0,
                 fast_jpeg: bool = True) -> tuple[ImageArray, tuple[int, int]]:
    """``decode_image`` and the (width, height) of the full-size image, EXIF rotation included, from one
    parse of the header."""
    fmt, width, height = image_header(data, max_pixels)
    factor = 1
    if min_side > 0 and fmt == "JPEG":
        factor = max([f for f in _REDUCED if max(width, height) / f >= min_side], default=1)
    image = jpeg.decode(data, width, height, factor) if fast_jpeg and fmt == "JPEG" else None
    if image is None:
        flags = _REDUCED[factor] if factor > 1 else cv2.IMREAD_COLOR
        image = cast("ImageArray | None", cv2.imdecode(np.frombuffer(data, dtype=np.uint8), flags))
    if image is None or image.size == 0:
        raise ImageError("corrupt image data: the decoder could not read the pixels")
    portrait = image.shape[0] > image.shape[1]
    rotated = portrait != (height > width) and width != height  # EXIF orientation swapped the axes
    return np.ascontiguousarray(image), ((height, width) if rotated else (width, height))


def original_size(data: bytes, decoded: ImageArray) -> tuple[int, int]:
    """(width, height) of the full-size image, EXIF rotation included, for a possibly reduced decode."""
    _, width, height = image_header(data, 2**62)
    portrait = decoded.shape[0] > decoded.shape[1]
    return (height, width) if portrait != (height > width) and width != height else (width, height)


def letterbox(
    image: ImageArray, width: int, height: int, fill: Sequence[float] = (0, 0, 0)
) -> tuple[ImageArray, FloatArray]:
    """Resize keeping the aspect ratio into a width x height canvas anchored top-left, padded with ``fill``.

    Returns the canvas and the per-axis scale (sx, sy): canvas = original * scale. Area averaging is
    used only for strong reductions (below 1/2), where bilinear sampling would alias.
    """
    h, w = image.shape[:2]
    ratio = min(width / w, height / h)
    new_w, new_h = max(1, min(width, round(w * ratio))), max(1, min(height, round(h * ratio)))
    interpolation = cv2.INTER_AREA if ratio < 0.5 else cv2.INTER_LINEAR
    same_size = (new_w, new_h) == (w, h)
    resized = image if same_size else cv2.resize(image, (new_w, new_h), interpolation=interpolation)
    value = [float(v) for v in np.clip(np.round(np.asarray(fill, dtype=np.float64)), 0, 255)]
    canvas = cv2.copyMakeBorder(
        resized, 0, height - new_h, 0, width - new_w, cv2.BORDER_CONSTANT, value=value
    )
    # copyMakeBorder keeps the dtype, so this only types the result (no copy).
    return np.asarray(canvas, dtype=image.dtype), np.array([new_w / w, new_h / h], dtype=np.float32)


def to_tensor(
    images: ImageArray, swap_rb: bool, mean: Sequence[float], std: Sequence[float]
) -> FloatArray:
    """NHWC uint8 (BGR) -> NCHW float32 ``(x - mean) / std``; channels swapped first if ``swap_rb``.

    ``mean`` and ``std`` are in the network's channel order.
    """
    batch = np.asarray(images)
    if batch.shape[0] == 0:
        return np.zeros((0, 3, *batch.shape[1:3]), dtype=np.float32)
    if len(set(std)) == 1:  # OpenCV's blob path: one pass in C++ where numpy makes several
        # size=None keeps each image's size; the stubs only accept a Sequence[int].
        blob = cv2.dnn.blobFromImages(  # type: ignore[call-overload]
            list(batch), 1.0 / float(std[0]), None, tuple(float(m) for m in mean), swap_rb
        )
        return np.asarray(blob, dtype=np.float32)
    channels = batch[..., ::-1] if swap_rb else batch
    normalized = (channels.astype(np.float32) - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    return np.ascontiguousarray(normalized.transpose(0, 3, 1, 2))


# --------------------------------------------------------------------------------------------
# RetinaFace post-processing


@functools.lru_cache(maxsize=256)
def prior_boxes(height: int, width: int, config: PriorConfig = PriorConfig()) -> FloatArray:
    """Anchors (cx, cy, w, h) normalized to the input size, in the network's output order.

    Order: level, then row, then column, then anchor size (Pytorch_Retinaface's PriorBox).
    """
    levels: list[NDArray[np.float64]] = []
    for step, sizes in zip(config.steps, config.min_sizes, strict=True):
        rows, cols = -(-height // step), -(-width // step)
        cy, cx = np.meshgrid((np.arange(rows) + 0.5) * step / height, (np.arange(cols) + 0.5) * step / width,
                             indexing="ij")
        per_size = [
            np.stack([cx, cy, np.full_like(cx, s / width), np.full_like(cy, s / height)], axis=-1)
            for s in sizes
        ]
        levels.append(np.stack(per_size, axis=2).reshape(-1, 4))
    priors = np.concatenate(levels).astype(np.float32)
    priors.setflags(write=False)
    return priors


def softmax(logits: FloatArray, axis: int = -1) -> FloatArray:
    """Class probabilities from logits (for detectors whose ``conf`` output is not softmaxed yet)."""
    shifted = np.exp(logits - logits.max(axis=axis, keepdims=True))
    return np.asarray(shifted / shifted.sum(axis=axis, keepdims=True), dtype=np.float32)


def decode_boxes(loc: FloatArray, priors: FloatArray, variances: tuple[float, float]) -> FloatArray:
    """Regression offsets -> corner boxes (x1, y1, x2, y2), normalized to the input size."""
    centers = priors[:, :2] + loc[:, :2] * variances[0] * priors[:, 2:]
    sizes = priors[:, 2:] * np.exp(loc[:, 2:] * variances[1])
    corners = np.concatenate([centers - sizes / 2, centers + sizes / 2], axis=1)
    return np.asarray(corners, dtype=np.float32)


def decode_landmarks(landms: FloatArray, priors: FloatArray, variances: tuple[float, float]) -> FloatArray:
    """Landmark offsets [A, 10] -> points [A, 5, 2], normalized to the input size."""
    offsets = landms.reshape(-1, 5, 2)
    points = priors[:, None, :2] + offsets * variances[0] * priors[:, None, 2:]
    return points.astype(np.float32)


def box_iou(box: FloatArray, boxes: FloatArray) -> FloatArray:
    """IoU of one box [4] against boxes [M, 4]."""
    x1 = np.maximum(box[0], boxes[:, 0])
    y1 = np.maximum(box[1], boxes[:, 1])
    x2 = np.minimum(box[2], boxes[:, 2])
    y2 = np.minimum(box[3], boxes[:, 3])
    inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    area = (box[2] - box[0]) * (box[3] - box[1])
    areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    union = area + areas - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1), 0).astype(np.float32)


def nms(boxes: FloatArray, scores: FloatArray, iou_threshold: float) -> NDArray[np.int64]:
    """Greedy non-maximum suppression; returns kept indices, best score first.

    Ties in score keep the lower index first (stable sort). A box is suppressed when its IoU
    with an already kept box is strictly above the threshold.
    """
    order = np.argsort(-scores, kind="stable")
    keep: list[int] = []
    while order.size:
        best = int(order[0])
        keep.append(best)
        rest = order[1:]
        order = rest[box_iou(boxes[best], boxes[rest]) <= iou_threshold]
    return np.asarray(keep, dtype=np.int64)


def postprocess_detections(
    loc: FloatArray,
    conf: FloatArray,
    landms: FloatArray,
    input_size: tuple[int, int],
    scale: FloatArray,
    image_size: tuple[int, int],
    options: DetectOptions,
    priors_config: PriorConfig = PriorConfig(),
) -> Detections:
    """Raw outputs of one image ([A,4], [A,2] softmaxed, [A,10]) -> faces in original pixels.

    ``input_size`` is the network input (width, height), ``scale`` the letterbox scale and
    ``image_size`` the original (width, height).
    """
    in_w, in_h = input_size
    priors = prior_boxes(in_h, in_w, priors_config)
    if priors.shape[0] != loc.shape[0]:
        raise ValueError(f"detector returned {loc.shape[0]} anchors, expected {priors.shape[0]}")
    scores = conf[:, 1]
    candidates = np.flatnonzero(scores >= options.score_threshold)
    pixels = np.array([in_w, in_h], dtype=np.float32)
    boxes = decode_boxes(loc[candidates], priors[candidates], priors_config.variances)
    boxes = boxes * np.tile(pixels / scale, 2)
    points = decode_landmarks(landms[candidates], priors[candidates], priors_config.variances)
    points = points * (pixels / scale)
    kept = nms(boxes, scores[candidates], options.nms_iou)
    boxes, points, kept_scores = boxes[kept], points[kept], scores[candidates][kept]
    width, height = image_size
    boxes = np.clip(boxes, 0, np.array([width, height, width, height], dtype=np.float32))
    sides = np.minimum(boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1])
    big_enough = np.flatnonzero((sides >= options.min_face_size) & (sides > 0))[: options.max_faces]
    return Detections(
        boxes=boxes[big_enough].astype(np.float32),
        scores=kept_scores[big_enough].astype(np.float32),
        landmarks=points[big_enough].astype(np.float32),
    )


# --------------------------------------------------------------------------------------------
# Alignment and embeddings


def similarity_transforms(src: FloatArray, dst: FloatArray = ARCFACE_TEMPLATE_112) -> FloatArray:
    """Least-squares similarity transforms (Umeyama 1991, no reflection) mapping src to dst.

    ``src`` is [N, K, 2] (or [K, 2]); returns [N, 2, 3] (or [2, 3]) affine matrices.
    """
    points = np.asarray(src, dtype=np.float64)
    single = points.ndim == 2
    points = points[None] if single else points
    target = np.asarray(dst, dtype=np.float64)
    src_mean = points.mean(axis=1, keepdims=True)
    dst_mean = target.mean(axis=0)
    src_c, dst_c = points - src_mean, target - dst_mean
    cov = np.einsum("ki,nkj->nij", dst_c, src_c) / points.shape[1]
    u, s, vt = np.linalg.svd(cov)
    d = np.ones((points.shape[0], 2))
    d[np.linalg.det(u) * np.linalg.det(vt) < 0, 1] = -1
    rotation = np.einsum("nij,nj,njk->nik", u, d, vt)
    src_var = (src_c**2).sum(axis=(1, 2)) / points.shape[1]
    scale = (s * d).sum(axis=1) / np.where(src_var > 0, src_var, 1)
    linear = rotation * scale[:, None, None]
    shift = dst_mean - np.einsum("nij,nj->ni", linear, src_mean[:, 0])
    matrices = np.asarray(np.concatenate([linear, shift[:, :, None]], axis=2), dtype=np.float32)
    return matrices[0, ...] if single else matrices  # [0, ...]: typed as an array, [0] as a scalar


def align_faces(image: ImageArray, landmarks: FloatArray, size: int = 112) -> ImageArray:
    """Warp every face [N, 5, 2] of ``image`` onto the ArcFace template -> [N, size, size, 3]."""
    if landmarks.ndim != 3 or landmarks.shape[1:] != (5, 2):
        raise ValueError(f"landmarks must have shape [N, 5, 2], got {list(landmarks.shape)}")
    template = ARCFACE_TEMPLATE_112 * (size / 112.0)
    crops = np.empty((landmarks.shape[0], size, size, 3), dtype=np.uint8)
    for i, matrix in enumerate(similarity_transforms(landmarks, template).reshape(-1, 2, 3)):
        crops[i] = cv2.warpAffine(image, matrix, (size, size), flags=cv2.INTER_LINEAR, borderValue=(0, 0, 0))
    return crops


def blur_scores(crops: ImageArray) -> FloatArray:
    """Variance of the Laplacian of each crop's grey levels (low = blurry)."""
    values = [cv2.Laplacian(cv2.cvtColor(crop, cv2.COLOR_BGR2GRAY), cv2.CV_64F).var() for crop in crops]
    return np.asarray(values, dtype=np.float32)


def l2_normalize(vectors: FloatArray, eps: float = 1e-12) -> FloatArray:
    """Rows scaled to unit L2 norm (zero rows stay zero)."""
    array = np.asarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(array, axis=-1, keepdims=True)
    return np.asarray(array / np.maximum(norms, eps), dtype=np.float32)
