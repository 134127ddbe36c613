"""CompreFace-compatible API under ``/api/v1/`` (recognition, detection, verification), for apps and the
official ``compreface-sdk``. Thin: every rule is the v1 API's use case (``recognition/``); the shapes and
errors are CompreFace's (``service/compreface.py``). A recognition key is a collection key; subjects are
identities (external id = subject), examples are faces (image_id = face id)."""

from __future__ import annotations

import asyncio
import functools
import math
import re
import time
from dataclasses import replace
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Query, Request, status
from pydantic import BaseModel

from gallery.errors import NotFound
from recognition.enrollment import EnrollmentRules
from service import compreface as cf
from service.admission import admit
from service.auth import Principal
from service.deps import ServiceDep, SettingsDep, StoreDep
from service.images import read_images
from service.openapi import image_body
from service.schemas import Base64Image, ExternalId

router = APIRouter(prefix="/api/v1", tags=["CompreFace compatible"], route_class=cf.CompreFaceRoute)
#: The routes that do recognition work: shed beyond the in-flight limit (service/admission.py).
post_admitted = functools.partial(router.post, dependencies=[Depends(admit)])

CallerDep = Annotated[Principal, Depends(cf.caller)]


async def _collection(caller: CallerDep) -> str:
    return cf.collection_of(caller)


CollectionDep = Annotated[str, Depends(_collection)]


class FileJson(BaseModel):
    file: Base64Image


class PairJson(BaseModel):
    source_image: Base64Image
    target_image: Base64Image


class SubjectJson(BaseModel):
    subject: ExternalId


FILE = image_body(FileJson, {"file": False}, example={"file": "<base64 JPEG>"})
PAIR = image_body(PairJson, {"source_image": False, "target_image": False})
Limit = Annotated[int, Query(ge=0, description="the biggest faces first, at most this many; 0: all")]
DetProb = Annotated[float | None, Query(ge=0, le=1, description="minimum detection score")]
Plugins = Annotated[str, Query(max_length=200, description="landmarks, calculator (others are not served)")]
Status = Annotated[bool, Query(description="add execution_time and plugins_versions")]
Subject = Annotated[str, Query(min_length=1, max_length=256)]


async def _image(request: Request, settings: SettingsDep) -> bytes:
    uploaded = await read_images(request, ("file",), settings.limits.max_pixels, 1, FileJson)
    return uploaded.images[0]


ImageDep = Annotated[bytes, Depends(_image)]


async def _versions(service: ServiceDep, on: bool) -> dict[str, str] | None:
    return {"detector": "retinaface", "calculator": (await service.embedder()).name} if on else None


def _no_face(count: int) -> None:
    if count == 0:
        raise cf.CompreFaceError(400, 28, "No face is found in the given image")


# --- recognition ----------------------------------------------------------------------------------

@post_admitted("/recognition/recognize", response_model=cf.CfResult, response_model_exclude_none=True,
             openapi_extra=FILE,
             summary="CompreFace: recognize every face (its nearest subjects, with their similarity)")
async def recognize(collection: CollectionDep, image: ImageDep, service: ServiceDep, settings: SettingsDep,
                    limit: Limit = 0, prediction_count: Annotated[int, Query(ge=1)] = 1,
                    det_prob_threshold: DetProb = None, face_plugins: Plugins = "", status: Status = False,
                    detect_faces: bool = True) -> cf.CfResult:
    if not detect_faces:
        raise cf.CompreFaceError(400, 36, "detect_faces=false (an already cropped face) is not supported")
    started = time.perf_counter()
    found = await service.identify(collection, image, min(prediction_count, settings.limits.max_k), None,
                                   det_prob_threshold)
    elapsed = (time.perf_counter() - started) * 1000 if status else None
    _no_face(len(found.faces))
    plugins = cf.plugin_set(face_plugins)
    result = []
    for i in cf.picked(found.faces, limit):
        face = cf.cf_face(found.faces, i, plugins, elapsed)
        # the nearest subjects whatever their similarity, as CompreFace answers: the client decides (a
        # stranger's best similarity is below the collection's confidence at its threshold: docs/compat.md)
        face.subjects = [cf.CfSubject(subject=c.external_id,
                                      similarity=cf.similarity(c.score, found.decision))
                         for c in found.results[i].candidates]
        result.append(face)
    return cf.CfResult(result=result, plugins_versions=await _versions(service, status))


@post_admitted("/recognition/faces", response_model=cf.CfExample, status_code=status.HTTP_201_CREATED,
             openapi_extra=FILE, summary="CompreFace: add an example of a subject (created if missing)")
async def add_example(collection: CollectionDep, image: ImageDep, service: ServiceDep, settings: SettingsDep,
                      subject: Annotated[str, Query(min_length=1, max_length=256, pattern=r"^[^/\s][^/]*$")],
                      det_prob_threshold: DetProb = None) -> cf.CfExample:
    if det_prob_threshold is not None and det_prob_threshold > settings.quality.min_detection_score:
        rules_quality = replace(settings.quality, min_detection_score=det_prob_threshold)
    else:
        rules_quality = settings.quality
    enrolled = await service.enroll(collection, subject, [image], EnrollmentRules(rules_quality),
                                    create=(subject, {}))
    return cf.CfExample(image_id=str(enrolled.faces[0].id), subject=subject)


@router.get("/recognition/faces", response_model=cf.CfExamplePage, summary="CompreFace: list examples")
async def list_examples(collection: CollectionDep, service: ServiceDep,
                        page: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
                        size: Annotated[int, Query(ge=1, le=500)] = 20,
                        subject: Annotated[str | None, Query(max_length=256)] = None) -> cf.CfExamplePage:
    rows, total = await asyncio.to_thread(service.faces.page, collection, subject or None, page * size, size)
    return cf.CfExamplePage(faces=[cf.CfExample(image_id=str(f.id), subject=s) for f, s in rows],
                            page_number=page, page_size=size, total_pages=math.ceil(total / size),
                            total_elements=total)


@router.delete("/recognition/faces", summary="CompreFace: delete all examples of a subject (or all)")
async def delete_examples(collection: CollectionDep, service: ServiceDep,
                          subject: Annotated[str | None, Query(max_length=256)] = None) -> dict[str, int]:
    deleted = await asyncio.to_thread(service.faces.delete_faces_of, collection, subject or None)
    await asyncio.to_thread(service.gallery.sync)
    return {"deleted": deleted}


async def _delete_example(service: ServiceDep, collection: str, image_id: int) -> cf.CfExample:
    stored = await asyncio.to_thread(service.faces.get, collection, image_id)
    await asyncio.to_thread(service.store.delete_face, collection, image_id)
    return cf.CfExample(image_id=str(image_id), subject=stored.external_id)


#: A face id as we hand it out: a positive 64-bit integer in ASCII digits (CompreFace's ids are UUIDs).
_FACE_ID = re.compile(r"[1-9][0-9]{0,18}")


def _image_id(image_id: str) -> int:
    """The face id ``image_id`` names; anything but an id as we write them (other digits such as "²" or
    "٣", leading zeros, beyond the database's 64-bit ids) is an unknown image, like an unknown number."""
    if _FACE_ID.fullmatch(image_id) is None or int(image_id) >= 2**63:
        raise cf.CompreFaceError(404, 44, f"Image {image_id[:64]} not found")
    return int(image_id)


async def _path_image_id(image_id: str) -> int:
    return _image_id(image_id)


ImageId = Annotated[int, Depends(_path_image_id)]


@router.delete("/recognition/faces/{image_id}", response_model=cf.CfExample,
               summary="CompreFace: delete an example by id")
async def delete_example(collection: CollectionDep, service: ServiceDep, image_id: ImageId) -> cf.CfExample:
    deleted = await _delete_example(service, collection, image_id)
    await asyncio.to_thread(service.gallery.sync)
    return deleted


@router.post("/recognition/faces/delete", response_model=list[cf.CfExample],
             summary="CompreFace: delete several examples (unknown ids are ignored)")
async def delete_several(collection: CollectionDep, service: ServiceDep,
                         ids: Annotated[list[str], Body(max_length=1000)]) -> list[cf.CfExample]:
    deleted = []
    for raw in ids:
        try:
            deleted.append(await _delete_example(service, collection, _image_id(raw)))
        except (cf.CompreFaceError, NotFound):
            continue
    await asyncio.to_thread(service.gallery.sync)
    return deleted


@post_admitted("/recognition/faces/{image_id}/verify", response_model=cf.CfResult,
             response_model_exclude_none=True, openapi_extra=FILE,
             summary="CompreFace: every face of the image against one example")
async def verify_example(collection: CollectionDep, image_id: ImageId, image: ImageDep, service: ServiceDep,
                         limit: Limit = 0, det_prob_threshold: DetProb = None, face_plugins: Plugins = "",
                         status: Status = False) -> cf.CfResult:
    started = time.perf_counter()
    compared = await service.compare_with_face(collection, image_id, image, None, det_prob_threshold)
    elapsed = (time.perf_counter() - started) * 1000 if status else None
    _no_face(len(compared.faces))
    return cf.CfResult(result=_matches(compared, limit, cf.plugin_set(face_plugins), elapsed),
                       plugins_versions=await _versions(service, status))


def _matches(compared: Any, limit: int, plugins: set[str], elapsed: float | None) -> list[cf.CfFace]:
    out = []
    for i in cf.picked(compared.faces, limit):
        face = cf.cf_face(compared.faces, i, plugins, elapsed)
        face.similarity = cf.similarity(float(compared.scores[i]), compared.decision)
        out.append(face)
    return out


# --- subjects -------------------------------------------------------------------------------------

@router.post("/recognition/subjects", status_code=status.HTTP_201_CREATED,
             summary="CompreFace: add a subject (an identity without faces)")
async def add_subject(collection: CollectionDep, body: SubjectJson, store: StoreDep) -> dict[str, str]:
    await asyncio.to_thread(store.create_identity, collection, body.subject, body.subject)
    return {"subject": body.subject}


@router.get("/recognition/subjects", summary="CompreFace: list subjects")
async def list_subjects(collection: CollectionDep, store: StoreDep) -> dict[str, list[str]]:
    return {"subjects": await asyncio.to_thread(store.external_ids, collection)}


@router.put("/recognition/subjects/{subject}",
            summary="CompreFace: rename a subject (merged into an existing one)")
async def rename_subject(collection: CollectionDep, subject: str, body: SubjectJson,
                         service: ServiceDep) -> dict[str, bool]:
    if body.subject == subject:
        return {"updated": False}
    await asyncio.to_thread(service.faces.rename, collection, subject, body.subject)
    await asyncio.to_thread(service.gallery.sync)
    return {"updated": True}


@router.delete("/recognition/subjects/{subject}", summary="CompreFace: delete a subject and its examples")
async def delete_subject(collection: CollectionDep, subject: str, service: ServiceDep) -> dict[str, str]:
    await asyncio.to_thread(service.store.delete_identity, collection, subject)
    await asyncio.to_thread(service.gallery.sync)
    return {"subject": subject}


@router.delete("/recognition/subjects", summary="CompreFace: delete every subject")
async def delete_subjects(collection: CollectionDep, service: ServiceDep) -> dict[str, int]:
    deleted = await asyncio.to_thread(service.faces.delete_identities, collection)
    await asyncio.to_thread(service.gallery.sync)
    return {"deleted": deleted}


# --- detection and verification (any key) ---------------------------------------------------------

@post_admitted("/detection/detect", response_model=cf.CfResult, response_model_exclude_none=True,
             openapi_extra=FILE, summary="CompreFace: detect faces")
async def detect(_: CallerDep, image: ImageDep, service: ServiceDep, limit: Limit = 0,
                 det_prob_threshold: DetProb = None, face_plugins: Plugins = "",
                 status: Status = False) -> cf.CfResult:
    started = time.perf_counter()
    faces = await service.detect(image, det_prob_threshold)
    elapsed = (time.perf_counter() - started) * 1000 if status else None
    _no_face(len(faces))
    plugins = cf.plugin_set(face_plugins)
    return cf.CfResult(result=[cf.cf_face(faces, i, plugins, elapsed) for i in cf.picked(faces, limit)],
                       plugins_versions=await _versions(service, status))


@post_admitted("/verification/verify", response_model=cf.CfVerification, response_model_exclude_none=True,
             openapi_extra=PAIR, summary="CompreFace: the faces of target_image against the source face")
async def verify(_: CallerDep, request: Request, service: ServiceDep, settings: SettingsDep, limit: Limit = 0,
                 det_prob_threshold: DetProb = None, face_plugins: Plugins = "",
                 status: Status = False) -> cf.CfVerification:
    uploaded = await read_images(request, ("source_image", "target_image"), settings.limits.max_pixels, 2,
                                 PairJson)
    pair = uploaded.pair("source_image", "target_image")
    if pair is None:
        raise cf.CompreFaceError(400, 34, "Required parts source_image and target_image, one image each")
    started = time.perf_counter()
    source_image, target_image = pair
    compared = await service.compare_images(source_image, target_image, None, det_prob_threshold)
    elapsed = (time.perf_counter() - started) * 1000 if status else None
    _no_face(len(compared.faces))
    plugins = cf.plugin_set(face_plugins)
    source = cf.cf_face(*compared.reference, plugins, elapsed) if compared.reference else None
    assert source is not None  # compare_images always sets its reference
    return cf.CfVerification(result=[cf.CfMatch(source_image_face=source,
                                                face_matches=_matches(compared, limit, plugins, elapsed),
                                                plugins_versions=await _versions(service, status))])

