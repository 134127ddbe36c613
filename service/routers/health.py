"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from facecore.client import AsyncPipelineClient
from service.deps import GalleryDep, StoreDep
from service.schemas import Liveness, Readiness

router = APIRouter(tags=["health"])


@router.get("/health/live", response_model=Liveness, summary="The process is up")
async def live() -> Liveness:
    return Liveness()


@router.get("/health/ready", response_model=Readiness,
            summary="Triton models, database and gallery are ready",
            responses={503: {"model": Readiness}})
async def ready(request: Request, store: StoreDep, gallery: GalleryDep) -> JSONResponse:
    pipeline: AsyncPipelineClient = request.app.state.pipeline
    triton, database = await asyncio.gather(pipeline.ready(), asyncio.to_thread(store.db.ping))
    checks = {"triton": triton, "database": database, "gallery": gallery.loaded}
    body = Readiness(ready=all(checks.values()), checks=checks)
    return JSONResponse(body.model_dump(), status_code=200 if body.ready else 503)


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
