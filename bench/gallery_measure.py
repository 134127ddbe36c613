"""Measuring one gallery index (FAISS ``FaceIndex`` or a Milvus collection) for ``bench/gallery.py``.

Every index is searched through the product's ``SearchBatcher``: one query per request, sequentially
(latency) and from 1, 8 and 32 threads at once (throughput: concurrent requests share engine calls).
Accuracy is measured against exact search on held-out probes: recall@10 with its lower bound, and the
decision agreement on genuine probes (a new photo of an enrolled face) and impostor probes (faces of
people not enrolled, drawn from the same generator as the gallery).
"""

from __future__ import annotations

import ctypes
import gc
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from gallery.engines.measures import (
    concurrent_throughput,
    decision_agreement,
    recall_at_k,
    recall_lower_bound,
)

K = 10
CONCURRENCY = (1, 8, 32)
Search = Callable[[NDArray[np.float32], int], tuple[NDArray[Any], NDArray[Any]]]


# --- memory ----------------------------------------------------------------------------------------


def status_kib(key: str, pid: int | str = "self") -> int:
    match = re.search(rf"^{key}:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.MULTILINE)
    return int(match.group(1)) if match else 0


def release_free_memory() -> None:
    """Collect garbage and hand freed heap pages back to the kernel (glibc keeps up to ~64 MB otherwise,
    which a later allocation reuses without growing the RSS)."""
    gc.collect()
    with suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@dataclass
class MemoryProbe:
    """Resident-set growth across a block, and its peak (VmHWM, reset through clear_refs)."""

    retained: int = 0
    peak: int = 0

    @contextmanager
    def measure(self) -> Iterator[MemoryProbe]:
        release_free_memory()
        before = status_kib("VmRSS")
        with suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        yield self
        release_free_memory()
        self.retained = (status_kib("VmRSS") - before) * 1024
        self.peak = (status_kib("VmHWM") - before) * 1024


# --- one index -------------------------------------------------------------------------------------


@dataclass
class Row:
    size: int
    dimension: int
    index: str  # "exact", a candidate kind, "auto: <the kind chosen>", "milvus-lite"
    effort: int | None = None  # re-rank depth / nprobe the build chose
    accurate: bool = True  # met the targets at build (else refused: the collection would stay exact)
    build_s: float = 0.0
    build_recall_bound: float | None = None  # what the build measured on its own probes
    p50_ms: float | None = None
    p99_ms: float | None = None
    qps: dict[str, float] = field(default_factory=dict)  # concurrency -> queries/s, with batching
    recall_at_10: float | None = None
    recall_bound: float | None = None
    genuine_agreement: float | None = None
    impostor_agreement: float | None = None
    true_match_at_10: float | None = None
    memory_bytes: int | None = None  # resident memory the index keeps (Milvus: the server's growth)
    snapshot_bytes: int | None = None
    load_s: float | None = None

    @property
    def label(self) -> str:
        if self.index == "exact":
            return "exact (Flat)"
        if self.index == "milvus-lite":
            return "Milvus-lite 2.4 (FLAT)"
        effort = "nprobe" if self.index.endswith("ivf") else "re-rank"
        text = f"{self.index} ({effort} {self.effort})"
        return text if self.accurate else f"{text}: refused at build → exact"


def latency(search: Search, probes: NDArray[np.float32], row: Row) -> None:
    for query in probes[:5]:
        search(query[None], K)  # warm-up
    times = []
    for query in probes:
        began = time.perf_counter()
        search(query[None], K)
        times.append((time.perf_counter() - began) * 1000)
    row.p50_ms, row.p99_ms = (float(v) for v in np.percentile(times, [50, 99]))


def throughput(search: Search, probes: NDArray[np.float32], row: Row, requests: int = 320) -> None:
    """Queries/s with 1, 8 and 32 concurrent one-query requests, each through the batcher."""
    for threads in CONCURRENCY:
        count = max(requests, 10 * threads) if threads > 1 else requests // 2
        row.qps[str(threads)] = concurrent_throughput(search, probes, threads, count)


@dataclass
class Truth:
    """Held-out probes with their exact answers and the identity of every face."""

    genuine: NDArray[np.float32]
    sources: NDArray[np.int64]
    impostor: NDArray[np.float32]
    genuine_exact: tuple[NDArray[np.float32], NDArray[np.int64]]
    impostor_exact: tuple[NDArray[np.float32], NDArray[np.int64]]
    identity_of: Callable[[NDArray[np.int64]], NDArray[np.int64]]
    threshold: float


def accuracy(search: Search, truth: Truth, row: Row) -> None:
    genuine = search(truth.genuine, K)
    impostor = search(truth.impostor, K)
    row.recall_at_10 = recall_at_k(genuine[1], truth.genuine_exact[1])
    row.recall_bound = recall_lower_bound(row.recall_at_10, len(truth.genuine))
    owner, threshold = truth.identity_of, truth.threshold
    row.genuine_agreement = decision_agreement(genuine, truth.genuine_exact, owner, threshold)
    row.impostor_agreement = decision_agreement(impostor, truth.impostor_exact, owner, threshold)
    row.true_match_at_10 = float((genuine[1] == truth.sources[:, None]).any(axis=1).mean())


#: Latency and throughput use this many probes (accuracy uses them all).
TIMED = 200


def measure(search: Search, truth: Truth, row: Row) -> None:
    latency(search, truth.genuine[:TIMED], row)
    throughput(search, truth.genuine[:TIMED], row)
    accuracy(search, truth, row)
