"""Images at the edge: multipart uploads or base64 JSON, size limits, media-type sniffing.

The gateway checks what it can without decoding (body size, magic bytes, pixel count from the
header) so that bad uploads get a precise 4xx before anything reaches Triton.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from facecore.processing import ImageError, image_header
from service.errors import ApiError, PayloadTooLarge, UnsupportedMedia, error_response
from service.multipart import Part, split_form

_MAGIC = ((b"\xff\xd8\xff", "image/jpeg"), (b"\x89PNG\r\n\x1a\n", "image/png"), (b"BM", "image/bmp"))


def sniff(data: bytes) -> str | None:
    """The media type from the first bytes, for the formats the pipeline accepts."""
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return next((media for magic, media in _MAGIC if data.startswith(magic)), None)


def check_image(data: bytes, max_pixels: int, label: str = "image") -> bytes:
    """Raise the right 4xx for empty, unsupported, oversized or unreadable images."""
    if not data:
        raise ApiError(f"{label} is empty", code="invalid_image")
    if sniff(data) is None:
        raise UnsupportedMedia(f"{label} is not JPEG, PNG, WebP or BMP")
    try:
        image_header(data, max_pixels)
    except ImageError as exc:
        if "above the limit" in str(exc) or "too large" in str(exc):
            raise PayloadTooLarge(f"{label}: {exc}", code="too_many_pixels", max_pixels=max_pixels) from exc
        raise ApiError(f"{label}: {exc}", code="invalid_image") from exc
    return data


def decode_base64(value: str, label: str) -> bytes:
    payload = value.split(",", 1)[1] if value.startswith("data:") and "," in value else value
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ApiError(f"{label} is not valid base64", code="invalid_base64") from exc


@dataclass(frozen=True)
class Uploaded:
    """Images and the other form/JSON fields of a request; ``sources`` names each image's field."""

    images: list[bytes]
    fields: dict[str, Any]
    sources: tuple[str, ...] = ()

    def pair(self, first: str, second: str) -> tuple[bytes, bytes] | None:
        """The images of ``first`` and ``second`` when each sent exactly one and nothing else, else None."""
        return (self.images[0], self.images[1]) if self.sources == (first, second) else None


def _labels(sources: list[str]) -> list[str]:
    """Each image's name in errors: its field, indexed where the field holds several."""
    seen: dict[str, int] = {}
    labels = []
    for source in sources:
        index = seen[source] = seen.get(source, -1) + 1
        labels.append(f"{source}[{index}]" if sources.count(source) > 1 else source)
    return labels


async def read_images(request: Request, fields: tuple[str, ...], max_pixels: int, max_images: int,
                      json_model: type[BaseModel], check: bool = True,
                      texts: tuple[str, ...] | None = None) -> Uploaded:
    """Images from ``fields`` of a multipart form, or from a JSON body validated by ``json_model``, in the
    order of ``fields`` whatever the order of the parts (``Uploaded.sources`` says whose each one is).

    With ``texts``, every file of a multipart form whose field is not one of ``texts`` is an image, whatever
    its field's name, in the order of the parts (DeepStack's register and match take any file field).
    With ``check`` every image is vetted by ``check_image`` (the first bad one raises)."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type == "multipart/form-data":
        named, others = await _multipart(request, fields, max_images, texts)
        if texts is None:
            named.sort(key=lambda item: fields.index(item[0]))  # stable: a field's images keep their order
        sources = [name for name, _ in named]
        images = [data for _, data in named]
    elif content_type == "application/json":
        try:
            body = json_model.model_validate(json.loads(await request.body()))
        # RecursionError: deep nesting
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise ApiError("the body is not valid JSON", code="invalid_json") from exc
        except ValidationError as exc:
            details = [{"loc": list(e["loc"]), "msg": e["msg"]} for e in exc.errors()]
            raise ApiError("the request is not valid", code="validation_error", status=422,
                           errors=details) from exc
        data = {k: v for k, v in body.model_dump().items() if v is not None}  # an optional image left null
        encoded = [v for f in fields if f in data
                   for v in (data[f] if isinstance(data[f], list) else [data[f]])]
        sources = [f for f in fields if f in data for _ in (data[f] if isinstance(data[f], list) else [0])]
        images = [decode_base64(v, label) for v, label in zip(encoded, _labels(sources), strict=True)]
        others = {k: v for k, v in data.items() if k not in fields}
    else:
        raise UnsupportedMedia("send multipart/form-data or application/json", content_type=content_type)
    if not images:
        wanted = "each image as a file" if texts is not None else f"the {' / '.join(fields)} field"
        raise ApiError(f"no image: send {wanted}", code="missing_image")
    if len(images) > max_images:
        raise PayloadTooLarge(f"{len(images)} images; at most {max_images} per request",
                              code="too_many_images")
    if check:
        labels = _labels(sources)
        images = [check_image(d, max_pixels, label) for d, label in zip(images, labels, strict=True)]
    return Uploaded(images, others, tuple(sources))


#: Starlette's limit on the parts of a form that are not files (``request.form(max_fields=...)``).
MAX_FORM_FIELDS = 32


async def _multipart(request: Request, fields: tuple[str, ...], max_images: int,
                     texts: tuple[str, ...] | None = None) -> tuple[list[tuple[str, bytes]], dict[str, Any]]:
    """Image files and other fields of a multipart body: split at C speed when it is plain
    (``service.multipart``), else by Starlette's parser with its errors and limits. With ``texts``, the
    image fields are every file field but those."""
    parts = split_form(await request.body(), request.headers.get("content-type", ""),
                       max_images + 1 + MAX_FORM_FIELDS)
    if texts is not None and parts is not None:
        fields = tuple({p.name for p in parts if p.filename is not None} - set(texts))
    plain = None if parts is None else _from_parts(parts, fields, max_images)
    if plain is not None:
        return plain
    try:
        form = await request.form(max_files=max_images + 1, max_fields=MAX_FORM_FIELDS)
    except StarletteHTTPException as exc:  # Starlette's 400 for a form it refuses to parse
        if exc.status_code != 400:
            raise
        if str(exc.detail).startswith("Too many files"):  # more than max_images + 1 files
            raise PayloadTooLarge(f"more than {max_images} images per request",
                                  code="too_many_images") from exc
        raise ApiError(f"the multipart body is not valid: {exc.detail}",
                       code="invalid_multipart") from exc
    images: list[tuple[str, bytes]] = []
    others: dict[str, Any] = {}
    if texts is not None:
        fields = tuple({k for k, v in form.multi_items() if isinstance(v, UploadFile)} - set(texts))
    for key, value in form.multi_items():
        if key in fields and isinstance(value, UploadFile):
            images.append((key, await value.read()))
        elif key in fields:
            raise ApiError(f"form field {key!r} must be a file upload", code="invalid_image")
        else:
            others[key] = value
    return images, others


def _from_parts(parts: list[Part], fields: tuple[str, ...], max_images: int
                ) -> tuple[list[tuple[str, bytes]], dict[str, Any]] | None:
    """Images and fields from split parts when they mean what Starlette's parse would, with nothing for it
    to refuse (image fields are files, other fields UTF-8 text, within its counts); else None."""
    files = sum(p.filename is not None for p in parts)
    if files > max_images + 1 or len(parts) - files > MAX_FORM_FIELDS:
        return None
    images: list[tuple[str, bytes]] = []
    others: dict[str, Any] = {}
    for part in parts:
        if (part.filename is not None) != (part.name in fields):
            return None
        if part.filename is not None:
            images.append((part.name, part.data))
            continue
        try:
            others[part.name] = part.data.decode("utf-8")
        except UnicodeDecodeError:
            return None
    return images, others


class BodySizeLimit:
    """ASGI middleware: 413 as soon as a request body exceeds ``max_bytes`` (declared or streamed)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:  # handled by the app's HTTPException handler: a 413 body
                    raise StarletteHTTPException(413, f"request body above {self.max_bytes} bytes")
            return message

        await self.app(scope, limited, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(413, "payload_too_large", f"request body above {self.max_bytes} bytes",
                                  {"max_bytes": self.max_bytes})
        await response(scope, receive, send)
