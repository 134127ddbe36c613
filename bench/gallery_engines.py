"""The indexes ``bench/gallery.py`` compares, each built as the product builds it, then measured."""

from __future__ import annotations

import importlib
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from bench.gallery_measure import K, MemoryProbe, Row, Truth, measure, release_free_memory, status_kib
from gallery.engines.index import FaceIndex, IndexConfig, IndexKind
from gallery.store.store import CollectionInfo

Vectors = NDArray[np.float32]


def _snapshot(index: FaceIndex, config: IndexConfig, truth: Truth, row: Row) -> None:
    """Save, free, load back (timed), and check the loaded index answers as the saved one did."""
    expected = index.search(truth.genuine[:16], K)[1]
    with tempfile.TemporaryDirectory(prefix="bench-gallery-") as folder:
        path = Path(folder) / "index.faiss"
        index.save(path, seq=0)
        row.snapshot_bytes = path.stat().st_size
        del index
        release_free_memory()
        began = time.perf_counter()
        loaded, _ = FaceIndex.load(path, config)
        row.load_s = time.perf_counter() - began
    if not np.array_equal(loaded.search(truth.genuine[:16], K)[1], expected):
        raise RuntimeError(f"{row.label}: the loaded snapshot answers differently from the saved index")


def _faiss(vectors: Vectors, config: IndexConfig, row: Row, threshold: float) -> FaceIndex:
    ids = np.arange(len(vectors), dtype=np.int64)
    memory = MemoryProbe()
    with memory.measure():
        began = time.perf_counter()
        index = FaceIndex.build(vectors.shape[1], ids, vectors, config, identities=ids // 10,
                                threshold=threshold)
        row.build_s = time.perf_counter() - began
    row.memory_bytes = memory.retained
    return index


def bench_exact(vectors: Vectors, truth: Truth) -> Row:
    row = Row(len(vectors), vectors.shape[1], "exact")
    config = IndexConfig(exact_max=len(vectors), exact_always=len(vectors))  # exact, never timed
    index = _faiss(vectors, config, row, truth.threshold)
    measure(index.search, truth, row)
    _snapshot(index, config, truth, row)
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
        _snapshot(index, config, truth, row)
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
