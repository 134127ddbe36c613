"""DeepStack-compatible face API under ``/v1/vision/`` (the API CodeProject.AI kept, and the one Home
Assistant's DeepStack face integration speaks through ``deepstack-python``), on ONE collection: the
``FACEREC_DEEPSTACK__COLLECTION`` setting. Thin over the same use cases as the v1 API; answers are
``{"success": true, ...}`` and errors ``{"success": false, "error", "code"}`` with that HTTP status.

``api_key`` (a form field, as DeepStack takes it; the ``X-API-Key`` header works too) must be a key of that
collection or the admin key; a call with no key at all is let through only where the operator chose it
(``FACEREC_DEEPSTACK__KEYLESS``). Register and match take their images from any file fields, as DeepStack
does. ``userid`` is the identity's external id. ``confidence`` is our confidence (1 - FPIR at the score);
a face is named only when it reaches the collection's threshold AND ``min_confidence``, otherwise it is
``"unknown"`` with confidence 0 (docs/compat.md).

A call is checked cheapest first, so that a caller without a key costs little: the API off is a 404 before
the body is read; the key is checked before any image is vetted; only then does the call take one of the
gateway's in-flight slots (shared with the v1 and CompreFace APIs).
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from contextlib import AbstractContextManager, suppress
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model
from starlette.datastructures import UploadFile

from facecore.contract import Faces
from gallery.errors import NotFound
from recognition.enrollment import EnrollmentRules, FaceChoice
from service.admission import Admission
from service.compat import describe, rendering_route
from service.deps import KeysDep, ServiceDep, SettingsDep, lookup_key
from service.errors import ApiError, retry_after
from service.images import MAX_FORM_FIELDS, Uploaded, check_image, read_images
from service.openapi import image_body
from service.schemas import Base64Image

#: Image fields of a JSON register call (DeepStack takes several images per registration); at most
#: ``limits.max_batch_images`` of them per call. A form may name its files anything (DeepStack registers
#: every file of the form, and matches any two): clients name them ``image<uuid>``.
IMAGE_FIELDS = ("image", *(f"image{i}" for i in range(1, 17)))
PAIR_FIELDS = ("image1", "image2")
#: The text fields of register and match forms: every other file is an image.
REGISTER_TEXTS = ("api_key", "userid", "min_confidence")
MATCH_TEXTS = ("api_key",)


class DeepStackError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def _where(exc: Exception) -> str:
    """``: field: why`` for the first field of a validation error from ``read_images`` (else empty)."""
    errors = exc.details.get("errors") if isinstance(exc, ApiError) else None
    if not errors:
        return ""
    return f": {'.'.join(str(p) for p in errors[0].get('loc', ()))}: {errors[0].get('msg', 'not valid')}"


def _render(exc: Exception) -> JSONResponse | None:
    found = (exc.status, "", exc.message) if isinstance(exc, DeepStackError) else describe(exc)
    if found is None:
        return None
    status, code, message = found
    text = f"{message}{_where(exc)} ({code})" if code else message
    headers = {"Retry-After": retry_after(exc)} if status == 503 else None
    body = {"success": False, "error": text, "code": status}
    return JSONResponse(body, status_code=status, headers=headers)


async def _enabled(settings: SettingsDep) -> None:
    """While the API is off, every call is its 404, before anything of the request is read."""
    if not settings.deepstack.collection:
        raise DeepStackError(404, "the DeepStack API is off: set FACEREC_DEEPSTACK__COLLECTION")


router = APIRouter(prefix="/v1/vision", tags=["DeepStack compatible"], route_class=rendering_route(_render),
                   dependencies=[Depends(_enabled)])


class KeyJson(BaseModel):
    """A JSON body (DeepStack clients send forms; JSON with base64 images works as on the v1 API): a field
    the route does not take is refused (422), not ignored."""

    model_config = ConfigDict(extra="forbid")

    api_key: str | None = None


class UseridJson(KeyJson):
    userid: str | None = None


class ImageJson(KeyJson):
    image: Base64Image | None = None
    min_confidence: float | None = None


class PairJson(KeyJson):
    image1: Base64Image | None = None
    image2: Base64Image | None = None


#: Every image field, and min_confidence: deepstack-python sends it with every image, register included
#: (where it means nothing).
_REGISTER: dict[str, Any] = {"min_confidence": (float | None, None),
                             **{name: (Base64Image | None, None) for name in IMAGE_FIELDS}}
RegisterJson = create_model("RegisterJson", __base__=UseridJson, **_REGISTER)


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


_KEY = {"api_key": {"type": "string"}}
FORM = image_body(ImageJson, {"image": False}, {**_KEY, "min_confidence": {"type": "number"}})
REGISTER = image_body(RegisterJson, dict.fromkeys(IMAGE_FIELDS[:2], False),  # any one image field will do
                      {**_KEY, "userid": {"type": "string"}}, required=())
PAIR = image_body(PairJson, dict.fromkeys(PAIR_FIELDS, False), _KEY)
LIST = image_body(KeyJson, {}, _KEY)
DELETE = image_body(UseridJson, {}, {**_KEY, "userid": {"type": "string"}})


def _texts(fields: dict[str, Any], images: tuple[str, ...] = ()) -> dict[str, Any]:
    """The fields besides the images, which DeepStack takes as text: a file in one of them is a 400."""
    for name, value in fields.items():
        if isinstance(value, UploadFile):
            listed = ", ".join(images) if len(images) < 4 else f"{images[0]}, {images[1]} ... {images[-1]}"
            where = f" (images go in {listed})" if images else ""
            raise DeepStackError(400, f"{name} must be a text field, not a file{where}")
    return fields


async def _fields(request: Request, model: type[KeyJson]) -> dict[str, Any]:
    """The fields of a call without images: a form (multipart or url-encoded, as clients send them) or a
    JSON object of ``model``."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind == "application/json":
        try:
            return model.model_validate_json(await request.body()).model_dump(exclude_none=True)
        except ValidationError as exc:  # the errors read_images gives for a JSON body
            if any(e["type"] == "json_invalid" for e in exc.errors()):
                raise ApiError("the body is not valid JSON", code="invalid_json") from exc
            details = [{"loc": list(e["loc"]), "msg": e["msg"]} for e in exc.errors()]
            raise ApiError("the request is not valid", code="validation_error", status=422,
                           errors=details) from exc
    if kind in ("multipart/form-data", "application/x-www-form-urlencoded"):
        form = await request.form(max_files=len(IMAGE_FIELDS) + 1, max_fields=MAX_FORM_FIELDS)
        return _texts(dict(form.items()))
    return {}


async def _collection(request: Request, settings: SettingsDep, keys: KeysDep, fields: dict[str, Any]) -> str:
    """The configured collection, when the caller's api_key (form field or X-API-Key) may use it, or when
    it sends none and the keyless setting lets it (``FACEREC_DEEPSTACK__KEYLESS``)."""
    key = fields.get("api_key") or request.headers.get("x-api-key")
    name = settings.deepstack.collection
    if not key:
        if _keyless(settings.deepstack.keyless, request):
            return name
        raise DeepStackError(401, "an api_key is required")
    found = await lookup_key(keys, key)
    if found is None or not found.can_access(name):
        raise DeepStackError(401 if found is None else 403, "incorrect api key")
    return name


async def _upload(request: Request, settings: SettingsDep, keys: KeysDep, model: type[KeyJson],
                  fields: tuple[str, ...] = ("image",), texts: tuple[str, ...] | None = None
                  ) -> tuple[str, Uploaded]:
    """The collection and the images of a call, in the order that costs a caller without a key least: the
    body is read, the key checked, and only then is each image vetted (its header parsed). With ``texts``
    every file of a form but those fields is an image."""
    limits = settings.limits
    most = min(len(fields), limits.max_batch_images)
    uploaded = await read_images(request, fields, limits.max_pixels, most, model, check=False, texts=texts)
    name = await _collection(request, settings, keys, _texts(uploaded.fields, fields))
    for data, source in zip(uploaded.images, uploaded.sources, strict=True):
        check_image(data, limits.max_pixels, source)
    return name, uploaded


def _keyless(setting: str, request: Request) -> bool:
    """Whether a call without a key may act on the collection: the operator's explicit choice."""
    if setting == "network":
        return True
    if setting != "loopback" or request.client is None:
        return False
    try:  # the peer's address as the gateway sees it: behind a proxy on this host, every call is loopback
        return ipaddress.ip_address(request.client.host).is_loopback
    except ValueError:
        return False


def _slot(request: Request) -> AbstractContextManager[None]:
    """One of the gateway's in-flight recognition requests (shared with the v1 and CompreFace APIs), taken
    once the key and the images passed: 503 ``overloaded`` beyond the limit (service/admission.py)."""
    admission: Admission = request.app.state.admission
    return admission.slot()


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


def _two(uploaded: Uploaded) -> tuple[bytes, bytes] | None:
    """The two images of a match: image1 then image2 when so named, else any two file fields in their
    order; two files in one field are not a pair (DeepStack keys a form's files by field)."""
    named = dict(zip(uploaded.sources, uploaded.images, strict=True))
    if len(uploaded.images) != 2 or len(named) != 2:
        return None
    if set(named) == set(PAIR_FIELDS):
        return named["image1"], named["image2"]
    return uploaded.images[0], uploaded.images[1]


def _ms(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 1)


@router.post("/face", response_model=Answer, response_model_exclude_none=True, openapi_extra=FORM,
             summary="DeepStack: detect faces (min_confidence: detection score)")
async def detect(request: Request, settings: SettingsDep, keys: KeysDep, service: ServiceDep) -> Answer:
    started = time.perf_counter()
    _, uploaded = await _upload(request, settings, keys, ImageJson)
    least = _min_confidence(uploaded.fields)
    with _slot(request):
        faces = await service.detect(uploaded.images[0], least)
    return Answer(predictions=[Prediction(confidence=round(float(faces.scores[i]), 4), **_box(faces, i))
                               for i in range(len(faces))], duration=_ms(started))


@router.post("/face/recognize", response_model=Answer, response_model_exclude_none=True, openapi_extra=FORM,
             summary="DeepStack: who is each face ('unknown' below the threshold or min_confidence)")
async def recognize(request: Request, settings: SettingsDep, keys: KeysDep, service: ServiceDep) -> Answer:
    started = time.perf_counter()
    name, uploaded = await _upload(request, settings, keys, ImageJson)
    least = _min_confidence(uploaded.fields) or 0.0
    with _slot(request):
        found = await service.identify(name, uploaded.images[0], 1, None)
    predictions = []
    for i, result in enumerate(found.results):
        match = result.match
        sure = 0.0 if match is None else round(found.decision.confidence(match.score), 4)
        named = match is not None and sure >= least
        predictions.append(Prediction(confidence=sure if named else 0.0,
                                      userid=match.external_id if named and match else "unknown",
                                      **_box(found.faces, i)))
    return Answer(predictions=predictions, duration=_ms(started))


@router.post("/face/register", response_model=Answer, response_model_exclude_none=True,
             openapi_extra=REGISTER, summary="DeepStack: add faces to userid (the largest of each image)")
async def register(request: Request, settings: SettingsDep, keys: KeysDep, service: ServiceDep) -> Answer:
    started = time.perf_counter()
    name, uploaded = await _upload(request, settings, keys, RegisterJson, IMAGE_FIELDS, REGISTER_TEXTS)
    userid = str(uploaded.fields.get("userid") or "").strip()
    if not userid or "/" in userid or len(userid) > 256:
        raise DeepStackError(400, "userid not specified (or longer than 256 characters, or with a '/')")
    rules = EnrollmentRules(settings.quality, FaceChoice.LARGEST)
    with _slot(request):
        enrolled = await service.enroll(name, userid, uploaded.images, rules, create=(userid, {}))
    new = len(await asyncio.to_thread(service.store.list_faces, name, userid)) == len(enrolled.faces)
    return Answer(message="face added" if new else "face updated", duration=_ms(started))


@router.post("/face/list", response_model=Answer, response_model_exclude_none=True, openapi_extra=LIST,
             summary="DeepStack: the registered userids")
async def list_faces(request: Request, settings: SettingsDep, keys: KeysDep, service: ServiceDep) -> Answer:
    started = time.perf_counter()
    fields = await _fields(request, KeyJson)
    name = await _collection(request, settings, keys, fields)
    return Answer(faces=await asyncio.to_thread(service.store.external_ids, name), duration=_ms(started))


@router.post("/face/delete", response_model=Answer, response_model_exclude_none=True, openapi_extra=DELETE,
             summary="DeepStack: erase a userid (success also when it was not registered)")
async def delete(request: Request, settings: SettingsDep, keys: KeysDep, service: ServiceDep) -> Answer:
    started = time.perf_counter()
    fields = await _fields(request, UseridJson)
    name = await _collection(request, settings, keys, fields)
    userid = str(fields.get("userid") or "")
    if not userid:
        raise DeepStackError(400, "userid not specified")
    with suppress(NotFound):  # as DeepStack: deleting a userid that is not registered succeeds
        await asyncio.to_thread(service.store.delete_identity, name, userid)
    await asyncio.to_thread(service.gallery.sync)
    return Answer(duration=_ms(started))


@router.post("/face/match", response_model=Answer, response_model_exclude_none=True, openapi_extra=PAIR,
             summary="DeepStack: similarity of the (largest) faces of image1 and image2")
async def match(request: Request, settings: SettingsDep, keys: KeysDep, service: ServiceDep) -> Answer:
    started = time.perf_counter()
    _, uploaded = await _upload(request, settings, keys, PairJson, PAIR_FIELDS, MATCH_TEXTS)
    pair = _two(uploaded)
    if pair is None:
        raise DeepStackError(400, "send two images (image1 and image2, or any two file fields)")
    with _slot(request):
        verified = await service.verify_images(*pair, None)
    return Answer(similarity=round(verified.decision.confidence(verified.score), 4), duration=_ms(started))

