"""The batch import through a deployed stack's REST API
(``python -m recognition import --api URL --key KEY``):
a ``Backend`` for ``recognition.importer.Importer`` that needs only the API and a key, not Triton's gRPC
port nor the database.

Each image is analysed with ``POST /v1/detect`` and classified by the same enrollment rules as the local
import (so the report has the same statuses); an identity's accepted images are then enrolled with
``POST .../identities/{id}/faces?create=true``, all or nothing per call. The API does not publish its
limits, so the settings' ``limits`` (FACEREC_LIMITS__*, the gateway's defaults) size the calls: at most
``max_batch_images`` images and ``max_upload_bytes`` of body each. An identity that needs several calls
can end partly enrolled (the files of the calls made before a failure are reported ``imported``, the
rest ``failed``; a rerun resumes). A file whose upload alone is over ``max_upload_bytes`` is reported
``unreadable`` without being sent. Resume: the sha256 of every face already in the collection is read
from the API first. The server applies its own quality gate.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import quote

import httpx
import numpy as np

from facecore.contract import Faces
from recognition.importer import ImportOptions, ItemResult, PartlyEnrolled, Unreadable

#: Responses that mean "this image cannot be read" (the local import's ``unreadable``).
_UNREADABLE = {"invalid_image", "unsupported_media_type", "too_many_pixels", "payload_too_large"}
_MEDIA = {".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".png": "image/png", ".webp": "image/webp",
          ".bmp": "image/bmp"}
#: What multipart adds to a body, per part (boundary, headers with the file name) and in all.
_PART_OVERHEAD = 512
_BODY_OVERHEAD = 1024


class ApiFailure(Exception):
    """The API answered with an error that is not about one image (key, collection, server)."""


def _code(response: httpx.Response) -> tuple[str, str]:
    """The error body's code and message (the API's one error model)."""
    try:
        body = response.json()
        return str(body.get("code", "")), str(body.get("message", ""))
    except ValueError:
        return "", response.text[:200]


def _error(response: httpx.Response) -> ApiFailure:
    code, message = _code(response)
    return ApiFailure(f"{response.status_code} {code}: {message}")


def faces_from_detect(body: dict[str, Any]) -> Faces:
    """``/v1/detect``'s answer as ``Faces`` for the enrollment rules (no embeddings, no crops)."""
    found = body["faces"]
    return Faces(
        boxes=np.array([[f["box"][k] for k in ("x1", "y1", "x2", "y2")] for f in found],
                       np.float32).reshape(-1, 4),
        scores=np.array([f["score"] for f in found], np.float32),
        landmarks=np.array([[[p["x"], p["y"]] for p in f["landmarks"]] for f in found],
                           np.float32).reshape(-1, 5, 2),
        embeddings=np.zeros((len(found), 1), np.float32),
        blur=np.array([f["quality"]["blur"] for f in found], np.float32),
        crops=np.zeros((0, 112, 112, 3), np.uint8), width=int(body["width"]), height=int(body["height"]))


def upload_size(data: bytes) -> int:
    """What one image adds to a multipart body (an upper bound)."""
    return len(data) + _PART_OVERHEAD


def batches(accepted: list[ItemResult], max_images: int, max_bytes: int) -> list[list[ItemResult]]:
    """``accepted`` in order, cut into calls of at most ``max_images`` images and ``max_bytes`` of body."""
    calls: list[list[ItemResult]] = []
    size = 0
    for result in accepted:
        part = upload_size(result.data)
        if not calls or len(calls[-1]) >= max_images or size + part > max_bytes:
            calls.append([])
            size = _BODY_OVERHEAD
        calls[-1].append(result)
        size += part
    return calls


class RestBackend:
    uploads_images = True

    def __init__(self, base_url: str, key: str, options: ImportOptions, timeout_s: float = 60.0) -> None:
        self.options, self.batch = options, options.limits.max_batch_images
        self.max_bytes = options.limits.max_upload_bytes
        self.client = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers={"X-API-Key": key},
                                        timeout=timeout_s)
        self.path = f"/v1/collections/{quote(options.collection, safe='')}"

    async def close(self) -> None:
        await self.client.aclose()

    async def ensure_collection(self, create: bool) -> dict[str, Any]:
        """The collection (created first with ``create``: that needs the admin key)."""
        response = await self.client.get(self.path)
        if response.status_code == 404 and create:
            response = await self.client.post("/v1/collections", json={"name": self.options.collection})
        if response.status_code >= 300:
            raise _error(response)
        info: dict[str, Any] = response.json()
        return info

    async def known_hashes(self) -> set[str]:
        identities: list[str] = []
        while True:
            response = await self.client.get(f"{self.path}/identities",
                                             params={"offset": len(identities), "limit": 500})
            if response.status_code >= 300:
                raise _error(response)
            page = response.json()
            identities += [i["external_id"] for i in page["items"]]
            if not page["items"] or len(identities) >= page["total"]:
                break
        slots = asyncio.Semaphore(self.options.concurrency)

        async def hashes(external_id: str) -> list[str]:
            async with slots:
                response = await self.client.get(
                    f"{self.path}/identities/{quote(external_id, safe='')}/faces")
            if response.status_code >= 300:
                raise _error(response)
            return [face["image_sha256"] for face in response.json()]

        return {h for found in await asyncio.gather(*(hashes(i) for i in identities)) for h in found}

    async def analyze(self, data: bytes) -> Faces:
        if upload_size(data) + _BODY_OVERHEAD > self.max_bytes:
            raise Unreadable(f"file too large: {len(data)} bytes, over the upload limit of {self.max_bytes} "
                             "bytes (FACEREC_LIMITS__MAX_UPLOAD_BYTES)")
        response = await self.client.post("/v1/detect", files={"image": ("image", data)})
        if response.status_code < 300:
            return faces_from_detect(response.json())
        code, message = _code(response)
        if code in _UNREADABLE:
            raise Unreadable(message)
        raise _error(response)

    async def enroll(self, accepted: list[ItemResult]) -> list[int]:
        item = accepted[0].item
        url = f"{self.path}/identities/{quote(item.external_id, safe='')}/faces"
        params = {"create": "true", "name": item.name,
                  "face": "largest" if self.options.largest_face else "only"}
        ids: list[int] = []
        for call in batches(accepted, self.batch, self.max_bytes):
            files = [("images", (_filename(r), r.data, _MEDIA.get(r.item.path.suffix.lower(),
                                                                  "application/octet-stream")))
                     for r in call]
            try:
                response = await self.client.post(url, params=params, files=files)
                if response.status_code >= 300:
                    raise _error(response)
            except Exception as exc:
                if ids:
                    raise PartlyEnrolled(ids, exc) from exc
                raise
            ids += [face["id"] for face in response.json()["faces"]]
        return ids


def _filename(result: ItemResult) -> str:
    """The part's file name (a name that is not valid UTF-8 is sent escaped)."""
    return result.item.path.name.encode("utf-8", "backslashreplace").decode("utf-8")
