"""Closed-loop load (``closed_loop``), one measured row with the CPU every watched process spent per
request and Triton's statistics (``run_load``), and the multipart sender for HTTP targets."""

from __future__ import annotations

import http.client
import itertools
import secrets
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from bench.core.processes import Watched, cpu_seconds, resident_bytes
from bench.core.reporting import MIB
from bench.core.triton import model_statistics, statistics_delta


@dataclass(frozen=True)
class LoadResult:
    concurrency: int
    requests: int
    errors: int
    seconds: float
    latencies_ms: NDArray[np.float64]

    @property
    def throughput(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms.size else float("nan")


def closed_loop(send: Callable[[], object], concurrency: int, seconds: float, warmup: int = 2) -> LoadResult:
    """Run ``send`` from ``concurrency`` threads for ``seconds``; each thread warms up first."""
    for _ in range(warmup):
        send()
    latencies: list[list[float]] = [[] for _ in range(concurrency)]
    errors = [0] * concurrency
    start_barrier = threading.Barrier(concurrency + 1)
    stop_at = [0.0]

    def worker(index: int) -> None:
        start_barrier.wait()
        while True:
            began = time.perf_counter()
            if began >= stop_at[0]:
                return
            try:
                send()
            except Exception:  # counted, not raised: a benchmark reports failures
                errors[index] += 1
                continue
            latencies[index].append((time.perf_counter() - began) * 1000)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    began = time.perf_counter()
    stop_at[0] = began + seconds
    start_barrier.wait()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - began
    flat = np.array([value for per_thread in latencies for value in per_thread])
    return LoadResult(concurrency, int(flat.size), sum(errors), elapsed, flat)


def in_turn(call: Callable[[bytes], object], payloads: Sequence[bytes]) -> Callable[[], object]:
    """A sender for ``closed_loop``: ``call`` on each payload in turn."""
    turn = itertools.cycle(payloads)
    return lambda: call(next(turn))


def multipart_body(field_name: str, filename: str, data: bytes) -> tuple[bytes, str]:
    """One JPEG as a multipart/form-data body, and the Content-Type header that goes with it."""
    boundary = secrets.token_hex(16)
    body = (f'--{boundary}\r\nContent-Disposition: form-data; name="{field_name}"; filename="{filename}"'
            f'\r\nContent-Type: image/jpeg\r\n\r\n').encode() + data + f"\r\n--{boundary}--\r\n".encode()
    return body, f"multipart/form-data; boundary={boundary}"


class MultipartSender:
    """Callable for ``closed_loop``: POSTs one image (or several, in turn) as a multipart upload over one
    keep-alive connection per thread, the bodies encoded once: the load generator shares the cores with
    what it measures, so it spends as little CPU per request as it can (docs/benchmarks/README.md). A
    status other than 200 raises; a kept-alive connection the server has closed is opened again once."""

    def __init__(self, url: str, field_name: str, filename: str, data: bytes | Sequence[bytes],
                 headers: Mapping[str, str] | None = None) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"{url}: an http:// URL is expected")
        self.url, self.host, self.port = url, parts.hostname, parts.port or 80
        self.path = parts.path + (f"?{parts.query}" if parts.query else "")
        self.requests: list[tuple[bytes, dict[str, str]]] = []
        for image in [data] if isinstance(data, bytes) else data:
            body, content_type = multipart_body(field_name, filename, image)
            self.requests.append((body, {**(headers or {}), "Content-Type": content_type,
                                         "Content-Length": str(len(body))}))
        if not self.requests:
            raise ValueError("no image to send")
        self._turn = itertools.count()  # several images: each request sends the next one
        self._local = threading.local()
        self._connections: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection and whether it has been used before."""
        connection: http.client.HTTPConnection | None = getattr(self._local, "connection", None)
        if connection is not None:
            return connection, True
        connection = http.client.HTTPConnection(self.host, self.port, timeout=300.0)
        self._local.connection = connection
        with self._lock:
            self._connections.append(connection)
        return connection, False

    def _drop(self, connection: http.client.HTTPConnection) -> None:
        connection.close()
        self._local.connection = None
        with self._lock:
            self._connections.remove(connection)

    def __call__(self) -> bytes:
        connection, reused = self._connection()
        try:
            body, headers = self.requests[next(self._turn) % len(self.requests)]
            connection.request("POST", self.path, body, headers)
            response = connection.getresponse()
            content = response.read()
        except (http.client.RemoteDisconnected, ConnectionError) as exc:
            self._drop(connection)
            if not reused:
                raise RuntimeError(f"{self.url}: {exc}") from exc
            return self()  # the server closed an idle kept-alive connection: once more on a new one
        except Exception:
            self._drop(connection)
            raise
        if response.status != 200:
            raise RuntimeError(f"{self.url}: {response.status} {content[:300]!r}")
        return content

    def __enter__(self) -> MultipartSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            for connection in self._connections:
                connection.close()
            self._connections.clear()


@dataclass
class LoadRow:
    """One closed-loop measurement with the CPU each process spent per request."""

    target: str  # "REST identify", "gRPC face_pipeline", "naive served /embed, 1 intra-op thread"
    photo: str
    concurrency: int
    requests: int
    errors: int
    seconds: float
    throughput: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    client_cpu_ms: float  # this process (the load generator), per request
    cpu_ms: dict[str, float] = field(default_factory=dict)  # per watched process (tree), per request
    rss_mib: dict[str, float] = field(default_factory=dict)  # resident memory (PSS) at the end of the run
    triton: dict[str, dict[str, float]] | None = None  # statistics deltas per model

    @property
    def cpu_ms_total(self) -> float:
        return self.client_cpu_ms + sum(self.cpu_ms.values())


def run_load(target: str, photo: str, send: Callable[[], object], concurrency: int, seconds: float,
             watched: Sequence[Watched] = (), triton_url: str | None = None) -> LoadRow:
    """``closed_loop`` with the CPU of this process and of ``watched`` ones per request, and Triton's
    statistics deltas when ``triton_url`` is given."""
    before_stats = model_statistics(triton_url) if triton_url else None
    pids = {w.name: w.pids() for w in watched}
    cpu_before = {name: cpu_seconds(p) for name, p in pids.items()}
    client_before = time.process_time()
    result: LoadResult = closed_loop(send, concurrency, seconds)
    client = time.process_time() - client_before
    cpu = {name: cpu_seconds(p) - cpu_before[name] for name, p in pids.items()}
    stats = None
    if before_stats is not None and triton_url:
        stats = statistics_delta(before_stats, model_statistics(triton_url))
    # The warm-up requests (closed_loop sends 2 first) are in the CPU figures: count them too.
    done = max(result.requests + 2, 1)
    return LoadRow(
        target=target, photo=photo, concurrency=concurrency, requests=result.requests, errors=result.errors,
        seconds=result.seconds, throughput=result.throughput, p50_ms=result.percentile(50),
        p90_ms=result.percentile(90), p99_ms=result.percentile(99), client_cpu_ms=1000 * client / done,
        cpu_ms={name: 1000 * value / done for name, value in cpu.items()},
        rss_mib={w.name: resident_bytes(w.pids()) / MIB for w in watched}, triton=stats,
    )
