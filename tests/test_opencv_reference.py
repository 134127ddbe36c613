"""Agreement with an independent implementation: OpenCV's FaceRecognizerSF (alignCrop + feature).

OpenCV loads the SFace file exactly as shipped (int8, batch 1) and aligns with its own code; for the
same landmarks our crop and our embedding (through Triton) must agree with it: cosine >= 0.99.
"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest

from export.defaults import DefaultModels
from facecore.client import PipelineClient

pytestmark = pytest.mark.triton

PHOTOS = ["t1.jpg", "obama.jpg", "obama2.jpg", "obama3.jpg", "biden.jpg", "astronaut.png"]


def yunet_row(box: np.ndarray, landmarks: np.ndarray, score: float) -> np.ndarray:
    """OpenCV's face row: x, y, w, h, five (x, y) landmarks in the template's order, score."""
    x1, y1, x2, y2 = box
    return np.array([[x1, y1, x2 - x1, y2 - y1, *landmarks.reshape(-1), score]], dtype=np.float32)


def test_crops_and_embeddings_agree_with_opencv(
    pipeline: PipelineClient, photos: dict[str, Path], default_models: DefaultModels
) -> None:
    shipped = default_models.embedder_file.parent / "sface_2021dec.int8bq.b1.112x112.onnx"
    recognizer = cv2.FaceRecognizerSF.create(str(shipped), "")
    checked = 0
    for name in PHOTOS:
        image = cv2.imread(str(photos[name]), cv2.IMREAD_COLOR)
        faces = pipeline.infer(photos[name].read_bytes(), return_crops=True)
        assert len(faces) > 0, name
        for i in range(len(faces)):
            row = yunet_row(faces.boxes[i], faces.landmarks[i], float(faces.scores[i]))
            crop = recognizer.alignCrop(image, row)
            assert np.abs(crop.astype(np.int16) - faces.crops[i].astype(np.int16)).mean() < 1.0, name
            reference = recognizer.feature(crop).reshape(-1)
            cosine = float(reference @ faces.embeddings[i] / np.linalg.norm(reference))
            assert cosine >= 0.99, f"{name} face {i}: cosine {cosine:.4f}"
            checked += 1
    assert checked == 11
