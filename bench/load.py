"""Closed-loop load generation: N workers each send one request after another for a fixed time."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray


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

    def row(self) -> dict[str, float | int]:
        return {"concurrency": self.concurrency, "requests": self.requests, "errors": self.errors,
                "throughput_per_s": round(self.throughput, 2), "p50_ms": round(self.percentile(50), 1),
                "p90_ms": round(self.percentile(90), 1), "p99_ms": round(self.percentile(99), 1)}


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
