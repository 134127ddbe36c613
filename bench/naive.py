"""Runs the naive baseline (``bench/naive_app.py``) with uvicorn in a subprocess and loads it.

    python -m bench.naive                          # both variants, 1 intra-op thread, concurrency 1..16
    python -m bench.naive --variants plain --threads 1 2 --concurrency 1 8 --seconds 5

Real multipart JPEG uploads (``httpx``, one client per load thread), closed loop, the same photos as
every other part. Two variants (``bench/plain.py``): *served* gets the settings and ONNX files
``face_pipeline`` serves (the same work as the stack); *plain* the fixed 640x640 detector input and SFace
without the PReLU rewrite (the obvious deployment of the same networks).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
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
from service.launcher import stop_process

log = logging.getLogger(__name__)

CONCURRENCY = (1, 2, 4, 8, 16)
#: 1 intra-op thread per session: on the recorded 2-core run 2 threads lost at every concurrency.
THREADS = (1,)
SERVED, PLAIN = plain_part.SERVED, plain_part.PLAIN
VARIANTS = plain_part.VARIANTS


@dataclass(frozen=True)
class NaiveServer:
    url: str
    pid: int
    threads: int
    variant: str = SERVED
    health: dict[str, Any] | None = None  # GET /health at start-up: what the app really runs


def target_name(threads: int, variant: str = SERVED) -> str:
    return f"naive {variant} /embed, {threads} intra-op thread{'s' if threads != 1 else ''}"


def _check_health(health: dict[str, Any], variant: str) -> None:
    """The app runs the variant it was asked for (plain: fixed input, an embedder with PRelu nodes)."""
    if health.get("variant") != variant:
        raise RuntimeError(f"naive app runs {health.get('variant')!r}, not {variant!r}")
    if variant == PLAIN and (health.get("dynamic_input") or not health.get("embedder_prelu_nodes")):
        raise RuntimeError(f"naive plain app is not plain: {health}")


@contextmanager
def naive_server(models: ServedModels, threads: int, variant: str = SERVED,
                 log_file: Path = ARTIFACTS / "bench-naive.log") -> Iterator[NaiveServer]:
    """uvicorn serving ``bench.naive_app:app`` on a free port (one worker process). ``models``: the served
    models for ``served``, ``plain.prepare(...).models`` (the PReLU embedder) for ``plain``."""
    port = free_port()
    env = {**os.environ, "NAIVE_SETTINGS": json.dumps(models.settings.to_parameters()),
           "NAIVE_DETECTOR_ONNX": str(models.detector_file), "NAIVE_EMBEDDER_ONNX": str(models.embedder_file),
           "NAIVE_INTRA_OP_THREADS": str(threads), "NAIVE_VARIANT": variant}
    command = [sys.executable, "-m", "uvicorn", "bench.naive_app:app", "--host", "127.0.0.1", "--port",
               str(port), "--no-access-log", "--log-level", "warning"]
    url = f"http://127.0.0.1:{port}"
    process = start_server(command, env, log_file, f"{url}/health")
    try:
        health: dict[str, Any] = httpx.get(f"{url}/health", timeout=30).json()
        _check_health(health, variant)
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
        faces: list[dict[str, Any]] = sender().json()["faces"]
        return faces
    finally:
        sender.close()


def faces_found(server: NaiveServer, name: str, data: bytes) -> int:
    return len(embed(server, name, data))


def agreement(servers: Sequence[NaiveServer], photos: dict[str, bytes]) -> str:
    """Do the variants decide alike? Faces found per photo and variant, and the lowest cosine between the
    same face's embeddings (each served face matched to the plain face whose box overlaps it most)."""
    by_variant = {s.variant: s for s in servers}
    if not {SERVED, PLAIN} <= by_variant.keys():
        return ""
    parts = []
    for name, data in photos.items():
        served, plain = (embed(by_variant[v], name, data) for v in (SERVED, PLAIN))
        text = f"{name}: {len(served)} face(s) served, {len(plain)} plain"
        if served and len(served) == len(plain):
            matched = [_overlapping(a, plain) for a in served]
            cosines = [_cosine(a["embedding"], b["embedding"]) for a, b in zip(served, matched, strict=True)]
            text += f", embedding cosine >= {min(cosines):.4f}"
        parts.append(text)
    return "; ".join(parts)


def _overlapping(face: dict[str, Any], others: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return max(others, key=lambda other: _iou(face["box"], other["box"]))


def _iou(a: Sequence[float], b: Sequence[float]) -> float:
    width = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    height = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = width * height
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def _cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))
    return dot / norm if norm else 0.0


def measure(models: ServedModels, photos: dict[str, bytes], threads: Sequence[int] = THREADS,
            concurrency: Sequence[int] = CONCURRENCY, seconds: float = 10.0,
            log_file: Path = ARTIFACTS / "bench-naive.log", variants: Sequence[str] = VARIANTS
            ) -> list[LoadRow]:
    """Every variant x thread setting x photo x concurrency; a fresh server per variant and thread
    setting."""
    rows = []
    for variant in variants:
        run_models = plain_part.prepare(models, photos).models if variant == PLAIN else models
        for count in threads:
            with naive_server(run_models, count, variant, log_file) as server:
                for name, data in photos.items():
                    log.info("naive %s, %d thread(s), %s: %d face(s)", variant, count, name,
                             faces_found(server, name, data))
                    rows += [measure_once(server, name, data, c, seconds) for c in concurrency]
    return rows


COLUMNS = ("target", "photo", "concurrency", "images/s", "p50 ms", "p90 ms", "p99 ms", "errors",
           "CPU ms/request (client / server)", "server RSS MiB")


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
