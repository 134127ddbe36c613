"""What the compatibility routers (CompreFace, DeepStack) share: the description of an error the v1 API
would answer with (status, code, message), and a route class that renders errors in a client's format."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from facecore.client import PipelineError
from gallery.errors import GalleryError
from recognition.errors import Refused
from service.errors import _GALLERY_STATUS, ApiError, pipeline_error
from service.errors import HTTP_CODES as V1_HTTP_CODES

Render = Callable[[Exception], Response | None]

#: Our code for an HTTP error Starlette raises inside a route (a form it cannot parse: 400; the streamed body
#: over the size limit: 413), named as the v1 API names it; any other status is ``http_error``.
HTTP_CODES = {**V1_HTTP_CODES, 400: "invalid_multipart"}


def describe(exc: Exception) -> tuple[int, str, str] | None:
    """(HTTP status, our code, message) of an error the v1 API answers itself; None for a bug."""
    if isinstance(exc, PipelineError):
        exc = pipeline_error(exc)
    if isinstance(exc, ApiError):
        return exc.status, exc.code, exc.message
    if isinstance(exc, Refused):
        return 422, exc.code, exc.message
    if isinstance(exc, GalleryError):
        return _GALLERY_STATUS.get(type(exc), 400), exc.code, exc.message
    if isinstance(exc, RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return 422, "validation_error", f"{where}: {first.get('msg', 'not valid')}"
    if isinstance(exc, StarletteHTTPException) and exc.status_code < 500:
        return exc.status_code, HTTP_CODES.get(exc.status_code, "http_error"), str(exc.detail)
    return None


def rendering_route(render: Render) -> type[APIRoute]:
    """A route class whose errors (route, dependencies, use cases) become ``render(exc)``; an error it
    returns None for goes on to the app's handlers (the logged generic 500)."""

    class Route(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def handle(request: Request) -> Response:
                try:
                    return await handler(request)
                except Exception as exc:
                    response = render(exc)
                    if response is None:
                        raise
                    return response

            return handle

    return Route
