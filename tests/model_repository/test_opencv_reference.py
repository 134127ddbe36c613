"""Agreement with an independent implementation: OpenCV's FaceRecognizerSF (alignCrop + feature).

OpenCV loads the SFace file exactly as shipped (int8, batch 1) and aligns with its own code; for the
same pixels and landmarks our crop and our embedding (through Triton) must agree with it: cosine >= 0.99.
"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest

from export.defaults import DefaultModels
from export.served import served_networks
from facecore.client import PipelineClient
from facecore.processing import decode_sized

pytestmark = pytest.mark.triton

PHOTOS = ["t1.jpg", "obama.jpg", "obama2.jpg", "obama3.jpg", "biden.jpg", "astronaut.png"]


def yunet_row(box: np.ndarray, landmarks: np.ndarray, score: float) -> np.ndarray:
    """OpenCV's face row: x, y, w, h, five (x, y) landmarks in the template's order, score."""
    x1, y1, x2, y2 = box
    return np.array([[x1, y1, x2 - x1, y2 - y1, *landmarks.reshape(-1), score]], dtype=np.float32)


def test_crops_and_embeddings_agree_with_opencv(
    pipeline: PipelineClient, photos: dict[str, Path], default_models: DefaultModels, cpu_repository: Path
) -> None:
    """OpenCV aligns the pixels the pipeline aligned: large JPEGs are decoded at reduced size there, so
    OpenCV gets the same reduced decode, with the landmarks in its pixels."""
    shipped = default_models.embedder_file.parent / "sface_2021dec.int8bq.b1.112x112.onnx"
    recognizer = cv2.FaceRecognizerSF.create(str(shipped), "")
    decode_min_side = served_networks(cpu_repository).settings.decode_min_side
    checked = 0
    for name in PHOTOS:
        data = photos[name].read_bytes()
        image, (width, _) = decode_sized(data, 10**8, decode_min_side)
        scale = image.shape[1] / width  # 1, or 1/2, 1/4, 1/8 for a reduced decode
        faces = pipeline.infer(data, return_crops=True)
        assert len(faces) > 0, name
        for i in range(len(faces)):
            row = yunet_row(faces.boxes[i] * scale, faces.landmarks[i] * scale, float(faces.scores[i]))
            crop = recognizer.alignCrop(image, row)
            assert np.abs(crop.astype(np.int16) - faces.crops[i].astype(np.int16)).mean() < 1.0, name
            reference = recognizer.feature(crop).reshape(-1)
            cosine = float(reference @ faces.embeddings[i] / np.linalg.norm(reference))
            assert cosine >= 0.99, f"{name} face {i}: cosine {cosine:.4f}"
            checked += 1
    assert checked == 11
