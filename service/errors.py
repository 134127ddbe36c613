"""One error model for the whole API: ``{"code", "message", "details"}`` with a stable ``code``.

Client mistakes are 4xx, a missing dependency (Triton, the database) is 503 with Retry-After, a
timeout 504, the database's disk full 507; anything else is a logged, generic 500.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy.exc import DataError, DBAPIError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from facecore.client import PipelineError
from gallery.errors import Conflict, CropsMissing, GalleryError, InvalidEmbedding, ModelMismatch, NotFound
from gallery.store.db import storage_full
from recognition.errors import Refused

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5


class ErrorBody(BaseModel):
    code: str
    message: str
    details: dict[str, Any] = {}


class ApiError(Exception):
    status = 400
    code = "bad_request"

    def __init__(self, message: str, code: str | None = None, status: int | None = None,
                 **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status


class Unauthorized(ApiError):
    status, code = 401, "unauthorized"


class Forbidden(ApiError):
    status, code = 403, "forbidden"


class PayloadTooLarge(ApiError):
    status, code = 413, "payload_too_large"


class UnsupportedMedia(ApiError):
    status, code = 415, "unsupported_media_type"


class Unprocessable(ApiError):
    status, code = 422, "unprocessable"


class Unavailable(ApiError):
    status, code = 503, "service_unavailable"
    retry_after_s = RETRY_AFTER_S


class Overloaded(Unavailable):
    """Load shed at the door: the gateway or Triton is at its limit (retry soon)."""

    code = "overloaded"
    retry_after_s = 1


class Timeout(ApiError):
    status, code = 504, "timeout"


class StorageFull(ApiError):
    """The database's disk is full: nothing was written, and writes fail until an operator frees space
    (reads and identify go on), so no Retry-After."""

    status, code = 507, "storage_full"


_GALLERY_STATUS: dict[type[GalleryError], int] = {
    NotFound: 404, Conflict: 409, InvalidEmbedding: 422, ModelMismatch: 409, CropsMissing: 409,
}


def error_body(code: str, message: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
    return ErrorBody(code=code, message=message, details=details or {}).model_dump()


def error_response(status: int, code: str, message: str, details: dict[str, Any] | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(code, message, details), status_code=status, headers=headers)


def pipeline_error(exc: PipelineError) -> ApiError:
    """A face_pipeline failure: the caller's image (400), or Triton unreachable/failing (503)."""
    if exc.invalid_input:
        return ApiError(str(exc), code="invalid_image")
    if exc.timed_out:
        return Timeout("face_pipeline did not answer in time")
    if "maximum queue size" in str(exc).lower():  # Triton's bounded queue refused it
        return Overloaded("the inference server's queue is full; retry shortly")
    return Unavailable(f"the inference server is unavailable: {exc}", code="triton_unavailable")


def retry_after(exc: Exception) -> str:
    """The Retry-After of a 503 that ``exc`` causes, on every API: 1 s when load is shed (``overloaded``,
    the gateway's limit or Triton's full queue), else ``RETRY_AFTER_S``."""
    error = pipeline_error(exc) if isinstance(exc, PipelineError) else exc
    return str(error.retry_after_s if isinstance(error, Unavailable) else RETRY_AFTER_S)


#: Our codes for Starlette's HTTP errors (anything else is ``http_error``).
HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}

#: FastAPI's 400 for a JSON body its parser could not read (fastapi/routing.py), beside the validation
#: error it gives for malformed JSON.
_BODY_PARSE_ERROR = "There was an error parsing the body"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        headers = {"Retry-After": retry_after(exc)} if exc.status == 503 else None
        return error_response(exc.status, exc.code, exc.message, exc.details, headers)

    @app.exception_handler(GalleryError)
    async def gallery_error(_: Request, exc: GalleryError) -> JSONResponse:
        return error_response(_GALLERY_STATUS.get(type(exc), 400), exc.code, exc.message, exc.details)

    @app.exception_handler(Refused)
    async def refused(_: Request, exc: Refused) -> JSONResponse:
        return error_response(422, exc.code, exc.message, exc.details)

    @app.exception_handler(PipelineError)
    async def triton_error(request: Request, exc: PipelineError) -> JSONResponse:
        return await api_error(request, pipeline_error(exc))

    @app.exception_handler(OperationalError)
    async def database_down(request: Request, exc: OperationalError) -> JSONResponse:
        if storage_full(exc.orig):
            log.error("the database's disk is full: %s", exc.orig)
            return await api_error(request, StorageFull("the database's disk is full; nothing was written"))
        log.warning("database unavailable: %s", exc.orig)
        return error_response(503, "database_unavailable", "the database is unavailable", {},
                              {"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(DataError)
    async def database_refused(_: Request, exc: DataError) -> JSONResponse:
        """A value from the request the database cannot store or compare (PostgreSQL: a NUL character)."""
        log.info("the database refused a value: %s", exc.orig)
        return error_response(422, "validation_error", "a value in the request is not valid here "
                              "(text must not contain NUL characters)")

    @app.exception_handler(DBAPIError)
    async def database_error(_: Request, exc: DBAPIError) -> JSONResponse:
        if exc.connection_invalidated:
            return error_response(503, "database_unavailable", "the database connection was lost", {},
                                  {"Retry-After": str(RETRY_AFTER_S)})
        log.exception("database error", exc_info=exc)
        return error_response(500, "internal_error", "internal error")

    @app.exception_handler(RequestValidationError)
    async def validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
                  for e in exc.errors()]
        if any(e["type"] == "json_invalid" for e in errors):  # as on the image routes (service/images.py)
            return error_response(400, "invalid_json", "the body is not valid JSON", {"errors": errors})
        return error_response(422, "validation_error", "the request is not valid", {"errors": errors})

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.detail == _BODY_PARSE_ERROR:  # invalid UTF-8, too deep to parse
            return error_response(400, "invalid_json", "the body is not valid JSON")
        return error_response(exc.status_code, HTTP_CODES.get(exc.status_code, "http_error"), str(exc.detail),
                              headers=dict(exc.headers or {}))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(500, "internal_error", "internal error; the request id is in the logs")
