"""The naive baseline: one FastAPI app that decodes, detects, aligns and embeds each request's image in its
own process, with ``facecore``'s code and no Triton, no batching across requests, no gallery. ``POST
/embed`` (multipart field ``image``) is a plain ``def``: FastAPI runs it in its thread pool, each request
calling its runtime with batch 1. The approach Triton exists to beat.

Configured by the environment (``bench/naive.py`` sets it): ``NAIVE_SETTINGS`` (JSON of
``PipelineSettings.to_parameters()``), ``NAIVE_DETECTOR_ONNX`` / ``NAIVE_EMBEDDER_ONNX``,
``NAIVE_VARIANT`` (``served`` or ``plain``; plain refuses an embedder without PRelu nodes),
``NAIVE_DETECTOR_RUNTIME`` / ``NAIVE_EMBEDDER_RUNTIME`` (e.g. ``openvino:bf16``; default
``onnxruntime:f32``) and ``NAIVE_INTRA_OP_THREADS`` (0: one per core).
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
from facecore.pipeline import Detector, Embedder, PipelineSettings, run_pipeline
from facecore.processing import ImageError, decode_image, original_size
from facecore.runtimes import Runtime, RuntimeChoice, detector, embedder
from facecore.spec import InputLayout


@dataclass(frozen=True)
class Models:
    settings: PipelineSettings
    detector: Detector
    embedder: Embedder
    variant: str
    prelu_nodes: int  # in the embedder graph
    runtimes: tuple[RuntimeChoice, RuntimeChoice]  # the detector's, the embedder's


VARIANTS = ("served", "plain")


def runtime_choice(text: str, threads: int) -> RuntimeChoice:
    """``openvino:bf16`` -> that runtime and precision with ``threads`` intra-op threads."""
    runtime, _, precision = text.partition(":")
    return RuntimeChoice(Runtime(runtime), precision or "f32", threads)


def runtime_text(choice: RuntimeChoice) -> str:
    return f"{choice.runtime.value}:{choice.precision}"


def _check_plain(settings: PipelineSettings, prelu: int, choices: tuple[RuntimeChoice, ...]) -> None:
    if prelu == 0:
        raise ValueError("plain needs an embedder with PRelu nodes; this one has none")
    if any(c.runtime is not Runtime.ONNXRUNTIME for c in choices):
        raise ValueError("plain runs ONNX Runtime")
    if settings.detector.input_layout is not InputLayout.NCHW_FLOAT:
        raise ValueError("plain feeds the original float NCHW detector, not the served uint8 one")


def load_models() -> Models:
    """The two networks on their runtimes and the settings, from the environment (once, at start-up)."""
    settings = PipelineSettings.from_parameters(json.loads(os.environ["NAIVE_SETTINGS"]))
    variant = os.environ.get("NAIVE_VARIANT", "served")
    if variant not in VARIANTS:
        raise ValueError(f"NAIVE_VARIANT must be one of {VARIANTS}, not {variant!r}")
    embedder_file = os.environ["NAIVE_EMBEDDER_ONNX"]
    prelu = prelu_nodes(Path(embedder_file))
    threads = int(os.environ.get("NAIVE_INTRA_OP_THREADS", "0"))
    detector_runtime, embedder_runtime = (
        runtime_choice(os.environ.get(f"NAIVE_{role}_RUNTIME", "onnxruntime:f32"), threads)
        for role in ("DETECTOR", "EMBEDDER"))
    if variant == "plain":
        settings = replace(settings, dynamic_input=False, decode_min_side=0)
        _check_plain(settings, prelu, (detector_runtime, embedder_runtime))
    return Models(settings, detector(settings.detector, os.environ["NAIVE_DETECTOR_ONNX"], detector_runtime),
                  embedder(settings.embedder, embedder_file, embedder_runtime), variant, prelu,
                  (detector_runtime, embedder_runtime))


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    app.state.models = load_models()
    yield


app = FastAPI(title="naive face embedding baseline", lifespan=lifespan)


@app.get("/health")
def health(request: Request) -> dict[str, Any]:
    """What the app runs (the tests check it is what ``bench/naive.py`` asked for)."""
    models: Models = request.app.state.models
    return {"variant": models.variant, "dynamic_input": models.settings.dynamic_input,
            "embedder_prelu_nodes": models.prelu_nodes,
            "detector_input_layout": models.settings.detector.input_layout.value,
            "detector_runtime": runtime_text(models.runtimes[0]),
            "embedder_runtime": runtime_text(models.runtimes[1])}


@app.post("/embed")
def embed(request: Request, image: Annotated[UploadFile, File()]) -> dict[str, Any]:
    """decode -> detect -> align -> embed, for this one image."""
    models: Models = request.app.state.models
    settings = models.settings
    data = image.file.read()
    try:
        decoded = decode_image(data, settings.max_pixels, settings.decode_min_side,
                               fast_jpeg=models.variant != "plain")  # plain: OpenCV's imdecode
    except ImageError as exc:
        raise HTTPException(status_code=400, detail=str(exc)) from exc
    sizes = [original_size(data, decoded)] if settings.decode_min_side else None
    (found,) = run_pipeline([decoded], [settings.default_options], settings, models.detector,
                            models.embedder, sizes)
    return {"width": found.width, "height": found.height,
            "faces": [{"box": found.boxes[i].tolist(), "score": float(found.scores[i]),
                       "landmarks": found.landmarks[i].tolist(), "embedding": found.embeddings[i].tolist()}
                      for i in range(len(found))]}
