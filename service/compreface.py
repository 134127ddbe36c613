"""CompreFace's REST shapes for ``service/routers/compreface.py``: its response models, its error body
``{"message", "code"}`` (with its numeric codes and HTTP statuses), its key header, and the conversion of
the use cases' results. Nothing here decides anything about faces: that is ``recognition/``.

``similarity`` is our ``confidence``: a logistic of the cosine score, 0.5 at the collection's threshold
(CompreFace's own similarity is a tanh of the embedding distance, also tuned so that 0.5 separates
matches from non-matches). See docs/compat.md.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Response, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import APIKeyHeader
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from facecore.client import PipelineError
from facecore.contract import Faces
from gallery.calibration import Decision
from gallery.errors import Conflict, GalleryError, NotFound
from recognition.errors import Refused
from service.auth import Principal
from service.compat import HTTP_CODES, describe, rendering_route
from service.deps import KeysDep, lookup_key
from service.errors import RETRY_AFTER_S, ApiError, pipeline_error, retry_after

#: CompreFace's codes (its CommonExceptionCode) for ours; anything else is 0 ("undefined"), status 400,
#: unless it is the server's fault (v1 answers 5xx): then v1's status, code 41 (``_uncoded``).
_CODES: dict[str, tuple[int, int]] = {
    "no_face": (400, 28), "no_face_in_box": (400, 28), "several_faces": (400, 31),
    "low_quality": (400, 36), "no_enrolled_face": (400, 28), "validation_error": (400, 26),
    "invalid_image": (400, 21), "invalid_base64": (400, 21), "unsupported_media_type": (400, 21),
    "invalid_json": (400, 26), "invalid_multipart": (400, 34), "missing_image": (400, 34),
    "payload_too_large": (413, 0), "too_many_pixels": (413, 0), "too_many_images": (413, 0),
    "embedding_model_mismatch": (400, 0), "triton_unavailable": (503, 41), "service_unavailable": (503, 41),
    "overloaded": (503, 41), "timeout": (504, 41),
}
_MESSAGES = {"no_face": "No face is found in the given image",
             "several_faces": "More than one face in the source image"}
PLUGINS = ("landmarks", "calculator")  # the face plugins served; age, gender, mask and pose are not


class CompreFaceError(Exception):
    def __init__(self, status: int, code: int, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def _not_found(exc: NotFound) -> tuple[int, int, str]:
    if "face_id" in exc.details:
        return 404, 44, f"Image {exc.details['face_id']} not found"
    if "external_id" in exc.details:
        return 404, 42, f"Subject {exc.details['external_id']} not found"
    return 404, 10, f"Recognition service not found: {exc.message}"


def _uncoded(exc: Exception) -> tuple[int, int]:
    """Status and code of one of our codes CompreFace has no twin for: a server-side failure keeps v1's
    5xx (a client retries it; a 400 would tell it to give up), anything else is 400/0."""
    described = describe(exc)
    return (described[0], 41) if described is not None and described[0] >= 500 else (400, 0)


def compreface_error(exc: Exception) -> tuple[int, int, str] | None:
    """(HTTP status, CompreFace code, message) for an error, or None for one that is not the caller's."""
    if isinstance(exc, PipelineError):
        exc = pipeline_error(exc)
    if isinstance(exc, CompreFaceError):
        return exc.status, exc.code, exc.message
    if isinstance(exc, NotFound):
        return _not_found(exc)
    if isinstance(exc, Conflict):
        return 400, 43, "Subject already exists"
    if isinstance(exc, RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return 400, 26, f"Validation for field {where} failed: {first.get('msg', '')}"
    if isinstance(exc, Refused | ApiError | GalleryError):
        status, code = _CODES.get(exc.code) or _uncoded(exc)
        return status, code, f"{_MESSAGES.get(exc.code, exc.message)} ({exc.code})"
    if isinstance(exc, StarletteHTTPException) and exc.status_code < 500:  # a streamed-body 413, a bad form
        ours = HTTP_CODES.get(exc.status_code, "http_error")
        return exc.status_code, _CODES.get(ours, (0, 0))[1], f"{exc.detail} ({ours})"
    return None


def compreface_response(status: int, code: int, message: str, retry: str = str(RETRY_AFTER_S)) -> Response:
    headers = {"Retry-After": retry} if status == 503 else None
    return JSONResponse({"message": message, "code": code}, status_code=status, headers=headers)


def render(exc: Exception) -> Response | None:
    """CompreFace's answer to an error (None: a bug, the app's logged 500); a 503 has v1's Retry-After."""
    found = compreface_error(exc)
    return None if found is None else compreface_response(*found, retry_after(exc))


CompreFaceRoute = rendering_route(render)


_key = APIKeyHeader(name="x-api-key", auto_error=False,
                    description="a collection key of this service (CompreFace: the service's API key)")


async def caller(keys: KeysDep, key: Annotated[str | None, Security(_key)] = None) -> Principal:
    """Any valid key, CompreFace-style: 400 code 20 without one, 404 code 10 for an unknown one."""
    if not key:
        raise CompreFaceError(400, 20, "Missing header: x-api-key")
    found = await lookup_key(keys, key)
    if found is None:
        raise CompreFaceError(404, 10, "Service with this API key not found")
    return found


def collection_of(principal: Principal) -> str:
    """The collection behind a recognition key (the admin key names no collection)."""
    if principal.collection is None:
        raise CompreFaceError(404, 10, "Recognition service with this API key not found: use a collection "
                                       "key, not the admin key")
    return principal.collection


# --- responses ------------------------------------------------------------------------------------

class CfBox(BaseModel):
    probability: float = Field(description="detection score")
    x_max: int
    y_max: int
    x_min: int
    y_min: int


class CfSubject(BaseModel):
    subject: str
    similarity: float = Field(description="our confidence: 0.5 at the collection's threshold (see docs)")


class CfFace(BaseModel):
    box: CfBox
    landmarks: list[list[int]] | None = Field(None, description="with face_plugins=landmarks")
    embedding: list[float] | None = Field(None, description="with face_plugins=calculator")
    subjects: list[CfSubject] | None = Field(None, description="recognize: subjects at or above the "
                                                               "threshold")
    similarity: float | None = Field(None, description="verify: similarity with the reference face")
    execution_time: dict[str, float] | None = Field(None, description="with status=true")


class CfResult(BaseModel):
    result: list[CfFace]
    plugins_versions: dict[str, str] | None = Field(None, description="with status=true")


class CfMatch(BaseModel):
    source_image_face: CfFace
    face_matches: list[CfFace]
    plugins_versions: dict[str, str] | None = None


class CfVerification(BaseModel):
    result: list[CfMatch]


class CfExample(BaseModel):
    image_id: str = Field(description="the face id (ours are integers, CompreFace's UUIDs)")
    subject: str


class CfExamplePage(BaseModel):
    faces: list[CfExample]
    page_number: int
    page_size: int
    total_pages: int
    total_elements: int


def plugin_set(face_plugins: str) -> set[str]:
    return {p.strip() for p in face_plugins.split(",") if p.strip() in PLUGINS}


def picked(faces: Faces, limit: int) -> list[int]:
    """Face indices in order; with ``limit`` > 0 only the ``limit`` biggest (CompreFace's rule)."""
    if limit <= 0:
        return list(range(len(faces)))
    return sorted(sorted(range(len(faces)), key=lambda i: -float(faces.areas()[i]))[:limit])


def cf_face(faces: Faces, i: int, plugins: set[str], elapsed_ms: float | None = None) -> CfFace:
    x1, y1, x2, y2 = (round(float(v)) for v in faces.boxes[i])
    return CfFace(
        box=CfBox(probability=round(float(faces.scores[i]), 5), x_max=x2, y_max=y2, x_min=x1, y_min=y1),
        landmarks=[[round(float(x)), round(float(y))] for x, y in faces.landmarks[i]]
        if "landmarks" in plugins else None,
        embedding=[float(v) for v in faces.embeddings[i]] if "calculator" in plugins else None,
        execution_time=None if elapsed_ms is None else {"face_pipeline": round(elapsed_ms, 1)})


def similarity(score: float, decision: Decision) -> float:
    """CompreFace's similarity: our confidence (docs/calibration.md), to five places."""
    return round(decision.confidence(score), 5)
