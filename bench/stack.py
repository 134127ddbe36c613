"""Our stack for ``python -m bench``: the bundled Triton and the REST gateway, started as ``make run``
starts them (a temporary SQLite gallery holding obama2.jpg), under closed-loop load: REST ``identify``
and the ``face_pipeline`` call the gateway makes, sent directly (``measure_rest``, ``measure_grpc``); the
sweep's best concurrency against a high one (``hold_check``); and the memory run (``memory_run``).
"""

from __future__ import annotations

import logging
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import cv2
import httpx
import numpy as np

from bench.core import processes
from bench.core.inputs import ARTIFACTS, REPOSITORY, load_photos
from bench.core.load import LoadRow, MultipartSender, closed_loop, run_load
from bench.core.processes import Watched
from bench.core.reporting import MIB
from bench.core.triton import bundled_triton
from facecore.client import PipelineClient
from service.launcher import stop_process

log = logging.getLogger(__name__)

CONCURRENCY = (1, 2, 4, 8, 16)
COLLECTION = "bench"
REST, GRPC = "REST identify", "gRPC face_pipeline"
#: The photo enrolled as the identity the REST identify requests should match.
ENROLLED = "obama2.jpg"
MAX_FACES = 100  # what the gateway asks face_pipeline for (FACEREC_LIMITS__MAX_FACES default)


@dataclass
class Stack:
    triton_grpc: str
    triton_pid: int
    gateway_url: str
    gateway_pid: int
    key: str  # the collection's API key
    version: str  # tritonserver version

    def watched(self) -> list[Watched]:
        return [Watched("gateway", self.gateway_pid, tree=False), Watched("triton", self.triton_pid)]

    @property
    def identify_url(self) -> str:
        return f"{self.gateway_url}/v1/collections/{COLLECTION}/identify"


def setup_collection(url: str, admin_key: str, enroll: bytes) -> str:
    """A collection with one identity enrolled from ``enroll``; returns a key of that collection."""
    with httpx.Client(base_url=url, headers={"X-API-Key": admin_key}, timeout=120) as client:
        client.post("/v1/collections", json={"name": COLLECTION}).raise_for_status()
        created = client.post(f"/v1/collections/{COLLECTION}/keys", json={"label": "bench"})
        created.raise_for_status()
        client.post(f"/v1/collections/{COLLECTION}/identities/obama/faces",
                    params={"create": "true", "name": "Barack Obama"},
                    files={"images": (ENROLLED, enroll, "image/jpeg")}).raise_for_status()
        return str(created.json()["key"])


def start_gateway(triton: str, workdir: Path, log_file: Path) -> tuple[subprocess.Popen[bytes], str, str]:
    """The gateway as ``make run`` starts it, on a free port, its SQLite gallery and snapshots in
    ``workdir``. Returns the process, its URL and its admin key."""
    admin_key, port = secrets.token_urlsafe(24), processes.free_port()
    env = {**os.environ, "FACEREC_SECURITY__ADMIN_KEY": admin_key,
           "FACEREC_DATABASE__URL": f"sqlite:///{workdir / 'gallery.db'}",
           "FACEREC_GALLERY__SNAPSHOT_DIR": str(workdir / "index"), "FACEREC_LOG_LEVEL": "WARNING"}
    command = [sys.executable, "-m", "service", "--triton-url", triton, "--host", "127.0.0.1",
               "--port", str(port), "--admin-key-file", str(workdir / "admin_key")]
    url = f"http://127.0.0.1:{port}"
    return processes.start_server(command, env, log_file, f"{url}/health/ready"), url, admin_key


@contextmanager
def running_stack(repository: Path = REPOSITORY, enroll: bytes | None = None,
                  log_dir: Path = ARTIFACTS) -> Iterator[Stack]:
    """Triton and the gateway on free ports, a collection with ``enroll`` (default obama2.jpg) enrolled."""
    if enroll is None:
        enroll = load_photos([ENROLLED])[ENROLLED]
    server = bundled_triton(repository, log_dir / "bench-stack-tritonserver.log")
    with server, tempfile.TemporaryDirectory(prefix="bench-stack-") as folder:
        triton_pid = server.pid
        if triton_pid is None:
            raise RuntimeError("tritonserver exited right after it became ready")
        gateway, url, admin_key = start_gateway(server.grpc_url, Path(folder), log_dir / "bench-gateway.log")
        try:
            key = setup_collection(url, admin_key, enroll)
            yield Stack(server.grpc_url, triton_pid, url, gateway.pid, key, server.version())
        finally:
            stop_process(gateway)


def identify_sender(stack: Stack, name: str, data: bytes) -> MultipartSender:
    return MultipartSender(stack.identify_url, "image", name, data, {"X-API-Key": stack.key})


def measure_rest(stack: Stack, name: str, data: bytes, concurrency: int, seconds: float) -> LoadRow:
    """One closed-loop run of multipart ``identify`` requests through the gateway."""
    with identify_sender(stack, name, data) as sender:
        row = run_load(REST, name, sender, concurrency, seconds, stack.watched(), stack.triton_grpc)
    log.info("REST %s c=%d: %.1f images/s", name, concurrency, row.throughput)
    return row


def measure_grpc(stack: Stack, client: PipelineClient, name: str, data: bytes, concurrency: int,
                 seconds: float) -> LoadRow:
    """One closed-loop run of the ``face_pipeline`` call the gateway makes, sent directly over gRPC."""
    def send() -> object:
        return client.infer(data, max_faces=MAX_FACES)

    row = run_load(GRPC, name, send, concurrency, seconds, stack.watched(), stack.triton_grpc)
    log.info("gRPC %s c=%d: %.1f images/s", name, concurrency, row.throughput)
    return row


@dataclass
class HoldCheck:
    """REST identify at the sweep's best concurrency and at a higher one, alternating (``hold_check``)."""

    photo: str
    best_concurrency: int
    high_concurrency: int
    seconds: float  # each window
    best: list[float]  # images/s per round
    high: list[float]
    errors: int = 0  # failed requests over every window

    @property
    def shares(self) -> list[float]:
        return [h / b if b > 0 else 0.0 for h, b in zip(self.high, self.best, strict=True)]

    @property
    def share(self) -> float:
        return statistics.median(self.shares)


HOLD_ROUNDS = 3


def hold_check(stack: Stack, name: str, data: bytes, best: int, high: int, seconds: float,
               rounds: int = HOLD_ROUNDS) -> HoldCheck:
    """The sweep measures each concurrency once, minutes apart, and its best is the largest of several noisy
    windows: a higher concurrency compared with it loses to the drift and to that pick as much as to its
    own queues. Here the two alternate, ``rounds`` times, each window ``seconds`` long."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, not {rounds}")
    check = HoldCheck(name, best, high, seconds, [], [])
    for _ in range(rounds):
        for concurrency, rates in ((best, check.best), (high, check.high)):
            row = measure_rest(stack, name, data, concurrency, seconds)
            rates.append(row.throughput)
            check.errors += row.errors
    log.info("hold %s: %d vs %d, shares %s", name, high, best, [f"{s:.2f}" for s in check.shares])
    return check


@dataclass
class MemoryRun:
    minutes: float
    concurrency: int
    interval_s: float
    times_s: list[float]
    rss_mib: dict[str, list[float]]  # PSS per watched process (tree), one value per sample
    load: LoadRow
    warmup_s: float = 0.0
    shapes: int = 1  # sizes of the photo the requests sent in turn

    def flatness(self, name: str) -> dict[str, float]:
        """Start, end and max (MiB), and the largest deviation from the start (%)."""
        values = np.asarray(self.rss_mib[name], dtype=np.float64)
        if values.size == 0:
            return {}
        start = float(values[0])
        return {"start": start, "end": float(values[-1]), "max": float(values.max()),
                "max_deviation_pct": float(np.abs(values - start).max() / start * 100) if start else 0.0}


#: Every detector input shape with the longer side at 640 (the shorter 64 to 640, both orientations): what
#: a runtime keeps per input shape must show in the memory run, as it would with users' photos.
VARIANT_SIZES = tuple([(640, 32 * k) for k in range(2, 21)] + [(32 * k, 640) for k in range(2, 20)])


def shape_variants(data: bytes, sizes: Sequence[tuple[int, int]] = VARIANT_SIZES) -> list[bytes]:
    """The photo resized (stretched) to each (width, height), as JPEGs: one detector input shape each."""
    image = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    if image is None:
        raise ValueError("not an image")
    return [cv2.imencode(".jpg", cv2.resize(image, size, interpolation=cv2.INTER_AREA),
                         [cv2.IMWRITE_JPEG_QUALITY, 90])[1].tobytes() for size in sizes]


def memory_run(stack: Stack, name: str, data: bytes, minutes: float, concurrency: int = 16) -> MemoryRun:
    """REST identify of the photo's ``shape_variants`` in turn at ``concurrency`` for ``minutes``, sampling
    resident memory, after a warm-up at the same load (10 % of the run, at most 30 s) that is not sampled:
    buffers for the batch shapes this load produces are allocated then, not counted as growth."""
    interval = min(5.0, max(0.5, minutes * 60 / 120))
    warmup = min(30.0, minutes * 6)
    images = shape_variants(data)
    with MultipartSender(stack.identify_url, "image", name, images, {"X-API-Key": stack.key}) as sender:
        closed_loop(sender, concurrency, warmup)
        with processes.RssSampler(stack.watched(), interval) as sampler:
            row = run_load(f"{REST} (memory run)", name, sender, concurrency, minutes * 60, stack.watched(),
                           stack.triton_grpc)
    return MemoryRun(minutes, concurrency, interval, [t for t, _ in sampler.samples],
                     {w.name: [s[w.name] / MIB for _, s in sampler.samples] for w in stack.watched()}, row,
                     warmup, len(images))
