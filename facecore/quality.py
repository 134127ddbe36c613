"""Face quality measures and the enrollment quality gate (pure numpy, no model).

Pose is *estimated from the five landmarks*, not measured by a pose network: roll from the eye
line, yaw from how far the nose sits from the eyes' midline, pitch from where the nose sits between
the eye line and the mouth line. Good enough to refuse profiles and faces looking far up or down;
not a substitute for a head-pose model. Thresholds are settings; the defaults are deliberately
lenient and were checked on the project's test photos only.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from enum import StrEnum

import numpy as np
from numpy.typing import NDArray

from facecore.limits import setting
from facecore.processing import ARCFACE_TEMPLATE_112

# Nose position between the eye line (0) and the mouth line (1) on the frontal template.
_FRONTAL_NOSE_RATIO = float(
    (ARCFACE_TEMPLATE_112[2, 1] - ARCFACE_TEMPLATE_112[:2, 1].mean())
    / (ARCFACE_TEMPLATE_112[3:, 1].mean() - ARCFACE_TEMPLATE_112[:2, 1].mean())
)


class Rejection(StrEnum):
    """Why a face was refused for enrollment (stable codes)."""

    FACE_TOO_SMALL = "face_too_small"
    TOO_BLURRY = "too_blurry"
    POSE_TOO_FAR = "pose_too_far"
    LOW_DETECTION_SCORE = "low_detection_score"


@dataclass(frozen=True)
class QualityThresholds:
    """The enrollment quality gate; also the settings section ``FACEREC_QUALITY__*``."""

    min_face_size: float = setting(40.0, "shorter box side, pixels")
    min_blur: float = setting(40.0, "variance of the Laplacian of the crop")  # the 112x112 aligned crop
    max_yaw: float = setting(45.0, "degrees, estimated from landmarks")
    max_pitch: float = setting(40.0, "degrees, estimated from landmarks")
    max_roll: float = setting(45.0, "degrees, from the eye line")
    min_detection_score: float = setting(0.75, "detector score")


@dataclass(frozen=True)
class FaceQuality:
    face_size: float
    blur: float
    yaw: float
    pitch: float
    roll: float
    detection_score: float

    def rejections(self, limits: QualityThresholds) -> list[Rejection]:
        reasons = []
        if self.face_size < limits.min_face_size:
            reasons.append(Rejection.FACE_TOO_SMALL)
        if self.blur < limits.min_blur:
            reasons.append(Rejection.TOO_BLURRY)
        if (abs(self.yaw) > limits.max_yaw or abs(self.pitch) > limits.max_pitch
                or abs(self.roll) > limits.max_roll):
            reasons.append(Rejection.POSE_TOO_FAR)
        if self.detection_score < limits.min_detection_score:
            reasons.append(Rejection.LOW_DETECTION_SCORE)
        return reasons

    def as_dict(self) -> dict[str, float]:
        return {key: round(float(value), 3) for key, value in asdict(self).items()}


def estimate_pose(landmarks: NDArray[np.float32]) -> tuple[float, float, float]:
    """(yaw, pitch, roll) in degrees from five landmarks [5, 2] (eyes, nose, mouth corners)."""
    points = np.asarray(landmarks, dtype=np.float64).reshape(5, 2)
    eye_mid = points[:2].mean(axis=0)
    eye_vector = points[1] - points[0]
    roll = math.degrees(math.atan2(eye_vector[1], eye_vector[0]))
    angle = math.radians(-roll)
    rotation = np.array([[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]])
    upright = (points - eye_mid) @ rotation.T  # eye line horizontal, eye midpoint at the origin
    half_eyes = max(float(np.linalg.norm(eye_vector)) / 2, 1e-6)
    yaw = math.degrees(math.asin(float(np.clip(upright[2, 0] / (2 * half_eyes), -1, 1))) * 2)
    mouth_y = float(upright[3:, 1].mean())
    ratio = float(upright[2, 1]) / mouth_y if abs(mouth_y) > 1e-6 else _FRONTAL_NOSE_RATIO
    pitch = math.degrees(math.asin(float(np.clip((ratio - _FRONTAL_NOSE_RATIO) * 2, -1, 1))))
    return yaw, pitch, roll


def assess(box: NDArray[np.float32], landmarks: NDArray[np.float32], blur: float,
           score: float) -> FaceQuality:
    """Quality measures of one detected face."""
    yaw, pitch, roll = estimate_pose(landmarks)
    size = float(min(box[2] - box[0], box[3] - box[1]))
    return FaceQuality(size, float(blur), yaw, pitch, roll, float(score))
