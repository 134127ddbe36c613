"""DeepStack-compatible face API under ``/v1/vision/`` (the API CodeProject.AI kept, and the one Home
Assistant's DeepStack face integration speaks through ``deepstack-python``), on ONE collection: the
``FACEREC_DEEPSTACK__COLLECTION`` setting. Thin over the same use cases as the v1 API; answers are
``{"success": true, ...}`` and errors ``{"success": false, "error", "code"}`` with that HTTP status.

``api_key`` (a form field, as DeepStack takes it; the ``X-API-Key`` header works too) must be a key of that
collection or the admin key. ``userid`` is the identity's external id. ``confidence`` is our confidence
(0.5 at the collection's threshold); a face is named only when it reaches the threshold AND
``min_confidence``, otherwise it is ``"unknown"`` with confidence 0 (docs/compat.md).
"""

from __future__ import annotations

import asyncio
import functools
import time
from contextlib import suppress
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from facecore.contract import Faces
from gallery.errors import NotFound
from recognition.enrollment import EnrollmentRules, FaceChoice
from recognition.usecases import confidence
from service.admission import admit
from service.compat import describe, rendering_route
from service.deps import KeysDep, ServiceDep, SettingsDep, lookup_key
from service.images import Uploaded, read_images
from service.openapi import image_body
from service.schemas import Base64Image

#: Image fields a register call may use (DeepStack takes several images per registration).
IMAGE_FIELDS = ("image", *(f"image{i}" for i in range(1, 17)))


class DeepStackError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def _render(exc: Exception) -> JSONResponse | None:
    found = (exc.status, "", exc.message) if isinstance(exc, DeepStackError) else describe(exc)
    if found is None:
        return None
    status, code, message = found
    text = f"{message} ({code})" if code else message
    headers = {"Retry-After": "5"} if status == 503 else None
    body = {"success": False, "error": text, "code": status}
    return JSONResponse(body, status_code=status, headers=headers)


router = APIRouter(prefix="/v1/vision", tags=["DeepStack compatible"], route_class=rendering_route(_render))
#: The routes that do recognition work: shed beyond the in-flight limit (service/admission.py).
post_admitted = functools.partial(router.post, dependencies=[Depends(admit)])


class FormJson(BaseModel):  # DeepStack clients send multipart; JSON with base64 works as on the v1 API
    image: Base64Image | None = None
    image1: Base64Image | None = None
    userid: str | None = None
    api_key: str | None = None
    min_confidence: float | None = None


class Prediction(BaseModel):
    confidence: float
    userid: str | None = Field(None, description="recognize: the identity, or 'unknown'")
    x_min: int
    y_min: int
    x_max: int
    y_max: int


class Answer(BaseModel):
    success: bool = True
    predictions: list[Prediction] | None = None
    faces: list[str] | None = None
    message: str | None = None
    similarity: float | None = None
    duration: float = Field(0.0, description="milliseconds")


FORM = image_body(FormJson, {"image": False}, {"api_key": {"type": "string"},
                                                "min_confidence": {"type": "number"}})
REGISTER = image_body(FormJson, {"image": False, "image1": False}, {"api_key": {"type": "string"},
                                                                     "userid": {"type": "string"}})
FIELDS = image_body(FormJson, {}, {"api_key": {"type": "string"}, "userid": {"type": "string"}})


async def _fields(request: Request) -> dict[str, Any]:
    """The form fields of a call without images (multipart or url-encoded, as clients send them)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind in ("multipart/form-data", "application/x-www-form-urlencoded"):
        form = await request.form(max_files=len(IMAGE_FIELDS) + 1, max_fields=32)
        return {k: v for k, v in form.items() if isinstance(v, str)}
    return {}


async def _collection(request: Request, settings: SettingsDep, keys: KeysDep, fields: dict[str, Any]) -> str:
    """The configured collection, when the caller's api_key (form field or X-API-Key) may use it."""
    key = fields.get("api_key") or request.headers.get("x-api-key")
    name = settings.deepstack.collection
    if not name:
        raise DeepStackError(404, "the DeepStack API is off: set FACEREC_DEEPSTACK__COLLECTION")
    if not key:
        raise DeepStackError(401, "an api_key is required")
    found = await lookup_key(keys, key)
    if found is None or not found.can_access(name):
        raise DeepStackError(401 if found is None else 403, "incorrect api key")
    return name


async def _upload(request: Request, settings: SettingsDep, fields: tuple[str, ...] = ("image",)
                  ) -> Uploaded:
    most = min(len(fields), settings.limits.max_batch_images)
    return await read_images(request, fields, settings.limits.max_pixels, most, FormJson)


def _box(faces: Faces, i: int) -> dict[str, int]:
    x1, y1, x2, y2 = (max(0, round(float(v))) for v in faces.boxes[i])
    return {"x_min": x1, "y_min": y1, "x_max": x2, "y_max": y2}


def _min_confidence(fields: dict[str, Any]) -> float | None:
    raw = fields.get("min_confidence")
    try:
        value = None if raw in (None, "") else float(raw)
    except (TypeError, ValueError):
        value = -1.0
    if value is not None and not 0.0 <= value <= 1.0:
        raise DeepStackError(400, "min_confidence must be a number in [0, 1]")
    return value


def _ms(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 1)


@post_admitted("/face", response_model=Answer, response_model_exclude_none=True, openapi_extra=FORM,
             summary="DeepStack: detect faces (min_confidence: detection score)")
async def detect(request: Request, settings: SettingsDep, keys: KeysDep, service: ServiceDep) -> Answer:
    started = time.perf_counter()
    uploaded = await _upload(request, settings)
    await _collection(request, settings, keys, uploaded.fields)
    faces = await service.detect(uploaded.images[0], _min_confidence(uploaded.fields))
    return Answer(predictions=[Prediction(confidence=round(float(faces.scores[i]), 4), **_box(faces, i))
                               for i in range(len(faces))], duration=_ms(started))


@post_admitted("/face/recognize", response_model=Answer, response_model_exclude_none=True, openapi_extra=FORM,
             summary="DeepStack: who is each face ('unknown' below the threshold or min_confidence)")
async def recognize(request: Request, settings: SettingsDep, keys: KeysDep, service: ServiceDep) -> Answer:
    started = time.perf_counter()
    uploaded = await _upload(request, settings)
    name = await _collection(request, settings, keys, uploaded.fields)
    least = _min_confidence(uploaded.fields) or 0.0
    found = await service.identify(name, uploaded.images[0], 1, None)
    predictions = []
    for i, result in enumerate(found.results):
        match = result.match
        sure = 0.0 if match is None else confidence(match.score, found.threshold)
        named = match is not None and sure >= least
        predictions.append(Prediction(confidence=sure if named else 0.0,
                                      userid=match.external_id if named and match else "unknown",
                                      **_box(found.faces, i)))
    return Answer(predictions=predictions, duration=_ms(started))


@post_admitted("/face/register", response_model=Answer, response_model_exclude_none=True,
             openapi_extra=REGISTER, summary="DeepStack: add faces to userid (the largest of each image)")
async def register(request: Request, settings: SettingsDep, keys: KeysDep, service: ServiceDep) -> Answer:
    started = time.perf_counter()
    uploaded = await _upload(request, settings, IMAGE_FIELDS)
    name = await _collection(request, settings, keys, uploaded.fields)
    userid = str(uploaded.fields.get("userid") or "").strip()
    if not userid or "/" in userid or len(userid) > 256:
        raise DeepStackError(400, "userid not specified (or longer than 256 characters, or with a '/')")
    rules = EnrollmentRules(settings.quality.thresholds(), FaceChoice.LARGEST)
    enrolled = await service.enroll(name, userid, uploaded.images, rules, create=(userid, {}))
    new = len(await asyncio.to_thread(service.store.list_faces, name, userid)) == len(enrolled.faces)
    return Answer(message="face added" if new else "face updated", duration=_ms(started))


@router.post("/face/list", response_model=Answer, response_model_exclude_none=True, openapi_extra=FIELDS,
             summary="DeepStack: the registered userids")
async def list_faces(request: Request, settings: SettingsDep, keys: KeysDep, service: ServiceDep) -> Answer:
    started = time.perf_counter()
    fields = await _fields(request)
    name = await _collection(request, settings, keys, fields)

    def every() -> list[str]:
        names: list[str] = []
        while True:
            page, total = service.store.list_identities(name, len(names), 500)
            names += [i.external_id for i in page]
            if not page or len(names) >= total:
                return names

    return Answer(faces=await asyncio.to_thread(every), duration=_ms(started))


@router.post("/face/delete", response_model=Answer, response_model_exclude_none=True, openapi_extra=FIELDS,
             summary="DeepStack: erase a userid (success also when it was not registered)")
async def delete(request: Request, settings: SettingsDep, keys: KeysDep, service: ServiceDep) -> Answer:
    started = time.perf_counter()
    fields = await _fields(request)
    name = await _collection(request, settings, keys, fields)
    userid = str(fields.get("userid") or "")
    if not userid:
        raise DeepStackError(400, "userid not specified")
    with suppress(NotFound):  # as DeepStack: deleting a userid that is not registered succeeds
        await asyncio.to_thread(service.store.delete_identity, name, userid)
    await asyncio.to_thread(service.gallery.sync)
    return Answer(duration=_ms(started))


@post_admitted("/face/match", response_model=Answer, response_model_exclude_none=True,
             openapi_extra=image_body(FormJson, {"image1": False, "image2": False}),
             summary="DeepStack: similarity of the (largest) faces of image1 and image2")
async def match(request: Request, settings: SettingsDep, keys: KeysDep, service: ServiceDep) -> Answer:
    started = time.perf_counter()
    uploaded = await _upload(request, settings, ("image1", "image2"))
    await _collection(request, settings, keys, uploaded.fields)
    if len(uploaded.images) != 2:
        raise DeepStackError(400, "send image1 and image2")
    verified = await service.verify_images(uploaded.images[0], uploaded.images[1], None)
    return Answer(similarity=confidence(verified.score, verified.threshold), duration=_ms(started))

