"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from facecore.client import AsyncPipelineClient
from service.deps import GalleryDep, StoreDep
from service.readiness import NOT_READY, RecognitionCheck, TritonStatus
from service.schemas import Liveness, Readiness

router = APIRouter(tags=["health"])

#: How long readiness waits for Triton's and the database's answers: a hung one is "not ready" in time for
#: the probes' 5 s (they waited an inference's 30 s, and a database that drops packets minutes).
CHECK_TIMEOUT_S = 2.0


async def _database_answers(store: StoreDep) -> bool:
    try:
        return await asyncio.wait_for(asyncio.to_thread(store.db.ping), CHECK_TIMEOUT_S)
    except TimeoutError:  # the thread finishes on its own (the engine's connect timeout bounds it)
        return False


@router.get("/health/live", response_model=Liveness, summary="The process is up")
async def live() -> Liveness:
    return Liveness()


@router.get("/health/ready", response_model=Readiness,
            summary="Triton models, recognition of a real photo and the gallery are ready (the database is "
                    "reported, not required once the gallery is loaded)",
            responses={503: {"model": Readiness}})
async def ready(request: Request, store: StoreDep, gallery: GalleryDep) -> JSONResponse:
    pipeline: AsyncPipelineClient = request.app.state.pipeline
    check: RecognitionCheck = request.app.state.recognition_check
    supervised: Callable[[], TritonStatus] | None = getattr(request.app.state, "triton_status", None)
    triton, database = await asyncio.gather(pipeline.ready(CHECK_TIMEOUT_S), _database_answers(store))
    if triton:
        probe = await check.result()
    else:  # and the next probe must not reuse a success from before the outage
        probe = check.invalidate("not checked: face_pipeline is not ready in Triton")
    checks = {"triton": triton, "recognition": probe.ok, "database": database, "gallery": gallery.loaded}
    details = {} if probe.ok else {"recognition": probe.detail}
    if not triton:
        details["triton"] = NOT_READY
    status = supervised() if supervised is not None else None
    if status is not None and not status.up:  # the bundled tritonserver is being restarted
        checks["triton"] = False
        details["triton"] = status.detail
    if not database:  # the index and its labels are in memory: identify still answers, writes get 503
        details["database"] = "unreachable: writes answer 503 until it is back; identify answers from memory"
    # a gateway whose database is down still serves identify, so it stays in its load balancer's rotation
    serving = checks["triton"] and checks["recognition"] and checks["gallery"]
    body = Readiness(ready=serving, checks=checks, details=details)
    return JSONResponse(body.model_dump(), status_code=200 if body.ready else 503)


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
