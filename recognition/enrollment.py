"""The enrollment rules, in one place: which face of an image is enrolled, the quality gate, the
stored crop, and the ``NewFace`` handed to the store. The REST route and the importer both call
``enrollable_face``; a refusal is a ``Refused`` with a stable code."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import cv2
import numpy as np
from numpy.typing import NDArray

from facecore.contract import Faces
from facecore.quality import QualityThresholds, assess
from gallery.store import NewFace
from recognition.errors import Refused

#: A given box picks the detected face it overlaps most, if that overlap (IoU) reaches this.
MIN_BOX_OVERLAP = 0.3


class FaceChoice(StrEnum):
    """Which face of an image with several: ``only`` refuses such an image, ``largest`` takes the biggest."""

    ONLY = "only"
    LARGEST = "largest"


@dataclass(frozen=True)
class EnrollmentRules:
    quality: QualityThresholds = field(default_factory=QualityThresholds)
    choice: FaceChoice = FaceChoice.ONLY
    #: x1, y1, x2, y2 of the face to enroll (overrides ``choice``).
    box: Sequence[float] | None = None


def image_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def box_iou(box: NDArray[np.float32], boxes: NDArray[np.float32]) -> NDArray[np.float64]:
    """IoU of one box [4] with each of ``boxes`` [N, 4] (x1, y1, x2, y2)."""
    x1, y1 = np.maximum(box[0], boxes[:, 0]), np.maximum(box[1], boxes[:, 1])
    x2, y2 = np.minimum(box[2], boxes[:, 2]), np.minimum(box[3], boxes[:, 3])
    inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    union = (box[2] - box[0]) * (box[3] - box[1]) + areas - inter
    return np.where(union > 0, inter / np.maximum(union, 1e-9), 0.0)


def largest(faces: Faces) -> int:
    return int(np.argmax(faces.areas()))


def _where(image: int | None) -> tuple[str, dict[str, object]]:
    return ("image", {}) if image is None else (f"images[{image}]", {"image": image})


def choose_face(faces: Faces, rules: EnrollmentRules, image: int | None = None) -> int:
    """The index of the face to enroll; ``Refused`` with no_face, no_face_in_box or several_faces."""
    label, where = _where(image)
    if len(faces) == 0:
        raise Refused(f"{label}: no face found", "no_face", **where)
    boxes = faces.boxes.round(1).tolist()
    if rules.box is not None:
        overlaps = box_iou(np.asarray(rules.box, np.float32), faces.boxes)
        if overlaps.max() < MIN_BOX_OVERLAP:
            raise Refused(f"{label}: no detected face overlaps the given box", "no_face_in_box",
                          **where, boxes=boxes)
        return int(np.argmax(overlaps))
    if len(faces) > 1 and rules.choice is FaceChoice.ONLY:
        raise Refused(f"{label}: {len(faces)} faces; pass face=largest or a box", "several_faces",
                      **where, boxes=boxes)
    return 0 if len(faces) == 1 else largest(faces)


def crop_png(faces: Faces, index: int) -> bytes | None:
    """The aligned crop of one face as PNG (kept for re-embedding), when the pipeline returned crops."""
    if faces.crops.shape[0] <= index:
        return None
    ok, png = cv2.imencode(".png", faces.crops[index])
    return png.tobytes() if ok else None


def accept_face(faces: Faces, index: int, digest: str, rules: EnrollmentRules, image: int | None = None
                ) -> NewFace:
    """The quality gate for one face; ``Refused`` (low_quality, with the reasons) or the face to store."""
    label, where = _where(image)
    quality = assess(faces.boxes[index], faces.landmarks[index], float(faces.blur[index]),
                     float(faces.scores[index]))
    reasons = quality.rejections(rules.quality)
    if reasons:
        raise Refused(f"{label}: face refused: {', '.join(reasons)}", "low_quality", **where,
                      reasons=[r.value for r in reasons], quality=quality.as_dict())
    return NewFace(faces.embeddings[index], digest, faces.boxes[index].tolist(), float(faces.scores[index]),
                   quality.as_dict(), crop_png(faces, index))


def enrollable_face(faces: Faces, data: bytes, rules: EnrollmentRules, image: int | None = None) -> NewFace:
    """Choose the face of one image and pass it through the quality gate."""
    return accept_face(faces, choose_face(faces, rules, image), image_sha256(data), rules, image)
