"""``facecore.processing`` against plain oracles written here (loops, float64, scikit-image, OpenCV)."""

from __future__ import annotations

import io
import math
import struct
from pathlib import Path

import cv2
import numpy as np
import pytest
from numpy.typing import NDArray
from PIL import Image
from skimage.transform import SimilarityTransform

from facecore.processing import (
    ARCFACE_TEMPLATE_112,
    Detections,
    DetectOptions,
    ImageError,
    PriorConfig,
    align_faces,
    blur_scores,
    decode_boxes,
    decode_image,
    decode_landmarks,
    image_header,
    l2_normalize,
    letterbox,
    nms,
    postprocess_detections,
    prior_boxes,
    similarity_transforms,
    to_tensor,
)

# --------------------------------------------------------------------------------------------
# nms


def iou_oracle(a: NDArray[np.floating], b: NDArray[np.floating]) -> float:
    """IoU of two corner boxes in float64; 0 when the union is empty."""
    ax1, ay1, ax2, ay2 = (float(v) for v in a)
    bx1, by1, bx2, by2 = (float(v) for v in b)
    inter = max(0.0, min(ax2, bx2) - max(ax1, bx1)) * max(0.0, min(ay2, by2) - max(ay1, by1))
    union = (ax2 - ax1) * (ay2 - ay1) + (bx2 - bx1) * (by2 - by1) - inter
    return inter / union if union > 0 else 0.0


def nms_oracle(boxes: NDArray[np.floating], scores: NDArray[np.floating], threshold: float) -> list[int]:
    order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))
    keep: list[int] = []
    for i in order:
        if all(iou_oracle(boxes[i], boxes[k]) <= threshold for k in keep):
            keep.append(i)
    return keep


def random_boxes(rng: np.random.Generator, count: int, integer: bool) -> NDArray[np.float32]:
    """Corner boxes, some duplicated and some of zero width or height."""
    if integer:  # small integers: float32 areas and intersections are exact
        xy = rng.integers(0, 60, size=(count, 2)).astype(np.float64)
        wh = rng.integers(0, 40, size=(count, 2)).astype(np.float64)
    else:
        xy = rng.uniform(0, 100, size=(count, 2))
        wh = rng.uniform(0, 50, size=(count, 2))
        wh[rng.random(count) < 0.1, rng.integers(0, 2)] = 0.0
    boxes = np.concatenate([xy, xy + wh], axis=1)
    if count > 1:
        copies = rng.integers(0, count, size=count // 4)
        targets = rng.integers(0, count, size=count // 4)
        boxes[targets] = boxes[copies]
    return boxes.astype(np.float32)


@pytest.mark.parametrize("threshold", [0.0, 0.3, 0.5, 1.0])
def test_nms_matches_greedy_oracle(threshold: float) -> None:
    rng = np.random.default_rng(1234 + int(threshold * 10))
    checked_ties = 0
    for case in range(150):
        count = int(rng.integers(1, 40))
        boxes = random_boxes(rng, count, integer=case % 2 == 0)
        if case % 3 == 0:  # a few quantized values: many exact score ties
            scores = rng.choice(np.array([0.25, 0.5, 0.75, 0.9], dtype=np.float32), size=count)
        else:
            scores = rng.random(count).astype(np.float32)
        checked_ties += int(len(np.unique(scores)) < count)
        kept = nms(boxes, scores, threshold)
        assert kept.dtype == np.int64
        assert kept.tolist() == nms_oracle(boxes, scores, threshold), (case, boxes, scores)
    assert checked_ties > 30


def test_nms_ties_keep_lower_index_first() -> None:
    boxes = np.array([[0, 0, 10, 10], [0, 0, 10, 10], [50, 50, 60, 60], [50, 50, 60, 60]], np.float32)
    scores = np.array([0.5, 0.5, 0.5, 0.5], np.float32)
    assert nms(boxes, scores, 0.5).tolist() == [0, 2]
    assert nms(boxes, scores, 1.0).tolist() == [0, 1, 2, 3]
    scores = np.array([0.5, 0.9, 0.5, 0.9], np.float32)
    assert nms(boxes, scores, 0.5).tolist() == [1, 3]


def test_nms_threshold_is_strict() -> None:
    # IoU of these two boxes is exactly 50 / 150 = 1/3; the second one is kept at threshold 1/3.
    boxes = np.array([[0, 0, 10, 10], [5, 0, 15, 10]], np.float32)
    scores = np.array([0.9, 0.8], np.float32)
    assert nms(boxes, scores, 0.5).tolist() == [0, 1]
    assert nms(boxes, scores, 0.3).tolist() == [0]
    assert nms(boxes, scores, 0.0).tolist() == [0]


def test_nms_zero_area_boxes_are_never_suppressed() -> None:
    boxes = np.array([[5, 5, 5, 5], [5, 5, 5, 5], [0, 0, 10, 10], [3, 3, 3, 9]], np.float32)
    scores = np.array([0.9, 0.8, 0.7, 0.6], np.float32)
    assert nms(boxes, scores, 0.0).tolist() == [0, 1, 2, 3]


def test_nms_empty() -> None:
    kept = nms(np.zeros((0, 4), np.float32), np.zeros((0,), np.float32), 0.4)
    assert kept.shape == (0,)
    assert kept.dtype == np.int64


# --------------------------------------------------------------------------------------------
# Anchors and decoding


def prior_boxes_oracle(height: int, width: int, config: PriorConfig) -> NDArray[np.float64]:
    rows: list[list[float]] = []
    for step, sizes in zip(config.steps, config.min_sizes, strict=True):
        for row in range(math.ceil(height / step)):
            for col in range(math.ceil(width / step)):
                for s in sizes:
                    cx, cy = (col + 0.5) * step / width, (row + 0.5) * step / height
                    rows.append([cx, cy, s / width, s / height])
    return np.array(rows, dtype=np.float64)


def test_prior_boxes_count_640() -> None:
    priors = prior_boxes(640, 640)
    assert priors.shape == (16800, 4)
    assert priors.dtype == np.float32


@pytest.mark.parametrize(("height", "width"), [(100, 150), (480, 640), (640, 480), (640, 640)])
def test_prior_boxes_match_loop_oracle(height: int, width: int) -> None:
    priors = prior_boxes(height, width)
    expected = prior_boxes_oracle(height, width, PriorConfig())
    assert priors.shape == expected.shape
    np.testing.assert_allclose(priors, expected, rtol=1e-6, atol=1e-7)


def test_prior_boxes_custom_config() -> None:
    config = PriorConfig(steps=(4, 10), min_sizes=((3,), (7, 11, 13)), variances=(0.1, 0.2))
    priors = prior_boxes(23, 37, config)
    expected = prior_boxes_oracle(23, 37, config)
    assert priors.shape == (6 * 10 * 1 + 3 * 4 * 3, 4)
    np.testing.assert_allclose(priors, expected, rtol=1e-6, atol=1e-7)


def test_prior_boxes_are_read_only() -> None:
    priors = prior_boxes(100, 150)
    assert not priors.flags.writeable
    with pytest.raises(ValueError):
        priors[0, 0] = 1.0


PRIORS = np.array([[0.5, 0.5, 0.2, 0.1], [0.25, 0.75, 0.1, 0.3]], np.float32)
VARIANCES = (0.1, 0.2)


def test_decode_zero_offsets_give_prior_corners_and_centers() -> None:
    boxes = decode_boxes(np.zeros((2, 4), np.float32), PRIORS, VARIANCES)
    np.testing.assert_allclose(boxes, [[0.4, 0.45, 0.6, 0.55], [0.2, 0.6, 0.3, 0.9]], atol=1e-7)
    assert boxes.dtype == np.float32
    points = decode_landmarks(np.zeros((2, 10), np.float32), PRIORS, VARIANCES)
    assert points.shape == (2, 5, 2)
    assert points.dtype == np.float32
    np.testing.assert_allclose(points[0], np.tile([0.5, 0.5], (5, 1)), atol=1e-7)
    np.testing.assert_allclose(points[1], np.tile([0.25, 0.75], (5, 1)), atol=1e-7)


def test_decode_boxes_hand_computed() -> None:
    # cx = 0.5 + 1 * 0.1 * 0.2 = 0.52, cy = 0.5 - 2 * 0.1 * 0.1 = 0.48,
    # w = 0.2 * exp(0) = 0.2, h = 0.1 * exp(5 ln 2 * 0.2) = 0.2.
    loc = np.array([[1.0, -2.0, 0.0, 5 * math.log(2.0)]], np.float32)
    boxes = decode_boxes(loc, PRIORS[:1], VARIANCES)
    np.testing.assert_allclose(boxes, [[0.42, 0.38, 0.62, 0.58]], atol=1e-6)


def test_decode_landmarks_hand_computed() -> None:
    # point = center + offset * 0.1 * (w, h) = (0.5, 0.5) + offset * (0.02, 0.01)
    offsets = np.array([[1, 2, -5, 10, 0, 0, 2.5, -2.5, 10, -20]], np.float32)
    points = decode_landmarks(offsets, PRIORS[:1], VARIANCES)
    expected = [[0.52, 0.52], [0.4, 0.6], [0.5, 0.5], [0.55, 0.475], [0.7, 0.3]]
    np.testing.assert_allclose(points[0], expected, atol=1e-6)


# --------------------------------------------------------------------------------------------
# Letterbox and tensors


@pytest.mark.parametrize(
    ("shape", "fill"),
    [
        ((300, 100), (0, 0, 0)),  # portrait, strong reduction (INTER_AREA)
        ((50, 200), (114, 114, 114)),  # landscape, reduction
        ((3, 2), (10, 20, 30)),  # tiny, enlarged 40x
        ((120, 160), (0, 0, 0)),  # exactly the target size: untouched
        ((500, 700), (1, 2, 3)),  # larger, strong reduction
        ((240, 320), (255, 0, 127)),  # ratio exactly 1/2: bilinear
        ((60, 90), (7, 7, 7)),  # smaller than the target: enlarged
        ((200, 160), (0, 255, 0)),  # portrait, mild reduction (bilinear)
    ],
)
def test_letterbox(shape: tuple[int, int], fill: tuple[int, int, int]) -> None:
    width, height = 160, 120
    rng = np.random.default_rng(sum(shape))
    image = rng.integers(0, 256, size=(*shape, 3), dtype=np.uint8)
    h, w = shape
    canvas, scale = letterbox(image, width, height, fill)

    assert canvas.shape == (height, width, 3)
    assert canvas.dtype == np.uint8
    assert scale.shape == (2,)
    ratio = min(width / w, height / h)
    new_w, new_h = max(1, min(width, round(w * ratio))), max(1, min(height, round(h * ratio)))
    np.testing.assert_allclose(scale, [new_w / w, new_h / h], rtol=1e-6)
    # Aspect ratio kept up to rounding of the content size to whole pixels.
    assert abs(scale[0] - scale[1]) <= 1.0 / min(w, h) + 1e-6

    # Points map both ways: original -> canvas by * scale, back by / scale.
    points = np.array([[0, 0], [w, h], [w / 3, h / 7], [w - 0.5, 0.25]], np.float64)
    in_canvas = points * scale
    np.testing.assert_allclose(in_canvas[1], [new_w, new_h], atol=1e-3)
    np.testing.assert_allclose(in_canvas / scale, points, atol=1e-4)

    # Content (top-left anchored) is cv2.resize with the documented interpolation rule.
    if (new_w, new_h) == (w, h):
        expected = image
    else:
        interpolation = cv2.INTER_AREA if ratio < 0.5 else cv2.INTER_LINEAR
        expected = cv2.resize(image, (new_w, new_h), interpolation=interpolation)
    np.testing.assert_array_equal(canvas[:new_h, :new_w], expected)

    # Padding is the fill colour.
    assert new_w == width or new_h == height
    pad = np.ones((height, width), bool)
    pad[:new_h, :new_w] = False
    assert np.all(canvas[pad] == np.array(fill, np.uint8))


def test_letterbox_fill_is_rounded_and_clipped() -> None:
    image = np.zeros((10, 20, 3), np.uint8)
    canvas, _ = letterbox(image, 20, 20, (103.6, -5.0, 300.0))
    assert canvas[15, 5].tolist() == [104, 0, 255]


def to_tensor_oracle(
    images: NDArray[np.uint8], swap: bool, mean: tuple[float, ...], std: tuple[float, ...]
) -> NDArray[np.float64]:
    x = images.astype(np.float64)
    x = x[..., ::-1] if swap else x
    return ((x - np.array(mean)) / np.array(std)).transpose(0, 3, 1, 2)


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize(
    ("mean", "std"),
    [
        ((104.0, 117.0, 123.0), (1.0, 1.0, 1.0)),
        ((127.5, 127.5, 127.5), (128.0, 128.0, 128.0)),
        ((123.675, 116.28, 103.53), (58.395, 57.12, 57.375)),  # non-uniform std: numpy path
        ((0.0, 10.0, 200.0), (2.0, 0.5, 3.0)),
    ],
)
def test_to_tensor_matches_reference(
    swap: bool, mean: tuple[float, float, float], std: tuple[float, float, float]
) -> None:
    rng = np.random.default_rng(7)
    images = rng.integers(0, 256, size=(3, 9, 11, 3), dtype=np.uint8)
    tensor = to_tensor(images, swap, mean, std)
    assert tensor.shape == (3, 3, 9, 11)
    assert tensor.dtype == np.float32
    assert tensor.flags.c_contiguous
    np.testing.assert_allclose(tensor, to_tensor_oracle(images, swap, mean, std), rtol=1e-5, atol=1e-4)


def test_to_tensor_empty_batch() -> None:
    tensor = to_tensor(np.zeros((0, 12, 16, 3), np.uint8), True, (1.0, 2.0, 3.0), (1.0, 1.0, 1.0))
    assert tensor.shape == (0, 3, 12, 16)
    assert tensor.dtype == np.float32


# --------------------------------------------------------------------------------------------
# Similarity transforms and alignment


def skimage_similarity(src: NDArray[np.floating], dst: NDArray[np.floating]) -> NDArray[np.float64]:
    src64, dst64 = np.asarray(src, np.float64), np.asarray(dst, np.float64)
    if hasattr(SimilarityTransform, "from_estimate"):
        transform = SimilarityTransform.from_estimate(src64, dst64)
        assert transform, "scikit-image could not estimate the transform"
    else:
        transform = SimilarityTransform()
        assert transform.estimate(src64, dst64)
    return np.asarray(transform.params[:2], np.float64)


def random_similarity(rng: np.random.Generator) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    angle = rng.uniform(-math.pi, math.pi)
    scale = rng.uniform(0.2, 6.0)
    linear = scale * np.array([[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]])
    return linear, rng.uniform(-800, 800, size=2)


def assert_matrix_close(actual: NDArray[np.floating], expected: NDArray[np.floating]) -> None:
    magnitude = float(np.abs(expected).max())
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-4 * magnitude)


def test_similarity_transforms_match_scikit_image() -> None:
    rng = np.random.default_rng(2021)
    template = ARCFACE_TEMPLATE_112.astype(np.float64)
    sources = []
    for case in range(60):
        linear, shift = random_similarity(rng)
        noise = rng.normal(0, 0.5 * np.linalg.norm(linear[0]), (5, 2))  # half a template pixel
        src = template @ linear.T + shift + noise
        if case % 10 == 9:  # mirrored face: the transform must still be a rotation (no reflection)
            src[:, 0] = -src[:, 0]
        sources.append(src.astype(np.float32))
        matrix = similarity_transforms(src.astype(np.float32))
        assert matrix.shape == (2, 3)
        assert matrix.dtype == np.float32
        expected = skimage_similarity(src.astype(np.float32), ARCFACE_TEMPLATE_112)
        assert_matrix_close(matrix, expected)
        # A similarity without reflection: [[a, -b], [b, a]].
        assert matrix[0, 0] == pytest.approx(matrix[1, 1], rel=1e-4, abs=1e-6)
        assert matrix[0, 1] == pytest.approx(-matrix[1, 0], rel=1e-4, abs=1e-6)

    batch = np.stack(sources)
    batched = similarity_transforms(batch)
    assert batched.shape == (60, 2, 3)
    for i, src in enumerate(sources):
        np.testing.assert_allclose(batched[i], similarity_transforms(src), rtol=1e-6, atol=1e-5)


def test_similarity_transforms_custom_destination_matches_scikit_image() -> None:
    rng = np.random.default_rng(5)
    for _ in range(20):
        src = rng.uniform(-50, 300, size=(5, 2)).astype(np.float32)
        dst = rng.uniform(0, 224, size=(5, 2)).astype(np.float32)
        assert_matrix_close(similarity_transforms(src, dst), skimage_similarity(src, dst))


def test_similarity_transforms_recover_a_known_similarity() -> None:
    rng = np.random.default_rng(11)
    for _ in range(20):
        linear, shift = random_similarity(rng)
        src = rng.uniform(0, 400, size=(5, 2))
        dst = src @ linear.T + shift
        matrix = similarity_transforms(src.astype(np.float32), dst.astype(np.float32))
        expected = np.concatenate([linear, shift[:, None]], axis=1)
        assert_matrix_close(matrix, expected)
        mapped = src @ matrix[:, :2].T.astype(np.float64) + matrix[:, 2]
        np.testing.assert_allclose(mapped, dst, atol=1e-3 * max(1.0, float(np.abs(dst).max())))


def test_similarity_transforms_map_source_near_destination() -> None:
    rng = np.random.default_rng(3)
    template = ARCFACE_TEMPLATE_112.astype(np.float64)
    for _ in range(20):
        linear, shift = random_similarity(rng)
        inverse = np.linalg.inv(linear)
        src = (template - shift) @ inverse.T + rng.normal(0, 0.5, (5, 2))  # maps to the template + noise
        matrix = similarity_transforms(src.astype(np.float32)).astype(np.float64)
        mapped = src @ matrix[:, :2].T + matrix[:, 2]
        residual = np.linalg.norm(mapped - template, axis=1)
        exact = skimage_similarity(src, template)
        best = np.linalg.norm(src @ exact[:, :2].T + exact[:, 2] - template, axis=1)
        # Least squares: as good as scikit-image's fit, and the face lands on the template.
        assert np.sqrt(np.mean(residual**2)) <= np.sqrt(np.mean(best**2)) + 1e-3
        assert residual.max() < 0.5 * 3 * np.linalg.norm(linear[0]) + 1.0


def test_align_faces_identity_crop() -> None:
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, size=(200, 180, 3), dtype=np.uint8)
    landmarks = np.stack([ARCFACE_TEMPLATE_112, ARCFACE_TEMPLATE_112])
    crops = align_faces(image, landmarks)
    assert crops.shape == (2, 112, 112, 3)
    assert crops.dtype == np.uint8
    np.testing.assert_array_equal(crops[0], image[:112, :112])
    np.testing.assert_array_equal(crops[1], image[:112, :112])


def test_align_faces_identity_crop_other_size() -> None:
    rng = np.random.default_rng(1)
    image = rng.integers(0, 256, size=(300, 260, 3), dtype=np.uint8)
    crops = align_faces(image, (ARCFACE_TEMPLATE_112 * 2.0)[None], size=224)
    assert crops.shape == (1, 224, 224, 3)
    np.testing.assert_array_equal(crops[0], image[:224, :224])


def test_align_faces_translation() -> None:
    rng = np.random.default_rng(2)
    image = rng.integers(0, 256, size=(200, 200, 3), dtype=np.uint8)
    crops = align_faces(image, (ARCFACE_TEMPLATE_112 + np.array([30.0, 17.0], np.float32))[None])
    np.testing.assert_array_equal(crops[0], image[17 : 17 + 112, 30 : 30 + 112])


def test_align_faces_no_faces() -> None:
    crops = align_faces(np.zeros((50, 60, 3), np.uint8), np.zeros((0, 5, 2), np.float32))
    assert crops.shape == (0, 112, 112, 3)
    assert crops.dtype == np.uint8


# --------------------------------------------------------------------------------------------
# Embeddings and blur


def test_l2_normalize() -> None:
    rng = np.random.default_rng(4)
    vectors = rng.normal(0, 10, size=(6, 128))
    vectors[2] = 0.0
    normalized = l2_normalize(vectors)
    assert normalized.dtype == np.float32
    assert normalized.shape == (6, 128)
    norms = np.linalg.norm(normalized.astype(np.float64), axis=1)
    np.testing.assert_allclose(np.delete(norms, 2), 1.0, atol=1e-6)
    assert np.all(normalized[2] == 0.0)
    np.testing.assert_allclose(normalized[0], vectors[0] / np.linalg.norm(vectors[0]), rtol=1e-5, atol=1e-7)


def test_l2_normalize_empty() -> None:
    assert l2_normalize(np.zeros((0, 128), np.float32)).shape == (0, 128)


def test_blur_scores_sharp_above_blurred() -> None:
    cells = (np.indices((112, 112)) // 8).sum(axis=0) % 2
    board = np.repeat((cells * 255).astype(np.uint8)[..., None], 3, axis=2)
    blurred = cv2.GaussianBlur(board, (9, 9), 3.0)
    scores = blur_scores(np.stack([board, blurred]))
    assert scores.shape == (2,)
    assert scores.dtype == np.float32
    assert scores[0] > 2 * scores[1] > 0
    assert blur_scores(np.full((1, 112, 112, 3), 128, np.uint8)).tolist() == [0.0]


# --------------------------------------------------------------------------------------------
# Image decoding


def sample_image(height: int = 40, width: int = 60) -> NDArray[np.uint8]:
    rng = np.random.default_rng(8)
    return rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)


def encode(image: NDArray[np.uint8], ext: str, params: list[int] | None = None) -> bytes:
    ok, data = cv2.imencode(ext, image, params or [])
    assert ok
    return data.tobytes()


def pil_bytes(image: NDArray[np.uint8], fmt: str, **kwargs: object) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image[..., ::-1]).save(buffer, fmt, **kwargs)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("ext", "fmt", "params", "exact"),
    [
        (".jpg", "JPEG", [cv2.IMWRITE_JPEG_QUALITY, 95], False),
        (".png", "PNG", None, True),
        (".webp", "WEBP", [cv2.IMWRITE_WEBP_QUALITY, 101], True),  # > 100: lossless
        (".webp", "WEBP", [cv2.IMWRITE_WEBP_QUALITY, 80], False),
        (".bmp", "BMP", None, True),
    ],
)
def test_decode_accepted_formats(ext: str, fmt: str, params: list[int] | None, exact: bool) -> None:
    image = sample_image()
    smooth = cv2.GaussianBlur(image, (7, 7), 2.0)  # lossy codecs keep smooth images close
    source = image if exact else smooth
    data = encode(source, ext, params)
    assert image_header(data, 10_000) == (fmt, 60, 40)
    decoded = decode_image(data, 10_000)
    assert decoded.shape == (40, 60, 3)
    assert decoded.dtype == np.uint8
    assert decoded.flags.c_contiguous
    if exact:
        np.testing.assert_array_equal(decoded, image)
    else:  # BGR order kept: the mean error would be large if channels were swapped
        assert np.abs(decoded.astype(int) - source.astype(int)).mean() < 4.0


def test_decode_keeps_bgr_order() -> None:
    image = np.zeros((8, 8, 3), np.uint8)
    image[..., 0] = 255  # pure blue in BGR
    assert decode_image(encode(image, ".png"), 1000)[0, 0].tolist() == [255, 0, 0]
    assert decode_image(pil_bytes(image, "PNG"), 1000)[0, 0].tolist() == [255, 0, 0]


@pytest.mark.parametrize("fmt", ["GIF", "TIFF"])
def test_decode_rejects_other_formats(fmt: str) -> None:
    data = pil_bytes(sample_image(), fmt)
    with pytest.raises(ImageError, match=f"unsupported image format {fmt}"):
        image_header(data, 10_000)
    with pytest.raises(ImageError, match=fmt):
        decode_image(data, 10_000)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        np.random.default_rng(9).integers(0, 256, size=4096, dtype=np.uint8).tobytes(),
        b"not an image at all",
        encode(sample_image(), ".png")[:30],
        encode(sample_image(), ".jpg")[:20],
        encode(sample_image(), ".bmp")[:10],
    ],
    ids=["empty", "random", "text", "png-header", "jpeg-header", "bmp-header"],
)
def test_decode_rejects_garbage(data: bytes) -> None:
    with pytest.raises(ImageError):
        decode_image(data, 10_000)


def test_decode_empty_message() -> None:
    with pytest.raises(ImageError, match="empty"):
        decode_image(b"", 10_000)


def test_decode_rejects_images_above_max_pixels() -> None:
    data = encode(sample_image(), ".png")
    assert decode_image(data, 2400).shape == (40, 60, 3)  # exactly at the limit
    with pytest.raises(ImageError, match="2399"):
        decode_image(data, 2399)
    with pytest.raises(ImageError, match="60x40"):
        image_header(data, 100)


def test_decode_grayscale_png_gives_three_channels() -> None:
    gray = sample_image()[..., 1].copy()
    decoded = decode_image(encode(gray, ".png"), 10_000)
    assert decoded.shape == (40, 60, 3)
    for channel in range(3):
        np.testing.assert_array_equal(decoded[..., channel], gray)


def test_decode_png_with_alpha_gives_three_channels() -> None:
    image = sample_image()
    rgba = np.concatenate([image, np.full((40, 60, 1), 200, np.uint8)], axis=2)
    decoded = decode_image(encode(rgba, ".png"), 10_000)
    assert decoded.shape == (40, 60, 3)
    np.testing.assert_array_equal(decoded, image)


def test_decode_applies_exif_orientation() -> None:
    image = cv2.GaussianBlur(sample_image(), (7, 7), 2.0)
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    data = pil_bytes(image, "JPEG", exif=exif.tobytes(), quality=95)
    assert image_header(data, 10_000) == ("JPEG", 60, 40)  # header: stored size
    decoded = decode_image(data, 10_000)
    assert decoded.shape == (60, 40, 3)
    stored = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION)
    np.testing.assert_array_equal(decoded, cv2.rotate(stored, cv2.ROTATE_90_CLOCKWISE))


def _opencv(data: bytes, flags: int = cv2.IMREAD_COLOR) -> NDArray[np.uint8]:
    decoded = cv2.imdecode(np.frombuffer(data, np.uint8), flags)
    assert decoded is not None
    return np.asarray(decoded, np.uint8)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_turbojpeg_decode_equals_opencv_for_every_exif_orientation(orientation: int) -> None:
    """JPEGs decode through TurboJPEG (facecore/jpeg.py); the pixels, EXIF orientation applied, are
    OpenCV's exactly, in both byte orders."""
    from facecore import jpeg

    image = cv2.GaussianBlur(sample_image(48, 80), (5, 5), 1.5)
    for order in (">", "<"):  # Motorola and Intel byte order
        data = pil_bytes(image, "JPEG", exif=_exif(orientation, order), quality=95)
        assert jpeg.exif_orientation(data) == orientation
        fast = jpeg.decode(data, 80, 48)
        assert fast is not None
        np.testing.assert_array_equal(fast, _opencv(data))
        np.testing.assert_array_equal(decode_image(data, 10**6), _opencv(data))
        half = jpeg.decode(data, 80, 48, 2)  # OpenCV orients a reduced decode too
        assert half is not None
        np.testing.assert_array_equal(half, _opencv(data, cv2.IMREAD_REDUCED_COLOR_2))


def _exif(orientation: int, order: str) -> bytes:
    """An EXIF block whose IFD0 holds a date and the orientation (a SHORT), in this byte order."""
    header = (b"MM" if order == ">" else b"II") + struct.pack(order + "HI", 42, 8)
    date = struct.pack(order + "HHII", 0x0132, 2, 20, 8 + 2 + 2 * 12 + 4)  # ASCII, stored after the IFD
    turn = struct.pack(order + "HHIHH", 0x0112, 3, 1, orientation, 0)
    return b"Exif\x00\x00" + header + struct.pack(order + "H", 2) + date + turn + b"\x00" * 4 \
        + b"2026:12:01 00:00:00\x00"


def test_turbojpeg_reduced_decode_equals_opencv(photos: dict[str, Path]) -> None:
    from facecore import jpeg

    jpegs = [path for path in photos.values() if path.suffix == ".jpg"]
    assert len(jpegs) >= 3
    for path in jpegs:
        data = path.read_bytes()
        _, width, height = image_header(data, 10**8)
        for factor, flags in ((1, cv2.IMREAD_COLOR), (2, cv2.IMREAD_REDUCED_COLOR_2),
                              (4, cv2.IMREAD_REDUCED_COLOR_4), (8, cv2.IMREAD_REDUCED_COLOR_8)):
            fast = jpeg.decode(data, width, height, factor)
            assert fast is not None, (path.name, factor)
            np.testing.assert_array_equal(fast, _opencv(data, flags), err_msg=f"{path.name} 1/{factor}")


def test_jpegs_turbojpeg_cannot_read_fall_back_to_opencv(photos: dict[str, Path]) -> None:
    """A damaged file or unreadable EXIF: None from the fast path, and decode_image gives what
    OpenCV gives (pixels or the same ImageError) as before."""
    from facecore import jpeg

    data = photos["obama.jpg"].read_bytes()
    _, width, height = image_header(data, 10**8)
    cut = data[: len(data) // 2]
    assert jpeg.decode(cut, width, height) is None
    with pytest.raises(ImageError, match="corrupt"):
        decode_image(cut, 10**8)

    cmyk = io.BytesIO()  # TurboJPEG converts CMYK as OpenCV does
    Image.fromarray(sample_image()).convert("CMYK").save(cmyk, "JPEG", quality=95)
    np.testing.assert_array_equal(decode_image(cmyk.getvalue(), 10**6), _opencv(cmyk.getvalue()))

    good = pil_bytes(sample_image(), "JPEG", exif=_exif(6, "<"), quality=95)
    start = good.index(b"Exif\x00\x00") + 6
    bad = good[:start] + b"XX" + good[start + 2:]  # not a TIFF header
    assert jpeg.exif_orientation(bad) is None and jpeg.decode(bad, 60, 40) is None
    np.testing.assert_array_equal(decode_image(bad, 10**6), _opencv(bad))
    assert decode_image(good, 10**6, fast_jpeg=False).shape == decode_image(good, 10**6).shape == (60, 40, 3)


# --------------------------------------------------------------------------------------------
# postprocess_detections

INPUT = 640
ANCHORS = 16800
DEFAULT_OPTIONS = DetectOptions()  # score_threshold 0.5, nms_iou 0.4, max_faces 100, min size 0


def anchor_index(level: int, row: int, col: int, size: int) -> int:
    """Index in the 640x640 anchor list (level, row, column, size; 2 sizes per cell)."""
    offsets = [0, 80 * 80 * 2, 80 * 80 * 2 + 40 * 40 * 2]
    cols = [80, 40, 20][level]
    return offsets[level] + (row * cols + col) * 2 + size


def expected_face(
    index: int, loc: NDArray[np.floating], landms: NDArray[np.floating], scale: float
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Box and landmarks in original pixels, computed from the anchor definition in float64."""
    level = 0 if index < 12800 else 1 if index < 16000 else 2
    start = [0, 12800, 16000][level]
    step, cols = [8, 16, 32][level], [80, 40, 20][level]
    size = [(16, 32), (64, 128), (256, 512)][level][(index - start) % 2]
    cell = (index - start) // 2
    row, col = divmod(cell, cols)
    cx, cy, w = (col + 0.5) * step, (row + 0.5) * step, float(size)  # input pixels
    dx, dy, dw, dh = (float(v) for v in loc)
    bx, by = cx + dx * 0.1 * w, cy + dy * 0.1 * w
    bw, bh = w * math.exp(dw * 0.2), w * math.exp(dh * 0.2)
    box = np.array([bx - bw / 2, by - bh / 2, bx + bw / 2, by + bh / 2]) / scale
    points = (np.array([cx, cy]) + np.asarray(landms, np.float64).reshape(5, 2) * 0.1 * w) / scale
    return box, points


def raw_outputs() -> tuple[NDArray[np.float32], NDArray[np.float32], NDArray[np.float32]]:
    loc = np.zeros((ANCHORS, 4), np.float32)
    conf = np.tile(np.array([0.99, 0.01], np.float32), (ANCHORS, 1))
    landms = np.zeros((ANCHORS, 10), np.float32)
    return loc, conf, landms


FACE_A = anchor_index(1, 10, 12, 0)  # 64 px anchor at (200, 168) in the input
FACE_B = anchor_index(0, 40, 60, 1)  # 32 px anchor at (484, 324)
LOC_A = np.array([1.0, -1.0, 0.5, -0.25], np.float32)
LOC_B = np.array([-0.5, 0.5, 0.0, 1.0], np.float32)
LANDMS_A = np.array([-3, -2, 3, -2, 0, 0, -2, 3, 2, 3], np.float32)
LANDMS_B = np.array([1, 1, -1, 1, 0.5, 0.5, 1, -1, -1, -1], np.float32)


def two_faces() -> tuple[NDArray[np.float32], NDArray[np.float32], NDArray[np.float32]]:
    loc, conf, landms = raw_outputs()
    for index, score, offsets, points in [(FACE_A, 0.9, LOC_A, LANDMS_A), (FACE_B, 0.8, LOC_B, LANDMS_B)]:
        conf[index] = [1 - score, score]
        loc[index] = offsets
        landms[index] = points
    return loc, conf, landms


def detect(
    outputs: tuple[NDArray[np.float32], NDArray[np.float32], NDArray[np.float32]],
    options: DetectOptions = DEFAULT_OPTIONS,
    image_size: tuple[int, int] = (1280, 960),
) -> Detections:
    image = np.zeros((image_size[1], image_size[0], 3), np.uint8)
    _, scale = letterbox(image, INPUT, INPUT)
    return postprocess_detections(*outputs, (INPUT, INPUT), scale, image_size, options)


def test_postprocess_letterbox_scale() -> None:
    _, scale = letterbox(np.zeros((960, 1280, 3), np.uint8), INPUT, INPUT)
    assert scale.tolist() == [0.5, 0.5]


def test_postprocess_two_faces_in_original_pixels() -> None:
    found = detect(two_faces())
    assert len(found) == 2
    np.testing.assert_allclose(found.scores, [0.9, 0.8], rtol=1e-6)
    for i, (index, offsets, points) in enumerate([(FACE_A, LOC_A, LANDMS_A), (FACE_B, LOC_B, LANDMS_B)]):
        box, landmarks = expected_face(index, offsets, points, 0.5)
        np.testing.assert_allclose(found.boxes[i], box, atol=1e-3)
        np.testing.assert_allclose(found.landmarks[i], landmarks, atol=1e-3)
    assert found.boxes.dtype == found.scores.dtype == found.landmarks.dtype == np.float32
    assert found.landmarks.shape == (2, 5, 2)
    # Hand check of face A: anchor (200, 168) size 64; centre (206.4, 161.6) in the input.
    width, height = 64 * math.exp(0.1), 64 * math.exp(-0.05)
    np.testing.assert_allclose(
        found.boxes[0],
        np.array([206.4 - width / 2, 161.6 - height / 2, 206.4 + width / 2, 161.6 + height / 2]) * 2,
        atol=1e-3,
    )


def test_postprocess_nms_removes_overlapping_duplicate() -> None:
    loc, conf, landms = two_faces()
    duplicate = FACE_A + 1  # same cell, 128 px anchor; offsets shrink it to the same box as face A
    loc[duplicate] = [0.5, -0.5, LOC_A[2] + math.log(0.5) / 0.2, LOC_A[3] + math.log(0.5) / 0.2]
    conf[duplicate] = [0.15, 0.85]
    found = detect((loc, conf, landms))
    assert len(found) == 2
    np.testing.assert_allclose(found.scores, [0.9, 0.8], rtol=1e-6)
    # Without NMS (threshold 1.0 keeps IoU == 1 pairs) the duplicate would be the second face.
    loose = detect((loc, conf, landms), DetectOptions(nms_iou=1.0))
    np.testing.assert_allclose(loose.scores, [0.9, 0.85, 0.8], rtol=1e-6)
    np.testing.assert_allclose(loose.boxes[1], loose.boxes[0], atol=1e-3)


def test_postprocess_score_threshold() -> None:
    found = detect(two_faces(), DetectOptions(score_threshold=0.85))
    np.testing.assert_allclose(found.scores, [0.9], rtol=1e-6)
    assert len(detect(raw_outputs())) == 0


def test_postprocess_no_faces_has_empty_shapes() -> None:
    found = detect(raw_outputs())
    assert found.boxes.shape == (0, 4)
    assert found.scores.shape == (0,)
    assert found.landmarks.shape == (0, 5, 2)


def test_postprocess_min_face_size_and_max_faces() -> None:
    box_b, _ = expected_face(FACE_B, LOC_B, LANDMS_B, 0.5)
    side_b = min(box_b[2] - box_b[0], box_b[3] - box_b[1])  # the shorter side, in original pixels
    assert 60 < side_b < 70  # 32 px anchor, doubled by the letterbox scale
    assert len(detect(two_faces(), DetectOptions(min_face_size=side_b - 0.01))) == 2
    only_a = detect(two_faces(), DetectOptions(min_face_size=side_b + 0.01))
    np.testing.assert_allclose(only_a.scores, [0.9], rtol=1e-6)
    assert len(detect(two_faces(), DetectOptions(min_face_size=1000.0))) == 0
    best = detect(two_faces(), DetectOptions(max_faces=1))
    np.testing.assert_allclose(best.scores, [0.9], rtol=1e-6)
    # max_faces applies after the size filter: face B is the one kept.
    loc, conf, landms = two_faces()
    loc[FACE_A, 2:] = [-10.0, -10.0]  # face A shrinks to ~10 px
    kept = detect((loc, conf, landms), DetectOptions(min_face_size=side_b - 0.01, max_faces=1))
    np.testing.assert_allclose(kept.scores, [0.8], rtol=1e-6)


def test_postprocess_clips_boxes_to_the_image() -> None:
    loc, conf, landms = raw_outputs()
    corner = anchor_index(2, 0, 0, 1)  # 512 px anchor centred at (16, 16): reaches far outside
    corner_right = anchor_index(1, 29, 39, 1)  # 128 px anchor at (632, 472): (1264, 944) in the image
    conf[corner] = [0.1, 0.9]
    conf[corner_right] = [0.2, 0.8]
    found = detect((loc, conf, landms))
    assert len(found) == 2
    # Unclipped: [-480, -480, 544, 544] and [1136, 816, 1392, 1072] in the 1280x960 image.
    np.testing.assert_allclose(found.boxes[0], [0, 0, 544, 544], atol=1e-3)
    np.testing.assert_allclose(found.boxes[1], [1136, 816, 1280, 960], atol=1e-3)
    assert np.all(found.boxes[:, [0, 2]] <= 1280)
    assert np.all(found.boxes[:, [1, 3]] <= 960)
    assert np.all(found.boxes >= 0)


def test_postprocess_drops_boxes_clipped_to_nothing() -> None:
    loc, conf, landms = raw_outputs()
    bottom = anchor_index(1, 39, 39, 0)  # 64 px anchor at (632, 632): y from 1200 to 1328 > 960
    conf[bottom] = [0.1, 0.9]
    assert len(detect((loc, conf, landms))) == 0


def test_postprocess_partially_outside_box_is_clipped() -> None:
    loc, conf, landms = raw_outputs()
    right = anchor_index(1, 5, 39, 1)  # 128 px anchor at (632, 88): x from 568 to 696 in the input
    conf[right] = [0.1, 0.9]
    found = detect((loc, conf, landms))
    np.testing.assert_allclose(found.boxes, [[1136, 48, 1280, 304]], atol=1e-3)


def test_postprocess_wrong_anchor_count() -> None:
    loc, conf, landms = raw_outputs()
    with pytest.raises(ValueError, match="16800"):
        detect((loc[:-1], conf[:-1], landms[:-1]))


# --- work reduction: reduced JPEG decoding ----------------------------------------------------------


def test_reduced_jpeg_decode_and_original_size() -> None:
    from facecore.processing import original_size

    rng = np.random.default_rng(7)
    image = cv2.resize(rng.integers(0, 255, (60, 80, 3), dtype=np.uint8), (4000, 3000))
    ok, jpeg = cv2.imencode(".jpg", image)
    assert ok
    data = jpeg.tobytes()
    full = decode_image(data, 10**8)
    assert full.shape == (3000, 4000, 3)
    assert decode_image(data, 10**8, min_side=1000).shape == (750, 1000, 3)  # 1/4: longer side stays >= 1000
    assert decode_image(data, 10**8, min_side=1500).shape == (1500, 2000, 3)  # 1/2
    assert decode_image(data, 10**8, min_side=3000).shape == (3000, 4000, 3)  # no reduction possible
    reduced = decode_image(data, 10**8, min_side=1000)
    assert original_size(data, reduced) == (4000, 3000)
    ok, png = cv2.imencode(".png", image[:400, :600])
    assert decode_image(png.tobytes(), 10**8, min_side=100).shape == (400, 600, 3)  # only JPEGs are reduced


def test_fast_header_equals_pil_or_leaves_it_to_pil(photos: dict[str, Path]) -> None:
    """JPEG and PNG sizes are read from the header without PIL (it cost ~0.2 ms per image, paid twice
    per request); wherever the fast path answers it must say what PIL says, on whole files and on cuts
    of them that PIL can still open (a cut PIL refuses fails at decoding instead: 400 either way)."""
    from facecore.processing import _fast_header

    image = cv2.imread(str(photos["obama.jpg"]), cv2.IMREAD_COLOR)
    samples = [path.read_bytes() for path in photos.values()]
    samples += [cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_PROGRESSIVE, 1])[1].tobytes(),
                cv2.imencode(".png", image)[1].tobytes()]
    with_exif = io.BytesIO()
    Image.open(photos["obama.jpg"]).save(with_exif, "JPEG", exif=Image.Exif())
    samples.append(with_exif.getvalue())
    answered = 0
    for data in samples:
        for cut in (len(data), 4096, 600, 100, 30):
            fast = _fast_header(data[:cut])
            if fast is None:
                continue
            answered += cut == len(data)
            try:
                pil = Image.open(io.BytesIO(data[:cut]))
            except OSError:
                assert cut < len(data)
                continue
            assert fast == (pil.format, *pil.size)
    assert answered == len(samples)  # every whole file was answered by the fast path
    assert _fast_header(b"\xff\xd8\xff\xda" + b"\x00" * 20) is None  # a scan before any frame header
    assert _fast_header(b"GIF89a" + b"\x00" * 20) is None


def test_crafted_jpeg_headers_cost_bounded_work(photos: dict[str, Path],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway reads every upload's header on its event loop. A 10 MiB body of fill bytes or of empty
    segments cost seconds there (the marker walk and PIL's both stepped through it byte by byte): the walk
    now stops after ``MAX_SEGMENTS`` markers or ``MAX_FILL`` fill bytes in a row, and PIL, which steps
    over junk, sees only the first ``JPEG_HEADER_BYTES``. A JPEG with junk between its segments (libjpeg
    decodes it with a warning) is still read by PIL."""
    from facecore import jpeg, processing

    opened: list[int] = []
    pil_open = processing.Image.open

    def counting(buffer: io.BytesIO) -> Image.Image:
        opened.append(len(buffer.getvalue()))
        return pil_open(buffer)

    monkeypatch.setattr(processing.Image, "open", counting)
    size = 1 << 20
    crafted = [b"\xff\xd8\xff" + b"\xff" * size, b"\xff\xd8" + b"\xff\xe0\x00\x02" * (size // 4),
               b"\xff\xd8\xff\xe0\x00\x02" + b"\x00" * size]
    for data in crafted:
        walked = list(jpeg.markers(data))
        assert len(walked) <= jpeg.MAX_SEGMENTS + 1 and walked[-1][0] == -1
        with pytest.raises(ImageError, match="not a decodable image"):
            image_header(data, 40_000_000)
    assert opened and max(opened) <= processing.JPEG_HEADER_BYTES
    fill_then_frame = (b"\xff\xd8" + b"\xff" * 100 + b"\xc0\x00\x11\x08\x00\x10\x00\x20\x03"
                       + b"\x00" * 100)
    assert image_header(fill_then_frame, 40_000_000) == ("JPEG", 32, 16)

    real = photos["obama.jpg"].read_bytes()
    _, first = next(iter(jpeg.markers(real)))
    after_first = first + 2 + int.from_bytes(real[first + 2:first + 4], "big")
    junky = real[:after_first] + b"\x00\x11" * 10 + real[after_first:]
    opened.clear()
    assert image_header(junky, 40_000_000) == image_header(real, 40_000_000) == ("JPEG", 910, 1137)
    assert opened  # PIL read it
