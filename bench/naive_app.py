"""The naive baseline: one FastAPI app that does everything per request, in its own process.

``POST /embed`` (multipart field ``image``) decodes, detects, aligns and embeds that one image with the
same networks and the same pre/post-processing code as ``face_pipeline`` (``facecore``), and returns
the faces with their embeddings. No Triton, no batching across requests, no gallery. The endpoint is a
plain ``def``: FastAPI runs it in its thread pool, so concurrent requests run side by side, each calling
ONNX Runtime with batch 1. This is the approach Triton exists to beat.

Two variants (``NAIVE_VARIANT``):

- ``served``: exactly the settings and ONNX files ``face_pipeline`` serves, work reductions included
  (detector input sized to each image, SFace with its PReLU rewritten): the same work as the stack, so
  comparing with it measures serving overhead;
- ``plain``: the obvious deployment of the same networks: every image letterboxed to the fixed detector
  input (640x640, ``dynamic_input=False``), decoded at full size, and an embedder file that still has its
  PRelu nodes (the app refuses to start with one that has none).

Configuration (environment; ``bench/naive.py`` sets it and runs the app with uvicorn):

- ``NAIVE_SETTINGS``: JSON of ``PipelineSettings.to_parameters()`` (the parameters face_pipeline serves)
- ``NAIVE_DETECTOR_ONNX`` / ``NAIVE_EMBEDDER_ONNX``: the ONNX files
- ``NAIVE_VARIANT``: ``served`` (default) or ``plain``
- ``NAIVE_INTRA_OP_THREADS``: ONNX Runtime intra-op threads per session (0: one per core)

    NAIVE_SETTINGS=... NAIVE_DETECTOR_ONNX=... NAIVE_EMBEDDER_ONNX=... NAIVE_VARIANT=plain \\
        python -m uvicorn bench.naive_app:app --port 8090
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, File, HTTPException, Request, UploadFile

from export.sface import prelu_nodes
from facecore.onnx_runtime import OnnxDetector, OnnxEmbedder, create_session
from facecore.pipeline import PipelineSettings, run_pipeline
from facecore.processing import ImageError, decode_image, original_size


@dataclass(frozen=True)
class Models:
    settings: PipelineSettings
    detector: OnnxDetector
    embedder: OnnxEmbedder
    threads: int
    variant: str
    embedder_file: str
    prelu_nodes: int  # in the embedder graph


VARIANTS = ("served", "plain")


def load_models() -> Models:
    """ONNX Runtime sessions and settings from the environment (once, at start-up)."""
    settings = PipelineSettings.from_parameters(json.loads(os.environ["NAIVE_SETTINGS"]))
    variant = os.environ.get("NAIVE_VARIANT", "served")
    if variant not in VARIANTS:
        raise ValueError(f"NAIVE_VARIANT must be one of {VARIANTS}, not {variant!r}")
    embedder_file = os.environ["NAIVE_EMBEDDER_ONNX"]
    prelu = prelu_nodes(Path(embedder_file))
    if variant == "plain":
        settings = replace(settings, dynamic_input=False, decode_min_side=0)
        if prelu == 0:
            raise ValueError(f"plain needs an embedder with PRelu nodes; {embedder_file} has none")
    threads = int(os.environ.get("NAIVE_INTRA_OP_THREADS", "0"))
    detector = OnnxDetector(settings.detector, create_session(os.environ["NAIVE_DETECTOR_ONNX"], threads))
    embedder = OnnxEmbedder(settings.embedder, create_session(embedder_file, threads))
    return Models(settings, detector, embedder, threads, variant, Path(embedder_file).name, prelu)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    app.state.models = load_models()
    yield


app = FastAPI(title="naive face embedding baseline", lifespan=lifespan)


@app.get("/health")
def health(request: Request) -> dict[str, Any]:
    models: Models = request.app.state.models
    settings = models.settings
    return {"ok": True, "variant": models.variant, "intra_op_threads": models.threads,
            "dynamic_input": settings.dynamic_input,
            "detector_input_size": list(settings.detector.input_size),
            "decode_min_side": settings.decode_min_side, "embedder_file": models.embedder_file,
            "embedder_prelu_nodes": models.prelu_nodes}


@app.post("/embed")
def embed(request: Request, image: Annotated[UploadFile, File()]) -> dict[str, Any]:
    """decode -> detect -> align -> embed, for this one image."""
    models: Models = request.app.state.models
    settings = models.settings
    data = image.file.read()
    try:
        decoded = decode_image(data, settings.max_pixels, settings.decode_min_side)
    except ImageError as exc:
        raise HTTPException(status_code=400, detail=str(exc)) from exc
    sizes = [original_size(data, decoded)] if settings.decode_min_side else None
    (result,) = run_pipeline([decoded], [settings.default_options], settings, models.detector,
                             models.embedder, sizes)
    found = result
    return {
        "width": result.width,
        "height": result.height,
        "faces": [{"box": found.boxes[i].tolist(), "score": float(found.scores[i]),
                   "landmarks": found.landmarks[i].tolist(), "embedding": result.embeddings[i].tolist()}
                  for i in range(len(found))],
    }
