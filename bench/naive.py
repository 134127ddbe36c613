"""Runs the naive baseline (``bench/naive_app.py``) with uvicorn in a subprocess and loads it.

    python -m bench.naive                          # both variants, 1 intra-op thread, concurrency 1..16
    python -m bench.naive --variants plain --threads 1 2 --concurrency 1 8 --seconds 5

Real multipart JPEG uploads (``bench.core.load.MultipartSender``: the body encoded once, one kept-alive
connection per load thread), closed loop, the same photos as every other part. Three variants
(``bench/plain.py``): *served* gets the settings, ONNX files, runtime and precisions ``face_pipeline``
serves (the same work as the stack); *served-onnxruntime* the same on ONNX Runtime f32; *plain* ONNX
Runtime, the original float detector at fixed 640x640 and SFace without the PReLU rewrite (the obvious
deployment of the same networks).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from bench import plain as plain_part
from bench.core.inputs import ARTIFACTS, PHOTOS, ServedModels, load_photos, served_models
from bench.core.load import LoadRow, MultipartSender, run_load
from bench.core.processes import Watched, free_port, start_server
from bench.core.reporting import markdown_table
from facecore.runtimes import Runtime, RuntimeChoice
from service.launcher import stop_process

log = logging.getLogger(__name__)

CONCURRENCY = (1, 2, 4, 8, 16)
#: 1 intra-op thread per session: on the recorded 2-core run 2 threads lost at every concurrency.
THREADS = (1,)
SERVED, PLAIN = plain_part.SERVED, plain_part.PLAIN
SERVED_ORT = "served-onnxruntime"
VARIANTS = (SERVED, SERVED_ORT, PLAIN)


@dataclass(frozen=True)
class NaiveServer:
    url: str
    pid: int
    threads: int
    variant: str = SERVED
    health: dict[str, Any] | None = None  # GET /health at start-up: what the app really runs


def target_name(threads: int, variant: str = SERVED) -> str:
    return f"naive {variant} /embed, {threads} intra-op thread{'s' if threads != 1 else ''}"


def _runtime(choice: RuntimeChoice) -> str:
    return f"{choice.runtime.value}:{choice.precision}"


def variant_models(models: ServedModels, plain_models: ServedModels | None, variant: str
                   ) -> ServedModels | None:
    """What a variant runs: the served models, them on ONNX Runtime, or the plain ones (None: not had)."""
    if variant == PLAIN:
        return plain_models
    return models.on_runtime(Runtime.ONNXRUNTIME) if variant == SERVED_ORT else models


def _check_health(health: dict[str, Any], variant: str, models: ServedModels) -> None:
    """The app runs the variant it was asked for, on the runtimes asked for (plain: fixed input, the float
    detector, an embedder with PRelu nodes)."""
    if health.get("variant") != variant:
        raise RuntimeError(f"naive app runs {health.get('variant')!r}, not {variant!r}")
    asked = (_runtime(models.detector_runtime), _runtime(models.embedder_runtime))
    if (health.get("detector_runtime"), health.get("embedder_runtime")) != asked:
        raise RuntimeError(f"naive {variant} app runs other runtimes than {asked}: {health}")
    if variant == PLAIN and (health.get("dynamic_input") or not health.get("embedder_prelu_nodes")
                             or health.get("detector_input_layout") != "nchw_float"):
        raise RuntimeError(f"naive plain app is not plain: {health}")


@contextmanager
def naive_server(models: ServedModels, threads: int, variant: str = SERVED,
                 log_file: Path = ARTIFACTS / "bench-naive.log") -> Iterator[NaiveServer]:
    """uvicorn serving ``bench.naive_app:app`` on a free port (one worker process). ``models``: what the
    variant runs (``variant_models``: the served models, them on ONNX Runtime, ``plain.prepare(...).models``
    for ``plain``)."""
    port = free_port()
    env = {**os.environ, "NAIVE_SETTINGS": json.dumps(models.settings.to_parameters()),
           "NAIVE_DETECTOR_ONNX": str(models.detector_file), "NAIVE_EMBEDDER_ONNX": str(models.embedder_file),
           "NAIVE_DETECTOR_RUNTIME": _runtime(models.detector_runtime),
           "NAIVE_EMBEDDER_RUNTIME": _runtime(models.embedder_runtime),
           "NAIVE_INTRA_OP_THREADS": str(threads), "NAIVE_VARIANT": variant}
    command = [sys.executable, "-m", "uvicorn", "bench.naive_app:app", "--host", "127.0.0.1", "--port",
               str(port), "--no-access-log", "--log-level", "warning"]
    url = f"http://127.0.0.1:{port}"
    process = start_server(command, env, log_file, f"{url}/health")
    try:
        health: dict[str, Any] = httpx.get(f"{url}/health", timeout=30).json()
        _check_health(health, variant, models)
        yield NaiveServer(url, process.pid, threads, variant, health)
    finally:
        stop_process(process)


def measure_once(server: NaiveServer, name: str, data: bytes, concurrency: int, seconds: float) -> LoadRow:
    """One closed-loop run of multipart uploads against ``POST /embed``."""
    sender = MultipartSender(f"{server.url}/embed", "image", name, data)
    try:
        row = run_load(target_name(server.threads, server.variant), name, sender, concurrency, seconds,
                       [Watched("naive", server.pid, tree=False)])
    finally:
        sender.close()
    log.info("naive %s, %d thread(s), %s c=%d: %.1f images/s", server.variant, server.threads, name,
             concurrency, row.throughput)
    return row


def embed(server: NaiveServer, name: str, data: bytes) -> list[dict[str, Any]]:
    """The faces (box, score, landmarks, embedding) the app returns for one upload."""
    sender = MultipartSender(f"{server.url}/embed", "image", name, data)
    try:
        faces: list[dict[str, Any]] = json.loads(sender())["faces"]
        return faces
    finally:
        sender.close()


def faces_found(server: NaiveServer, name: str, data: bytes) -> int:
    return len(embed(server, name, data))


def measure(models: ServedModels, photos: dict[str, bytes], threads: Sequence[int] = THREADS,
            concurrency: Sequence[int] = CONCURRENCY, seconds: float = 10.0,
            log_file: Path = ARTIFACTS / "bench-naive.log", variants: Sequence[str] = VARIANTS
            ) -> list[LoadRow]:
    """Every variant x thread setting x photo x concurrency; a fresh server per variant and thread
    setting."""
    rows = []
    plain_models = plain_part.prepare(models, photos).models if PLAIN in variants else None
    for variant in variants:
        run_models = variant_models(models, plain_models, variant)
        if run_models is None:
            raise RuntimeError(f"no models for the naive {variant} variant")
        for count in threads:
            with naive_server(run_models, count, variant, log_file) as server:
                for name, data in photos.items():
                    log.info("naive %s, %d thread(s), %s: %d face(s)", variant, count, name,
                             faces_found(server, name, data))
                    rows += [measure_once(server, name, data, c, seconds) for c in concurrency]
    return rows


COLUMNS = ("target", "photo", "concurrency", "images/s", "p50 ms", "p90 ms", "p99 ms", "errors",
           "CPU ms/request (client / server)", "server PSS MiB")


def load_table(rows: Sequence[LoadRow]) -> str:
    lines = []
    for r in rows:
        server_cpu = " + ".join(f"{v:.0f}" for v in r.cpu_ms.values()) or "—"
        rss = " / ".join(f"{name} {v:.0f}" for name, v in r.rss_mib.items()) or "—"
        lines.append((r.target, r.photo, str(r.concurrency), f"{r.throughput:.1f}", f"{r.p50_ms:.0f}",
                      f"{r.p90_ms:.0f}", f"{r.p99_ms:.0f}", str(r.errors),
                      f"{r.client_cpu_ms:.1f} / {server_cpu}", rss))
    return markdown_table(COLUMNS, lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.naive", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repository", type=Path,
                        help="CPU model repository (default: model_repository/cpu)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--threads", type=int, nargs="+", default=list(THREADS))
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY))
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--photos", nargs="+", default=list(PHOTOS))
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    models = served_models(args.repository) if args.repository else served_models()
    rows = measure(models, load_photos(args.photos), args.threads, args.concurrency,
                   args.seconds, variants=args.variants)
    print(load_table(rows))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
