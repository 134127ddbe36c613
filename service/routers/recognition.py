"""Detect, identify (1:N, single and batch) and verify (1:1)."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Query, Request

from facecore.client import PipelineError
from recognition.errors import Refused
from service import schemas
from service.deps import KEY_SECURITY, Admitted, AdmittedCollectionDep, AdmittedDep, TopK, within_max_k
from service.errors import ApiError, error_body
from service.images import check_image, read_images
from service.openapi import image_body
from service.presenters import detect_response, identify_response, verify_response

router = APIRouter(tags=["recognition"])

# The body of each route, and its security (the routes call the key's schemes rather than solve them).
ONE_IMAGE = image_body(schemas.ImageJson, {"image": False}, example={"image": "<base64 JPEG>"}) | {
    "security": KEY_SECURITY}
BATCH = image_body(schemas.BatchJson, {"images": True}, example={"images": ["<base64 JPEG>", "<base64 PNG>"]}
                   ) | {"security": KEY_SECURITY}
PAIR = image_body(schemas.VerifyJson, {"image_a": False, "image_b": False},
                  example={"image_a": "<base64 JPEG>", "image_b": "<base64 JPEG>"}
                  ) | {"security": KEY_SECURITY}
Threshold = Annotated[float | None, Query(ge=-1, le=1,
                                          description="match threshold (default: the collection's "
                                                      "or the model's)")]


async def one_image(request: Request, call: Admitted) -> bytes:
    """The ``image`` of a multipart or JSON body (checked)."""
    uploaded = await read_images(request, ("image",), call.settings.limits.max_pixels, 1, schemas.ImageJson)
    return uploaded.images[0]


@router.post("/v1/detect", response_model=schemas.DetectResponse, openapi_extra=ONE_IMAGE,
             summary="Every face with box, score, landmarks and quality measures")
async def detect(request: Request, call: AdmittedDep) -> schemas.DetectResponse:
    with call.slot():
        return detect_response(await call.service.detect(await one_image(request, call)))


@router.post("/v1/collections/{collection}/identify", response_model=schemas.IdentifyResponse,
             openapi_extra=ONE_IMAGE, summary="1:N: who is each face in the image (or unknown)")
async def identify(collection: str, request: Request, call: AdmittedCollectionDep,
                   threshold: Threshold = None, k: TopK = 5) -> schemas.IdentifyResponse:
    within_max_k(k, call.settings)
    with call.slot():
        image = await one_image(request, call)
        return identify_response(await call.service.identify(collection, image, k, threshold))


@router.post("/v1/collections/{collection}/identify/batch", response_model=schemas.BatchIdentifyResponse,
             openapi_extra=BATCH, summary="1:N for several images; each image succeeds or fails alone")
async def identify_batch(collection: str, request: Request, call: AdmittedCollectionDep,
                         threshold: Threshold = None, k: TopK = 5) -> schemas.BatchIdentifyResponse:
    within_max_k(k, call.settings)
    with call.slot():
        return await _identify_batch(collection, request, call, k, threshold)


async def _identify_batch(collection: str, request: Request, call: Admitted, k: int, threshold: float | None
                          ) -> schemas.BatchIdentifyResponse:
    limits, service = call.settings.limits, call.service
    uploaded = await read_images_lenient(request, limits.max_pixels, limits.max_batch_images)

    async def one(index: int, data: bytes | ApiError) -> schemas.BatchItem:
        try:
            if isinstance(data, ApiError):
                raise data
            result = identify_response(await service.identify(collection, data, k, threshold))
            return schemas.BatchItem(index=index, result=result)
        except (ApiError, Refused) as exc:
            return schemas.BatchItem(index=index, error=error_body(exc.code, exc.message, exc.details))
        except PipelineError as exc:
            if not exc.invalid_input:
                raise
            return schemas.BatchItem(index=index, error=error_body("invalid_image", str(exc)))

    return schemas.BatchIdentifyResponse(results=list(await asyncio.gather(*(one(i, d) for i, d in
                                                                              enumerate(uploaded)))))


async def read_images_lenient(request: Request, max_pixels: int, max_images: int) -> list[bytes | ApiError]:
    """Batch images where a bad one becomes its own error instead of failing the request."""
    uploaded = await read_images(request, ("images",), max_pixels, max_images, schemas.BatchJson, check=False)
    checked: list[bytes | ApiError] = []
    for index, data in enumerate(uploaded.images):
        try:
            checked.append(check_image(data, max_pixels, f"images[{index}]"))
        except ApiError as exc:
            checked.append(exc)
    return checked


@router.post("/v1/verify", response_model=schemas.VerifyResponse, openapi_extra=PAIR,
             summary="1:1: are the (largest) faces of two images the same person")
async def verify(request: Request, call: AdmittedDep, threshold: Threshold = None) -> schemas.VerifyResponse:
    with call.slot():
        uploaded = await read_images(request, ("image_a", "image_b"), call.settings.limits.max_pixels, 2,
                                     schemas.VerifyJson)
        pair = uploaded.pair("image_a", "image_b")
        if pair is None:
            raise ApiError("send exactly two images: image_a and image_b", code="missing_image")
        return verify_response(await call.service.verify_images(*pair, threshold))


@router.post("/v1/collections/{collection}/identities/{external_id}/verify",
             response_model=schemas.VerifyResponse, openapi_extra=ONE_IMAGE,
             summary="1:1: is the (largest) face of the image this identity")
async def verify_identity(collection: str, external_id: str, request: Request, call: AdmittedCollectionDep,
                          threshold: Threshold = None) -> schemas.VerifyResponse:
    with call.slot():
        image = await one_image(request, call)
        return verify_response(await call.service.verify_identity(collection, external_id, image, threshold))
