"""Identities of a collection, their faces, and enrollment."""

from __future__ import annotations

import asyncio
import math
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Request, status
from pydantic import TypeAdapter, ValidationError

from recognition.enrollment import EnrollmentRules, FaceChoice
from service import schemas
from service.deps import (
    KEY_SECURITY,
    Admitted,
    AdmittedCollectionDep,
    CollectionAccessDep,
    GalleryDep,
    ServiceDep,
    StoreDep,
    TopKDep,
    known_query,
)
from service.errors import ApiError
from service.images import read_images
from service.openapi import image_body
from service.presenters import enroll_response, face_out, face_search_response, identity_out

router = APIRouter(prefix="/v1/collections/{collection}", tags=["identities"])

ENROLL_BODY = image_body(
    schemas.EnrollJson, {"images": True},
    {"face": {"type": "string", "enum": ["only", "largest"], "default": "only"},
     "box": {"type": "string", "description": "x1,y1,x2,y2 of the face to enroll",
             "example": "120,80,260,240"}},
    example={"images": ["<base64 JPEG>"], "face": "only"},
) | {"security": KEY_SECURITY}  # the route calls the key's schemes rather than solve them (service.deps)


@router.post("/identities", response_model=schemas.IdentityOut, status_code=status.HTTP_201_CREATED,
             summary="Create an identity")
async def create_identity(collection: str, body: schemas.IdentityCreate, _: CollectionAccessDep,
                          store: StoreDep) -> schemas.IdentityOut:
    info = await asyncio.to_thread(store.create_identity, collection, body.external_id, body.name,
                                   body.metadata)
    return identity_out(info)


@router.get("/identities", response_model=schemas.IdentityPage, summary="List identities (paginated)")
async def list_identities(
    collection: str, _: CollectionAccessDep, store: StoreDep,
    offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    name: Annotated[str | None, Query(max_length=256, description="case-insensitive substring")] = None,
) -> schemas.IdentityPage:
    items, total = await asyncio.to_thread(store.list_identities, collection, offset, limit, name)
    return schemas.IdentityPage(items=[identity_out(i) for i in items], total=total, offset=offset,
                                limit=limit)


@router.get("/identities/{external_id}", response_model=schemas.IdentityOut, summary="Get an identity")
async def get_identity(collection: str, external_id: str, _: CollectionAccessDep,
                       store: StoreDep) -> schemas.IdentityOut:
    return identity_out(await asyncio.to_thread(store.get_identity, collection, external_id))


@router.patch("/identities/{external_id}", response_model=schemas.IdentityOut, summary="Update name/metadata")
async def update_identity(collection: str, external_id: str, body: schemas.IdentityUpdate,
                          _: CollectionAccessDep, store: StoreDep) -> schemas.IdentityOut:
    info = await asyncio.to_thread(store.update_identity, collection, external_id, body.name, body.metadata)
    return identity_out(info)


@router.delete("/identities/{external_id}", status_code=status.HTTP_204_NO_CONTENT,
               summary="Erase an identity: its faces, vectors and crops are deleted")
async def delete_identity(collection: str, external_id: str, _: CollectionAccessDep, store: StoreDep,
                          gallery: GalleryDep) -> None:
    await asyncio.to_thread(store.delete_identity, collection, external_id)
    await asyncio.to_thread(gallery.sync)


#: The enrollment route's parameters; any other query parameter or form field is a 422.
ENROLL_QUERY = ("create", "name", "face", "box")
ENROLL_FORM = ("face", "box")
FaceQuery = Annotated[FaceChoice | None, Query(description="only (default): refuse an image with several "
                                                           "enrollable faces; largest: take the biggest")]
BoxQuery = Annotated[str | None, Query(description="x1,y1,x2,y2 of the face to enroll",
                                       examples=["120,80,260,240"])]


@router.post("/identities/{external_id}/faces", response_model=schemas.EnrollResponse,
             status_code=status.HTTP_201_CREATED, openapi_extra=ENROLL_BODY,
             dependencies=[Depends(known_query(*ENROLL_QUERY))],
             summary="Enroll one or several images (all or none)",
             description="Each image must show one face that can pass the quality gate, or pass "
                         "`face=largest` or a `box` (as query parameters or form/JSON fields). Faces "
                         "smaller than the gate's minimum size do not count as a second face; every face "
                         "not enrolled is listed in `ignored` with its reason. Faces that fail the quality "
                         "gate are refused with 422 `low_quality` and their reasons. With `create=true` the "
                         "identity is created when missing. Unknown parameters are refused with 422.")
async def enroll(collection: str, external_id: str, request: Request, call: AdmittedCollectionDep,
                 create: Annotated[bool, Query(description="create the identity when missing")] = False,
                 name: Annotated[str, Query(max_length=256, description="name when creating")] = "",
                 face: FaceQuery = None, box: BoxQuery = None,
                 ) -> schemas.EnrollResponse:
    with call.slot():
        return await _enroll(collection, external_id, request, call, create, name, face, box)


_EXTERNAL_ID: TypeAdapter[str] = TypeAdapter(schemas.ExternalId)


async def _enroll(collection: str, external_id: str, request: Request, call: Admitted, create: bool,
                  name: str, face: FaceChoice | None, box: str | None) -> schemas.EnrollResponse:
    service, settings = call.service, call.settings
    limits = settings.limits
    if create:  # the rules of POST .../identities: a new identity's id cannot escape them this way
        try:
            _EXTERNAL_ID.validate_python(external_id)
        except ValidationError as exc:
            raise ApiError("the external id of a new identity is not valid", code="validation_error",
                           status=422, errors=[{"loc": ["path", "external_id"], "msg": e["msg"]}
                                               for e in exc.errors()]) from exc
    uploaded = await read_images(request, ("images", "image"), limits.max_pixels, limits.max_batch_images,
                                 schemas.EnrollJson)
    unknown = sorted(set(uploaded.fields) - set(ENROLL_FORM))
    if unknown:
        raise ApiError(f"unknown form field(s): {', '.join(unknown)}", code="validation_error", status=422,
                       errors=[{"loc": ["body", n], "msg": "unknown field", "type": "extra_forbidden"}
                               for n in unknown])
    choice = face_choice(one_value("face", face, uploaded.fields.get("face")))
    rules = EnrollmentRules(settings.quality, choice,
                            parse_box(one_value("box", box, uploaded.fields.get("box"))))
    return enroll_response(await service.enroll(collection, external_id, uploaded.images, rules,
                                                (name, {}) if create else None))


def one_value(name: str, query: object, body: object) -> object:
    """A parameter given as a query parameter or a form/JSON field (both only when they agree)."""
    body = None if body in (None, "") else body
    if query is not None and body is not None and str(body) != str(query) and not (
            name == "box" and parse_box(query) == parse_box(body)):
        raise ApiError(f"{name} is given twice with different values (query {query!r}, body {body!r})",
                       code="validation_error", status=422)
    return query if query is not None else body


def face_choice(raw: object) -> FaceChoice:
    try:
        return FaceChoice.ONLY if raw is None else FaceChoice(str(raw))
    except ValueError as exc:
        raise ApiError("face must be 'only' or 'largest'", code="validation_error", status=422) from exc


def parse_box(raw: object) -> list[float] | None:
    if raw is None or raw == "":
        return None
    try:
        values = [float(v) for v in (raw.split(",") if isinstance(raw, str) else raw)]  # type: ignore[attr-defined]
    except (TypeError, ValueError) as exc:
        raise ApiError("box must be four numbers x1,y1,x2,y2", code="validation_error", status=422) from exc
    if len(values) != 4 or not all(math.isfinite(v) for v in values) or values[2] <= values[0] \
            or values[3] <= values[1]:  # NaN compares false: without isfinite it passed, and chose face 0
        raise ApiError("box must be four numbers x1,y1,x2,y2 with x2 > x1 and y2 > y1",
                       code="validation_error", status=422)
    return values


@router.get("/identities/{external_id}/faces", response_model=list[schemas.FaceOut],
            summary="List an identity's faces")
async def list_faces(collection: str, external_id: str, _: CollectionAccessDep,
                     store: StoreDep) -> list[schemas.FaceOut]:
    return [face_out(f) for f in await asyncio.to_thread(store.list_faces, collection, external_id)]


@router.delete("/faces/{face_id}", status_code=status.HTTP_204_NO_CONTENT, summary="Delete one face")
async def delete_face(collection: str, face_id: Annotated[int, Path(ge=1, le=2**63 - 1)],
                      _: CollectionAccessDep, store: StoreDep, gallery: GalleryDep) -> None:
    await asyncio.to_thread(store.delete_face, collection, face_id)
    await asyncio.to_thread(gallery.sync)


FaceId = Annotated[int, Path(ge=1, le=2**63 - 1)]
SearchThreshold = Annotated[float | None, Query(ge=-1, le=1, description="match threshold (default: the "
                                                                         "collection's)")]
ExcludeIdentity = Annotated[bool, Query(description="leave out every face of the searched face's identity")]


@router.post("/faces/{face_id}/search", response_model=schemas.FaceSearchResponse,
             dependencies=[Depends(known_query("k", "threshold", "exclude_identity"))],
             summary="Search by a stored face: the closest identities (look-alikes, duplicates)",
             description="Like identify, with an enrolled face instead of an uploaded image: the top-k "
                         "identities by their closest face, leaving out the searched face itself (with "
                         "`exclude_identity=true`, every face of its identity), and the usual decision at "
                         "the collection's threshold (`?threshold=` overrides it).")
async def search_face(collection: str, face_id: FaceId, _: CollectionAccessDep, service: ServiceDep,
                      k: TopKDep, threshold: SearchThreshold = None,
                      exclude_identity: ExcludeIdentity = False,
                      ) -> schemas.FaceSearchResponse:
    return face_search_response(await service.search_face(collection, face_id, k, threshold,
                                                          exclude_identity))
