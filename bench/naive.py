"""The naive baselines: ``bench/naive_app.py`` served by uvicorn in a subprocess, loaded with multipart
JPEG uploads in a closed loop (``measure_once``): *served* (the work ``face_pipeline`` does) and *plain*
(the obvious deployment of the same networks, ``bench/plain.py``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench import plain as plain_part
from bench.core.inputs import ARTIFACTS, ServedModels
from bench.core.load import LoadRow, MultipartSender, run_load
from bench.core.processes import Watched, free_port, start_server
from bench.naive_app import runtime_text
from service.launcher import stop_process

log = logging.getLogger(__name__)

#: Intra-op threads per session: on the recorded 2-core run, 2 lost at every concurrency.
THREADS = 1
SERVED, PLAIN, VARIANTS = plain_part.SERVED, plain_part.PLAIN, plain_part.VARIANTS


@dataclass(frozen=True)
class NaiveServer:
    url: str
    pid: int
    threads: int
    variant: str = SERVED
    health: dict[str, Any] | None = None  # GET /health at start-up: what the app runs


def target_name(threads: int, variant: str = SERVED) -> str:
    return f"naive {variant} /embed, {threads} intra-op thread{'s' if threads != 1 else ''}"


def variant_models(models: ServedModels, plain_models: ServedModels | None, variant: str
                   ) -> ServedModels | None:
    """What a variant runs: the served models or the plain ones (None: not had)."""
    return plain_models if variant == PLAIN else models


@contextmanager
def naive_server(models: ServedModels, threads: int, variant: str = SERVED,
                 log_file: Path = ARTIFACTS / "bench-naive.log") -> Iterator[NaiveServer]:
    """uvicorn serving ``bench.naive_app:app`` on a free port (one worker process). ``models``: what the
    variant runs (``variant_models``)."""
    port = free_port()
    env = {**os.environ, "NAIVE_SETTINGS": json.dumps(models.settings.to_parameters()),
           "NAIVE_DETECTOR_ONNX": str(models.detector_file), "NAIVE_EMBEDDER_ONNX": str(models.embedder_file),
           "NAIVE_DETECTOR_RUNTIME": runtime_text(models.detector_runtime),
           "NAIVE_EMBEDDER_RUNTIME": runtime_text(models.embedder_runtime),
           "NAIVE_INTRA_OP_THREADS": str(threads), "NAIVE_VARIANT": variant}
    command = [sys.executable, "-m", "uvicorn", "bench.naive_app:app", "--host", "127.0.0.1", "--port",
               str(port), "--no-access-log", "--log-level", "warning"]
    url = f"http://127.0.0.1:{port}"
    process = start_server(command, env, log_file, f"{url}/health")
    try:
        health: dict[str, Any] = httpx.get(f"{url}/health", timeout=30).json()
        yield NaiveServer(url, process.pid, threads, variant, health)
    finally:
        stop_process(process)


def measure_once(server: NaiveServer, name: str, data: bytes, concurrency: int, seconds: float) -> LoadRow:
    """One closed-loop run of multipart uploads against ``POST /embed``."""
    with MultipartSender(f"{server.url}/embed", "image", name, data) as sender:
        row = run_load(target_name(server.threads, server.variant), name, sender, concurrency, seconds,
                       [Watched("naive", server.pid, tree=False)])
    log.info("naive %s, %d thread(s), %s c=%d: %.1f images/s", server.variant, server.threads, name,
             concurrency, row.throughput)
    return row


def embed(server: NaiveServer, name: str, data: bytes) -> list[dict[str, Any]]:
    """The faces (box, score, landmarks, embedding) the app returns for one upload."""
    with MultipartSender(f"{server.url}/embed", "image", name, data) as sender:
        faces: list[dict[str, Any]] = json.loads(sender())["faces"]
    return faces
