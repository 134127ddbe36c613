"""The use cases' results as REST responses (``service.schemas``); nothing here does work of its own."""

from __future__ import annotations

from facecore.contract import Faces
from facecore.quality import assess
from facecore.scores import expected_fpir
from gallery.calibration import Decision
from gallery.gallery import Candidate as GalleryCandidate
from gallery.store.store import FaceInfo, IdentityInfo
from recognition.usecases import Enrolled, FaceSearch, Identified, Verified
from service import schemas


def box(values: list[float]) -> schemas.Box:
    return schemas.Box(x1=values[0], y1=values[1], x2=values[2], y2=values[3])


def detected_face(faces: Faces, i: int) -> schemas.DetectedFace:
    quality = assess(faces.boxes[i], faces.landmarks[i], float(faces.blur[i]), float(faces.scores[i]))
    return schemas.DetectedFace(
        box=box(faces.boxes[i].tolist()), score=float(faces.scores[i]),
        landmarks=[schemas.Point(x=float(x), y=float(y)) for x, y in faces.landmarks[i]],
        quality=schemas.Quality(**quality.as_dict()),
    )


def detect_response(faces: Faces) -> schemas.DetectResponse:
    return schemas.DetectResponse(width=faces.width, height=faces.height,
                                  faces=[detected_face(faces, i) for i in range(len(faces))])


def candidate(found: GalleryCandidate, decision: Decision) -> schemas.Candidate:
    return schemas.Candidate(external_id=found.external_id, name=found.name, score=round(found.score, 6),
                             confidence=round(decision.confidence(found.score), 4))


def identify_response(identified: Identified) -> schemas.IdentifyResponse:
    faces, limit, decision = identified.faces, identified.threshold, identified.decision
    out = []
    for i, result in enumerate(identified.results):
        match = result.match
        out.append(schemas.IdentifiedFace(
            box=box(faces.boxes[i].tolist()), score=float(faces.scores[i]),
            landmarks=[schemas.Point(x=float(x), y=float(y)) for x, y in faces.landmarks[i]],
            decision="match" if match is not None else "unknown",
            identity=candidate(match, decision) if match is not None else None,
            candidates=[candidate(c, decision) for c in result.candidates]))
    return schemas.IdentifyResponse(width=faces.width, height=faces.height, threshold=limit,
                                    match_policy=decision.policy, expected_fpir=_fpir(decision, limit),
                                    faces=out)


def _fpir(decision: Decision, threshold: float) -> float | None:
    """The share of strangers matched to somebody at ``threshold`` (the request's, or the collection's),
    at the collection's size; None without a score model."""
    if decision.tail is None:
        return None
    return round(expected_fpir(decision.tail, threshold, decision.faces), 6)


def verify_response(verified: Verified) -> schemas.VerifyResponse:
    face_b = None if verified.face_b is None else detected_face(*verified.face_b)
    return schemas.VerifyResponse(score=round(verified.score, 6),
                                  confidence=round(verified.decision.confidence(verified.score), 4),
                                  threshold=verified.threshold, same=verified.same,
                                  face_a=detected_face(*verified.face_a), face_b=face_b)


def identity_out(info: IdentityInfo) -> schemas.IdentityOut:
    return schemas.IdentityOut.model_validate(info, from_attributes=True)


def face_out(info: FaceInfo) -> schemas.FaceOut:
    data = {name: getattr(info, name)
            for name in ("id", "image_sha256", "detection_score", "quality", "has_crop", "created_at")}
    return schemas.FaceOut(box=box(info.box), **data)


def enroll_response(enrolled: Enrolled) -> schemas.EnrollResponse:
    ignored = [schemas.IgnoredFaceOut(image=face.image, box=box(face.box), reason=face.reason.value)
               for face in enrolled.ignored]
    return schemas.EnrollResponse(identity=identity_out(enrolled.identity),
                                  faces=[face_out(f) for f in enrolled.faces], ignored=ignored)


def face_search_response(found: FaceSearch) -> schemas.FaceSearchResponse:
    limit, match = found.result.threshold, found.result.match
    return schemas.FaceSearchResponse(
        face_id=found.face.face.id, external_id=found.face.external_id, threshold=limit,
        decision="match" if match is not None else "unknown",
        identity=candidate(match, found.decision) if match is not None else None,
        candidates=[candidate(c, found.decision) for c in found.result.candidates])
