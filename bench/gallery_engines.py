"""The indexes ``bench/gallery.py`` compares (exact FAISS, each candidate, Milvus-lite), each built as
the product builds it, then measured the same way: through the product's ``SearchBatcher``, one query
per request sequentially (latency) and from 1, 8 and 32 threads (throughput: concurrent requests share
engine calls); against exact search on held-out genuine and impostor probes (recall@10 and its lower
bound, decision agreement); resident memory, snapshot size and load time."""

from __future__ import annotations

import ctypes
import gc
import importlib
import re
import tempfile
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from gallery.engines.index import FaceIndex, IndexConfig, IndexKind
from gallery.engines.measures import (
    concurrent_throughput,
    decision_agreement,
    recall_at_k,
    recall_lower_bound,
)
from gallery.store.store import CollectionInfo

K = 10
CONCURRENCY = (1, 8, 32)
Search = Callable[[NDArray[np.float32], int], tuple[NDArray[Any], NDArray[Any]]]


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


Vectors = NDArray[np.float32]


def _snapshot(index: FaceIndex, config: IndexConfig, row: Row) -> None:
    """Save, free and load back (timed)."""
    with tempfile.TemporaryDirectory(prefix="bench-gallery-") as folder:
        path = Path(folder) / "index.faiss"
        index.save(path, seq=0)
        row.snapshot_bytes = path.stat().st_size
        del index
        release_free_memory()
        began = time.perf_counter()
        FaceIndex.load(path, config)
        row.load_s = time.perf_counter() - began


def _faiss(vectors: Vectors, config: IndexConfig, row: Row, threshold: float) -> FaceIndex:
    ids = np.arange(len(vectors), dtype=np.int64)
    release_free_memory()
    before = status_kib("VmRSS")
    began = time.perf_counter()
    index = FaceIndex.build(vectors.shape[1], ids, vectors, config, identities=ids // 10, threshold=threshold)
    row.build_s = time.perf_counter() - began
    release_free_memory()
    row.memory_bytes = (status_kib("VmRSS") - before) * 1024  # the resident set the index keeps
    return index


def bench_exact(vectors: Vectors, truth: Truth) -> Row:
    row = Row(len(vectors), vectors.shape[1], "exact")
    config = IndexConfig(exact_max=len(vectors), exact_always=len(vectors))  # exact, never timed
    index = _faiss(vectors, config, row, truth.threshold)
    measure(index.search, truth, row)
    _snapshot(index, config, row)
    return row


#: The ``kind`` that builds as the product does: every default candidate, the latency and throughput rule.
AUTO = "auto"


def bench_faiss(vectors: Vectors, kind: str, truth: Truth, threshold: float) -> Row:
    """``kind`` alone as the candidate, kept when accurate (the latency rule is what the table shows), or
    with ``AUTO`` the index the product's default selection chooses (build time includes every
    candidate it tried)."""
    row = Row(len(vectors), vectors.shape[1], kind)
    config = (IndexConfig(exact_max=0) if kind == AUTO
              else IndexConfig(exact_max=0, candidates=(kind,), latency_check=False))
    index = _faiss(vectors, config, row, threshold)
    if kind == AUTO:
        if index.kind is IndexKind.FLAT:
            raise RuntimeError("the default selection kept the exact scan: no candidate met its targets")
        row.index = f"{AUTO}: {index.kind.value}"
        measured = next(m for m in index.selection if m.kind == index.kind.value)
    else:
        (measured,) = index.selection
    row.effort, row.accurate = measured.effort, measured.accurate
    row.build_recall_bound = measured.recall_bound
    if measured.accurate:
        measure(index.search, truth, row)
        _snapshot(index, config, row)
    return row


def milvus_missing() -> str | None:
    """Why the Milvus-lite rows cannot run here, or None: they need the `milvus` extra, which
    ``.[server,cpu,bench]`` does not install."""
    for module in ("milvus_lite", "pymilvus"):
        try:
            importlib.import_module(module)
        except Exception as exc:  # any failure to import counts (milvus-lite 3.x: pyarrow wants numpy 2)
            return f"{module}: {exc}; install the `milvus` extra for them"
    return None


def bench_milvus(vectors: Vectors, truth: Truth, threshold: float) -> Row:
    """The gallery's Milvus engine on a milvus-lite server of its own (FLAT index: exact)."""
    from gallery.engines.milvus import MilvusEngine
    from gallery.engines.milvus_lite import MilvusLite  # imports milvus_lite: the `milvus` extra

    row = Row(len(vectors), vectors.shape[1], "milvus-lite")
    ids = np.arange(len(vectors), dtype=np.int64)
    info = CollectionInfo(1, "bench", "synthetic", vectors.shape[1], threshold, False, datetime.now(UTC))
    with tempfile.TemporaryDirectory(prefix="bench-milvus-") as folder:
        server = MilvusLite(Path(folder) / "bench.db")
        with server:
            before = status_kib("VmRSS", server.pid or "self")
            engine = MilvusEngine(server.uri, prefix="bench")
            began = time.perf_counter()
            index = engine.build(info, ids, ids // 10, vectors)
            row.build_s = time.perf_counter() - began

            def search(queries: Vectors, k: int) -> tuple[Vectors, NDArray[np.int64]]:
                scores, found, _ = index.search(queries, k)
                return scores, found

            measure(search, truth, row)
            row.memory_bytes = (status_kib("VmRSS", server.pid or "self") - before) * 1024
            engine.client.close()
        began = time.perf_counter()
        with server:  # a restart: the server reads its file and loads the collection again
            engine = MilvusEngine(server.uri, prefix="bench")
            opened = engine.open(info, lambda: (ids, ids // 10))
            if opened is None:
                raise RuntimeError("milvus-lite lost the collection across a restart")
            opened[0].search(truth.genuine[:1], K)
            row.load_s = time.perf_counter() - began
            engine.client.close()
    return row
