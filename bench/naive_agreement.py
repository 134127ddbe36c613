"""Do the naive variants decide alike? Each variant's faces against the plain variant's, on the same photos.

Doing less work (reduced JPEG decode, the detector input sized to the image, another runtime or precision)
moves detections by a few pixels, so embeddings of the same face differ a little (a cosine of 0.97 on a
small face of a group photo after reduced decode). What must not change is what the answers say: the same
faces found in every photo, each face still closest to itself, and the same same/different decision
(cosine >= the embedder's threshold) on every pair of faces across all photos.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: variant -> photo -> the faces ``POST /embed`` returned (box, score, landmarks, embedding)
FacesByVariant = Mapping[str, Mapping[str, Sequence[Mapping[str, Any]]]]
PLAIN = "plain"


@dataclass(frozen=True)
class Agreement:
    """One variant against plain."""

    variant: str
    faces: dict[str, tuple[int, int]]  # photo -> (faces of the variant, faces of plain)
    lowest_cosine: float  # the same face (matched by box overlap), variant vs plain; nan if not matched
    lowest_iou: float  # ... and the box overlap of that match
    #: every variant face's most similar plain embedding is the face its box overlaps
    closest_is_same_face: bool
    pairs: int  # face pairs across all photos (0 when the faces differ)
    same_decisions: int  # pairs both variants decide alike at ``threshold``
    matches: int  # pairs plain calls the same person
    threshold: float

    @property
    def same_faces(self) -> bool:
        return all(a == b for a, b in self.faces.values()) and self.closest_is_same_face

    @property
    def decisions_agree(self) -> bool:
        return self.same_faces and self.same_decisions == self.pairs

    def describe(self) -> str:
        text = "; ".join(f"{photo}: {a} face(s) {self.variant}, {b} plain"
                         for photo, (a, b) in self.faces.items())
        if not self.same_faces:
            return f"{text}; not the same faces"
        return (f"{text}; same face embedding cosine >= {self.lowest_cosine:.4f} (box IoU >= "
                f"{self.lowest_iou:.2f}), each face closest to itself; same/different decisions at threshold "
                f"{self.threshold:g}: {self.same_decisions} of {self.pairs} face pairs alike ({self.matches} "
                "same-person)")


def _iou(a: Sequence[float], b: Sequence[float]) -> float:
    width = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    height = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = width * height
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def _cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))
    return dot / norm if norm else 0.0


def _decisions(embeddings: Sequence[Sequence[float]], threshold: float) -> list[bool]:
    return [_cosine(a, b) >= threshold for a, b in itertools.combinations(embeddings, 2)]


def compare(variant: str, faces: Mapping[str, Sequence[Mapping[str, Any]]],
            plain: Mapping[str, Sequence[Mapping[str, Any]]], threshold: float) -> Agreement:
    """``variant``'s faces against plain's on the same photos (each of its faces matched to the plain face
    whose box overlaps it most)."""
    counts = {photo: (len(faces[photo]), len(plain[photo])) for photo in faces}
    ours, theirs, cosines, ious, closest = [], [], [], [], True
    for photo, found in faces.items():
        others = plain[photo]
        if len(found) != len(others) or not found:
            continue
        for face in found:
            overlaps = [_iou(face["box"], other["box"]) for other in others]
            matched = max(range(len(others)), key=overlaps.__getitem__)
            similar = [_cosine(face["embedding"], other["embedding"]) for other in others]
            closest &= max(range(len(others)), key=similar.__getitem__) == matched
            cosines.append(similar[matched])
            ious.append(overlaps[matched])
            ours.append(face["embedding"])
            theirs.append(others[matched]["embedding"])
    same = all(a == b for a, b in counts.values())
    mine, reference = (_decisions(ours, threshold), _decisions(theirs, threshold)) if same else ([], [])
    return Agreement(variant, counts, min(cosines, default=math.nan), min(ious, default=math.nan),
                     closest and bool(cosines), len(reference),
                     sum(a == b for a, b in zip(mine, reference, strict=True)), sum(reference), threshold)


def compare_all(faces: FacesByVariant, threshold: float) -> list[Agreement]:
    """Every variant other than plain against plain (none without a plain variant)."""
    if PLAIN not in faces:
        return []
    return [compare(variant, found, faces[PLAIN], threshold) for variant, found in faces.items()
            if variant != PLAIN]


def describe(agreements: Sequence[Agreement]) -> str:
    return " | ".join(f"{a.variant} vs plain: {a.describe()}" for a in agreements)
