"""The enrollment rules, in one place: which face of an image is enrolled, the quality gate, the
stored crop, and the ``NewFace`` handed to the store. The REST routes (v1, CompreFace, DeepStack) and the
importer all call ``enrollable_face``; a refusal is a ``Refused`` with a stable code.

The obvious face is taken: faces too small to ever pass the quality gate (shorter side below
``min_face_size``) do not make an image "several faces"; every face not enrolled is reported with why.
"""

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
from gallery.store.store import NewFace
from recognition.errors import Refused

#: A given box picks the detected face it overlaps most, if that overlap (IoU) reaches this.
MIN_BOX_OVERLAP = 0.3


class FaceChoice(StrEnum):
    """Which face of an image with several: ``only`` refuses such an image, ``largest`` takes the biggest."""

    ONLY = "only"
    LARGEST = "largest"


class IgnoreReason(StrEnum):
    """Why a detected face of an enrolled image was not the one enrolled."""

    FACE_TOO_SMALL = "face_too_small"  # below the quality gate's minimum size: it could never be enrolled
    NOT_LARGEST = "not_largest"  # face=largest took a bigger one
    OUTSIDE_BOX = "outside_box"  # a box chose another face


@dataclass(frozen=True)
class IgnoredFace:
    image: int  # index of the image in the request (0 for a single image)
    box: list[float]
    reason: IgnoreReason


@dataclass(frozen=True)
class Chosen:
    index: int
    ignored: tuple[IgnoredFace, ...] = ()


@dataclass(frozen=True)
class Enrollable:
    face: NewFace
    ignored: tuple[IgnoredFace, ...] = ()


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


def _ignored(faces: Faces, keep: int, reasons: dict[int, IgnoreReason], image: int | None) -> tuple[
        IgnoredFace, ...]:
    return tuple(IgnoredFace(image or 0, faces.boxes[i].round(1).tolist(), reasons[i])
                 for i in range(len(faces)) if i != keep)


def choose_face(faces: Faces, rules: EnrollmentRules, image: int | None = None) -> Chosen:
    """The face to enroll and the others with why they were left; ``Refused`` with no_face,
    no_face_in_box or several_faces (only faces that could pass the minimum size count as several)."""
    label, where = _where(image)
    if len(faces) == 0:
        raise Refused(f"{label}: no face found", "no_face", **where)
    if rules.box is not None:
        overlaps = box_iou(np.asarray(rules.box, np.float32), faces.boxes)
        if overlaps.max() < MIN_BOX_OVERLAP:
            raise Refused(f"{label}: no detected face overlaps the given box", "no_face_in_box",
                          **where, boxes=faces.boxes.round(1).tolist())
        chosen = int(np.argmax(overlaps))
        return Chosen(chosen, _ignored(faces, chosen, dict.fromkeys(range(len(faces)),
                                                                     IgnoreReason.OUTSIDE_BOX), image))
    sides = np.minimum(faces.boxes[:, 2] - faces.boxes[:, 0], faces.boxes[:, 3] - faces.boxes[:, 1])
    big = [i for i in range(len(faces)) if sides[i] >= rules.quality.min_face_size]
    if len(big) > 1 and rules.choice is FaceChoice.ONLY:
        raise Refused(f"{label}: {len(big)} faces; pass face=largest or a box", "several_faces",
                      **where, boxes=faces.boxes[big].round(1).tolist())
    # One face that can pass the size gate, or the largest (with none: the gate refuses it, face_too_small).
    chosen = big[0] if len(big) == 1 else largest(faces)
    reasons = {i: IgnoreReason.NOT_LARGEST if i in big else IgnoreReason.FACE_TOO_SMALL
               for i in range(len(faces))}
    return Chosen(chosen, _ignored(faces, chosen, reasons, image))


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


def enrollable_face(faces: Faces, digest: str, rules: EnrollmentRules, image: int | None = None
                    ) -> Enrollable:
    """Choose the face of one image and pass it through the quality gate; ``digest`` is the image's
    ``image_sha256``, hashed once by the caller (the duplicate check and the stored face need it too)."""
    chosen = choose_face(faces, rules, image)
    return Enrollable(accept_face(faces, chosen.index, digest, rules, image), chosen.ignored)
