"""Runs the naive baseline (``bench/naive_app.py``) with uvicorn in a subprocess and loads it.

    python -m bench.naive                          # 1 and 2 intra-op threads, concurrency 1..16
    python -m bench.naive --threads 1 --concurrency 1 8 --seconds 5

Real multipart JPEG uploads (``httpx``, one client per load thread), closed loop, the same photos as
every other part. The app gets the settings and ONNX files ``face_pipeline`` serves.
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

from bench.common import (
    ARTIFACTS,
    PHOTOS,
    LoadRow,
    MultipartSender,
    ServedModels,
    Watched,
    free_port,
    run_load,
    served_models,
    start_server,
    stop_server,
)
from bench.gallery import markdown_table
from export.fetch import fetch_photos

log = logging.getLogger(__name__)

CONCURRENCY = (1, 2, 4, 8, 16)
THREADS = (1, 2)


@dataclass(frozen=True)
class NaiveServer:
    url: str
    pid: int
    threads: int


def target_name(threads: int) -> str:
    return f"naive /embed, {threads} intra-op thread{'s' if threads != 1 else ''}"


@contextmanager
def naive_server(models: ServedModels, threads: int, log_file: Path = ARTIFACTS / "bench-naive.log"
                 ) -> Iterator[NaiveServer]:
    """uvicorn serving ``bench.naive_app:app`` on a free port (one worker process)."""
    port = free_port()
    env = {**os.environ, "NAIVE_SETTINGS": json.dumps(models.settings.to_parameters()),
           "NAIVE_DETECTOR_ONNX": str(models.detector_file), "NAIVE_EMBEDDER_ONNX": str(models.embedder_file),
           "NAIVE_INTRA_OP_THREADS": str(threads)}
    command = [sys.executable, "-m", "uvicorn", "bench.naive_app:app", "--host", "127.0.0.1", "--port",
               str(port), "--no-access-log", "--log-level", "warning"]
    process = start_server(command, env, log_file, f"http://127.0.0.1:{port}/health")
    try:
        yield NaiveServer(f"http://127.0.0.1:{port}", process.pid, threads)
    finally:
        stop_server(process)


def measure_once(server: NaiveServer, name: str, data: bytes, concurrency: int, seconds: float) -> LoadRow:
    """One closed-loop run of multipart uploads against ``POST /embed``."""
    sender = MultipartSender(f"{server.url}/embed", "image", name, data)
    try:
        row = run_load(target_name(server.threads), name, sender, concurrency, seconds,
                       [Watched("naive", server.pid, tree=False)])
    finally:
        sender.close()
    log.info("naive, %d thread(s), %s c=%d: %.1f images/s", server.threads, name, concurrency, row.throughput)
    return row


def faces_found(server: NaiveServer, name: str, data: bytes) -> int:
    sender = MultipartSender(f"{server.url}/embed", "image", name, data)
    try:
        return len(sender().json()["faces"])
    finally:
        sender.close()


def measure(models: ServedModels, photos: dict[str, bytes], threads: Sequence[int] = THREADS,
            concurrency: Sequence[int] = CONCURRENCY, seconds: float = 10.0,
            log_file: Path = ARTIFACTS / "bench-naive.log") -> list[LoadRow]:
    """Every thread setting x photo x concurrency; a fresh server per thread setting."""
    rows = []
    for count in threads:
        with naive_server(models, count, log_file) as server:
            for name, data in photos.items():
                log.info("naive, %d thread(s), %s: %d face(s)", count, name, faces_found(server, name, data))
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
    parser.add_argument("--threads", type=int, nargs="+", default=list(THREADS))
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY))
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--photos", nargs="+", default=list(PHOTOS))
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    models = served_models(args.repository) if args.repository else served_models()
    paths = fetch_photos(ARTIFACTS / "downloads", ARTIFACTS / "photos")
    rows = measure(models, {n: paths[n].read_bytes() for n in args.photos}, args.threads, args.concurrency,
                   args.seconds)
    print(load_table(rows))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
