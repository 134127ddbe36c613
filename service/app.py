"""The FastAPI application: ``create_app(settings)`` builds it; the lifespan owns the clients.

Clients live on ``app.state`` (no module globals): the Triton gRPC client, the database engine,
the gallery (its indexes follow the database change log in a background thread, so replicas stay
consistent), the API keys and the metrics registry; beside them the use cases the routes call
(``app.state.recognition``, a ``recognition.usecases.Recognition``) and the readiness probe that sends a real
photo through face_pipeline (``app.state.recognition_check``).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Any

from fastapi import FastAPI
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from facecore.client import AsyncPipelineClient
from facecore.probe import probe_image
from facecore.settings import GatewaySettings
from gallery.gallery import Gallery, open_gallery
from gallery.store.db import Database, create_db_engine, migrate
from gallery.store.store import GalleryStore
from recognition.usecases import Recognition
from service.admission import Admission
from service.auth import KeyStore
from service.drain import DrainBody
from service.errors import ErrorBody, error_response, install_error_handlers
from service.images import BodySizeLimit
from service.logs import request_id
from service.metrics import Metrics
from service.openapi import with_error_responses
from service.readiness import RecognitionCheck
from service.routers import collections, compreface, deepstack, demo, health, identities, recognition

log = logging.getLogger(__name__)

DESCRIPTION = """
Face recognition on NVIDIA Triton: detection (RetinaFace), 5-point alignment and embeddings (SFace by
default) run server-side in `face_pipeline`; matching runs on a FAISS gallery backed by a SQL database.

**Authentication**: `X-API-Key: <key>`. The admin key (from the settings) manages collections and keys;
a collection key reaches only its own collection. **Images**: multipart uploads or base64 in JSON
(JPEG, PNG, WebP, BMP). **Errors**: `{"code", "message", "details"}` with a stable `code`.
**Scores** are cosine similarities; `confidence` is 0.5 at the threshold (see docs/calibration.md).
"""
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def _route_template(scope: Scope) -> str:
    """The matched route's path template (bounded label values for metrics), set by the router."""
    return str(getattr(scope.get("route"), "path", "unmatched"))


async def _snapshot_periodically(gallery: Gallery, metrics: Metrics, interval: float,
                                 erasure_delay: float = 5.0) -> None:
    """Full snapshots every ``interval``; snapshots of collections that lost faces within seconds,
    so that erased vectors do not linger on disk. Each pass is counted, written or failed."""
    since_full = 0.0
    while True:
        await asyncio.sleep(erasure_delay)
        since_full += erasure_delay
        try:
            if since_full >= interval:
                since_full = 0.0
                written = await asyncio.to_thread(gallery.snapshot)
            else:
                written = await asyncio.to_thread(gallery.snapshot_erasures)
        except Exception:  # a failed snapshot only costs a longer replay at the next start
            metrics.snapshot_failures.inc()
            log.exception("gallery snapshot failed")
        else:
            if written:
                metrics.snapshots.inc()


def _warn_keyless(settings: GatewaySettings) -> None:
    """Keyless DeepStack calls are an operator's explicit choice with a risk: said loudly at every start."""
    keyless, collection = settings.deepstack.keyless, settings.deepstack.collection
    if keyless == "off" or not collection:
        return
    who = "any caller that reaches this gateway" if keyless == "network" else "any process on this host"
    log.warning("FACEREC_DEEPSTACK__KEYLESS=%s: DeepStack calls WITHOUT a key act on collection %r: %s can "
                "enroll, recognize and delete its people (docs/compat.md)", keyless, collection, who)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: GatewaySettings = app.state.settings
    engine = create_db_engine(settings.database.url)
    await asyncio.to_thread(migrate, engine)
    db = Database(engine)
    store = GalleryStore(db)
    gallery = await asyncio.to_thread(open_gallery, store, settings)
    await asyncio.to_thread(gallery.load)
    gallery.start_follower(settings.gallery.follow_interval_s)
    pipeline = AsyncPipelineClient(settings.triton.url, settings.triton.timeout_s)
    app.state.store, app.state.gallery, app.state.pipeline = store, gallery, pipeline
    app.state.keys = keys = KeyStore(db, settings.security.admin_key.get_secret_value())
    keys.start_watch(settings.gallery.follow_interval_s)
    metrics: Metrics = app.state.metrics
    metrics.watch_gallery(gallery.sizes, gallery.reselection_state)
    metrics.watch_changelog(store.last_seq, lambda: gallery.applied_seq)
    app.state.recognition = Recognition(pipeline, gallery, store, settings.limits.max_faces,
                                        metrics.observe_pipeline)
    app.state.recognition_check = RecognitionCheck(pipeline, probe_image(), settings.triton.probe_interval_s,
                                                   ready=pipeline.ready)
    metrics.watch_probe(app.state.recognition_check)
    await app.state.recognition_check.refresh()  # logs whether recognition works at start-up
    probing = asyncio.create_task(app.state.recognition_check.run())
    snapshots = asyncio.create_task(_snapshot_periodically(
        gallery, metrics, settings.gallery.snapshot_interval_s, settings.gallery.erasure_snapshot_delay_s))
    _warn_keyless(settings)
    log.info("gateway ready: triton %s, database %s", settings.triton.url, engine.url.render_as_string())
    try:
        yield
    finally:
        for task in (snapshots, probing):
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
        gallery.close()
        keys.stop_watch()
        metrics.close()
        try:
            await asyncio.to_thread(gallery.snapshot)
        except Exception:  # a full disk, the database down: the next start replays more of the log
            log.exception("the gallery snapshot at shutdown failed")
        await pipeline.close()
        engine.dispose()


#: FastAPI 0.16x's own OpenTelemetry hooks (off: the gateway has its Prometheus metrics and access log;
#: when on, every request looked up the tracer and meter providers).
_NO_NATIVE_TELEMETRY: dict[str, Any] = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters else {})

#: Every router the app serves, in the order a request's path is matched against them: the recognition
#: calls (identify, detect, verify: nearly every request) first, so a request tries one router's routes
#: rather than four; the last two are the CompreFace- and DeepStack-compatible APIs (docs/compat.md).
ROUTERS = (recognition.router, health.router, collections.router, identities.router, demo.router,
           compreface.router, deepstack.router)


def create_app(settings: GatewaySettings) -> FastAPI:
    app = FastAPI(title="facerec-triton", version="1.0.0", description=DESCRIPTION, lifespan=lifespan,
                  **_NO_NATIVE_TELEMETRY)
    app.state.settings = settings
    app.state.metrics = Metrics()
    app.state.admission = Admission(settings.limits.max_in_flight)
    app.state.metrics.watch_admission(app.state.admission)
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    _serve_error_bodies(app)

    # The last added is the outermost: Observe sees every response, the body-size 413s included.
    app.add_middleware(BodySizeLimit, max_bytes=settings.limits.max_upload_bytes)
    app.add_middleware(DrainBody, max_bytes=settings.limits.max_upload_bytes)  # every client reads the 4xx
    app.add_middleware(Observe, timeout_s=settings.limits.request_timeout_s, metrics=app.state.metrics)
    return app


def _serve_error_bodies(app: FastAPI) -> None:
    """``app.openapi()`` with the error bodies the routes send (service/openapi.py), built once."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = with_error_responses(build(), ErrorBody.model_json_schema())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


class Observe:
    """Request id, timeout, metrics and the access log of every HTTP request (outermost middleware).

    Plain ASGI rather than ``BaseHTTPMiddleware``: the timeout cancels the request's own task (with
    ``call_next`` the route went on running after the 504, and its failure was re-raised as an
    unhandled error), and exceptions raised while the body is read (the streamed-body 413) reach the
    exception handlers as they are instead of wrapped in an ``ExceptionGroup`` (a 500).
    """

    def __init__(self, app: ASGIApp, timeout_s: float, metrics: Metrics) -> None:
        self.app, self.timeout_s, self.metrics = app, timeout_s, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = Headers(scope=scope).get("x-request-id", "")
        rid = incoming if _REQUEST_ID.match(incoming) else uuid.uuid4().hex
        status = 0

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                MutableHeaders(scope=message)["X-Request-ID"] = rid
            await send(message)

        token = request_id.set(rid)
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.app(scope, receive, send_with_id)
        except TimeoutError:
            if not status:
                await error_response(504, "timeout", f"no answer within {self.timeout_s} s")(scope, receive,
                                                                                           send_with_id)
        except Exception:
            if not status:  # the generic 500 of the error handler, with the request id
                await error_response(500, "internal_error", "internal error; the request id is in the logs")(
                    scope, receive, send_with_id)
            raise
        finally:
            request_id.reset(token)
            if status:  # else cancelled before any answer (client gone, shutdown): nothing to count
                self._record(scope, rid, status, time.perf_counter() - started)

    def _record(self, scope: Scope, rid: str, status: int, elapsed: float) -> None:
        route, method = _route_template(scope), str(scope["method"])
        self.metrics.requests.labels(method, route, str(status)).inc()
        self.metrics.latency.labels(method, route).observe(elapsed)
        log.info("%s %s -> %d", method, route, status,
                 extra={"fields": {"request_id": rid, "status": status, "path": scope["path"],
                                   "duration_ms": round(elapsed * 1000, 1)}})
