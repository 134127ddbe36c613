"""Identities of a collection, their faces, and enrollment."""

from __future__ import annotations

import asyncio
import math
from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, status

from recognition.enrollment import EnrollmentRules, FaceChoice
from service import schemas
from service.admission import AdmitDep
from service.deps import CollectionAccessDep, GalleryDep, ServiceDep, SettingsDep, StoreDep
from service.errors import ApiError
from service.images import read_images
from service.openapi import image_body
from service.presenters import enroll_response, face_out, identity_out

router = APIRouter(prefix="/v1/collections/{collection}", tags=["identities"])

ENROLL_BODY = image_body(
    schemas.EnrollJson, {"images": True},
    {"face": {"type": "string", "enum": ["only", "largest"], "default": "only"},
     "box": {"type": "string", "description": "x1,y1,x2,y2 of the face to enroll",
             "example": "120,80,260,240"}},
    example={"images": ["<base64 JPEG>"], "face": "only"},
)


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


@router.post("/identities/{external_id}/faces", response_model=schemas.EnrollResponse,
             status_code=status.HTTP_201_CREATED, openapi_extra=ENROLL_BODY,
             summary="Enroll one or several images (all or none)",
             description="Each image must show one face, or pass `face=largest` or a `box`. Faces that "
                         "fail the quality gate are refused with 422 `low_quality` and their reasons. With "
                         "`create=true` the identity is created when missing.")
async def enroll(collection: str, external_id: str, request: Request, _: CollectionAccessDep,
                 __: AdmitDep, service: ServiceDep, settings: SettingsDep,
                 create: Annotated[bool, Query(description="create the identity when missing")] = False,
                 name: Annotated[str, Query(max_length=256, description="name when creating")] = "",
                 ) -> schemas.EnrollResponse:
    limits = settings.limits
    uploaded = await read_images(request, ("images", "image"), limits.max_pixels, limits.max_batch_images,
                                 schemas.EnrollJson)
    choice_raw = uploaded.fields.get("face", "only")
    try:
        choice = FaceChoice(choice_raw)
    except ValueError as exc:
        raise ApiError("face must be 'only' or 'largest'", code="validation_error", status=422) from exc
    rules = EnrollmentRules(settings.quality.thresholds(), choice, parse_box(uploaded.fields.get("box")))
    return enroll_response(await service.enroll(collection, external_id, uploaded.images, rules,
                                                (name, {}) if create else None))


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
