"""One FAISS index per collection: inner product on L2-normalized vectors, FAISS ids = face ids.

Exact (``IndexFlatIP``) up to ``exact_max`` vectors; above it an IVF index is trained and used only
when its recall@10 against exact search, measured on this collection (less two standard errors of
that measurement), reaches ``target_recall`` while scanning at most ``max_scan_fraction`` of its
lists (the measurement is logged either way; face embeddings have little cluster structure, so
large low-dimensional galleries may stay exact). On a GPU (when FAISS reports one) the index is
copied to it; GPU indexes cannot ``remove_ids``, so removals become tombstones filtered at search
time until the gallery rebuilds the index from the database.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, cast

import faiss
import numpy as np
from numpy.typing import NDArray

from facecore.files import sha256_of, sha256_of_handle

log = logging.getLogger(__name__)

Ids = NDArray[np.int64]
Vectors = NDArray[np.float32]


class IndexKind(StrEnum):
    FLAT = "flat"
    IVF = "ivf"


@dataclass(frozen=True)
class IndexConfig:
    exact_max: int = 200_000
    target_recall: float = 0.99
    use_gpu: bool = True  # only when faiss.get_num_gpus() > 0
    recall_queries: int = 500
    #: IVF is kept only when it reaches the recall scanning at most this fraction of its lists
    #: (0.5: at least ~2x less work than the exact scan); otherwise the collection stays exact.
    max_scan_fraction: float = 0.5
    #: Rebuild a tombstoned (GPU) index when this fraction of its vectors is removed.
    compact_fraction: float = 0.1


def gpu_available() -> bool:
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


def _flat(dimension: int) -> Any:
    return faiss.IndexIDMap2(faiss.IndexFlatIP(dimension))


def recall_at_k(approximate: Ids, exact: Ids) -> float:
    """Mean fraction of the exact top-k ids that the approximate search also returned."""
    hits = sum(len(set(a[a >= 0]) & set(e[e >= 0])) for a, e in zip(approximate, exact, strict=True))
    total = sum(int((e >= 0).sum()) for e in exact)
    return hits / total if total else 1.0


def recall_lower_bound(recall: float, queries: int, k: int = 10) -> float:
    """Recall measured on ``queries`` probes minus two standard errors (binomial over queries x k).

    ``_try_ivf`` stops at the first nprobe that reaches the target, which flatters the figure it
    stopped on; requiring the lower bound to reach it leaves a margin for new queries (a margin,
    not a guarantee: see the held-out recall in docs/benchmarks/gallery.md).
    """
    return recall - 2 * math.sqrt(max(recall * (1 - recall), 0.0) / (queries * k))


def _nprobe_steps(nlist: int) -> list[int]:
    """nprobe values to try, growing by about sqrt(2) (1, 2, 3, 4, 6, 8, 11, 16, ...) up to nlist."""
    steps: list[int] = []
    value = 1.0
    while round(value) < nlist:
        if not steps or round(value) > steps[-1]:
            steps.append(round(value))
        value *= math.sqrt(2)
    return [*steps, nlist]


def genuine_probes(vectors: Vectors, count: int, similarity: float = 0.75, seed: int = 0) -> Vectors:
    """Queries like a new photo of an enrolled person: each at ~``similarity`` cosine to a stored vector."""
    rng = np.random.default_rng(seed)
    picked = vectors[rng.choice(len(vectors), size=min(count, len(vectors)), replace=False)]
    noise = rng.standard_normal(picked.shape).astype(np.float32)
    noise -= (noise * picked).sum(axis=1, keepdims=True) * picked  # orthogonal to the source
    noise /= np.linalg.norm(noise, axis=1, keepdims=True)
    probes = similarity * picked + math.sqrt(1 - similarity**2) * noise
    return np.ascontiguousarray(probes / np.linalg.norm(probes, axis=1, keepdims=True), dtype=np.float32)


class FaceIndex:
    """A FAISS index with idempotent add/remove and top-k search returning (scores, ids)."""

    def __init__(self, dimension: int, config: IndexConfig | None = None,
                 force_tombstones: bool = False) -> None:
        self.dimension = dimension
        self.config = config or IndexConfig()
        self.kind = IndexKind.FLAT
        self.nprobe = 0
        self.recall: float | None = None
        self._ids: set[int] = set()
        self._tombstones: set[int] = set()
        self.on_gpu = self.config.use_gpu and gpu_available()
        self._tombstoning = force_tombstones or self.on_gpu
        self._index: Any = self._to_device(_flat(dimension))

    def _to_device(self, index: Any) -> Any:
        if not self.on_gpu:
            return index
        resources = faiss.StandardGpuResources()
        return faiss.index_cpu_to_gpu(resources, 0, index)

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, face_id: int) -> bool:
        return face_id in self._ids

    @property
    def ids(self) -> set[int]:
        return set(self._ids)

    @property
    def has_tombstones(self) -> bool:
        return bool(self._tombstones)

    @property
    def needs_compaction(self) -> bool:
        live = max(len(self._ids), 1)
        return len(self._tombstones) > self.config.compact_fraction * live

    def add(self, ids: Ids, vectors: Vectors) -> int:
        """Add vectors whose ids are not present yet; returns how many were added."""
        ids = np.asarray(ids, dtype=np.int64)
        fresh = np.array([i not in self._ids and i not in self._tombstones for i in ids.tolist()], dtype=bool)
        if not fresh.any():
            return 0
        matrix = np.ascontiguousarray(vectors if fresh.all() else vectors[fresh], dtype=np.float32)
        if matrix.shape[1] != self.dimension:
            raise ValueError(f"vectors have dimension {matrix.shape[1]}, index has {self.dimension}")
        self._index.add_with_ids(matrix, ids[fresh])
        self._ids.update(ids[fresh].tolist())
        return int(fresh.sum())

    def remove(self, ids: Ids) -> int:
        present = [i for i in np.asarray(ids, dtype=np.int64).tolist() if i in self._ids]
        if not present:
            return 0
        if self._tombstoning:
            self._tombstones.update(present)
        else:
            self._index.remove_ids(np.array(present, dtype=np.int64))
        self._ids.difference_update(present)
        return len(present)

    def search(self, queries: Vectors, k: int) -> tuple[Vectors, Ids]:
        """Top-k (scores, ids) per query, best first; missing slots have id -1 and score -inf."""
        queries = np.ascontiguousarray(queries, dtype=np.float32).reshape(-1, self.dimension)
        k = max(1, min(k, len(self._ids)))
        if not self._ids:
            return np.full((len(queries), 0), -np.inf, np.float32), np.full((len(queries), 0), -1, np.int64)
        fetch = k + len(self._tombstones)
        scores, ids = self._index.search(queries, fetch)
        if self._tombstones:
            dead = np.isin(ids, np.fromiter(self._tombstones, dtype=np.int64))
            scores = np.where(dead, -np.inf, scores)
            ids = np.where(dead, -1, ids)
            order = np.argsort(-scores, axis=1, kind="stable")
            scores, ids = np.take_along_axis(scores, order, 1), np.take_along_axis(ids, order, 1)
        scores = np.where(ids < 0, -np.inf, scores)
        return scores[:, :k].astype(np.float32), ids[:, :k].astype(np.int64)

    # --- building -----------------------------------------------------------------------------

    @classmethod
    def build(cls, dimension: int, ids: Ids, vectors: Vectors, config: IndexConfig | None = None,
              force_tombstones: bool = False) -> FaceIndex:
        """A fresh index over these vectors: exact, or IVF when large enough and accurate enough."""
        index = cls(dimension, config, force_tombstones)
        if len(ids) > index.config.exact_max:
            index._try_ivf(ids, vectors)
        if index.kind is IndexKind.FLAT:
            index.add(ids, vectors)
        return index

    def _try_ivf(self, ids: Ids, vectors: Vectors) -> None:
        nlist = int(min(65536, max(16, 4 * math.sqrt(len(ids)))))
        quantizer = faiss.IndexFlatIP(self.dimension)
        ivf = faiss.IndexIVFFlat(quantizer, self.dimension, nlist, faiss.METRIC_INNER_PRODUCT)
        sample = vectors[np.random.default_rng(0).choice(len(vectors), size=min(len(vectors), nlist * 64),
                                                         replace=False)]
        ivf.train(np.ascontiguousarray(sample))
        ivf.add_with_ids(np.ascontiguousarray(vectors), np.asarray(ids, np.int64))
        probes = genuine_probes(vectors, self.config.recall_queries)
        truth = np.asarray(ids, np.int64)[_exact_top10(probes, vectors)]
        budget = max(1, int(self.config.max_scan_fraction * nlist))  # more lists than this: stay exact
        for nprobe in [n for n in _nprobe_steps(nlist) if n <= budget]:
            ivf.nprobe = nprobe
            recall = recall_at_k(ivf.search(probes, 10)[1], truth)
            bound = recall_lower_bound(recall, len(probes))
            if bound >= self.config.target_recall:
                break
        log.info("IVF%d over %d vectors: recall@10 %.4f (lower bound %.4f) at nprobe %d "
                 "(%.0f%% of lists scanned)", nlist, len(ids), recall, bound, nprobe, 100 * nprobe / nlist)
        self.recall = recall
        if bound >= self.config.target_recall:
            self.kind, self.nprobe = IndexKind.IVF, nprobe
            self._index = self._to_device(ivf)
            self._ids = set(np.asarray(ids).tolist())
        else:
            log.warning("staying exact: IVF would need to scan more than %.0f%% of the lists for recall %.3f",
                        100 * self.config.max_scan_fraction, self.config.target_recall)

    # --- snapshots ----------------------------------------------------------------------------

    def save(self, path: Path, seq: int, extra: dict[str, Any] | None = None) -> None:
        """Write the index and its metadata (with the index file's sha256), each atomically.

        Both files are staged under names unique to this writer, then renamed together under an
        exclusive lock on ``<name>.lock``; ``load`` reads the pair under a shared lock, so even two
        processes sharing the folder never pair one save's index with another's metadata.
        """
        cpu = faiss.index_gpu_to_cpu(self._index) if self.on_gpu else self._index
        token = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        staged = path.with_name(f"{path.name}.{token}.partial")
        faiss.write_index(cpu, str(staged))
        _fsync(staged)
        meta = {"seq": seq, "dimension": self.dimension, "kind": self.kind.value, "nprobe": self.nprobe,
                "ids": len(self._ids), "tombstones": sorted(self._tombstones), "sha256": sha256_of(staged),
                **(extra or {})}
        meta_path = path.with_suffix(".json")
        staged_meta = meta_path.with_name(f"{meta_path.name}.{token}.partial")
        staged_meta.write_text(json.dumps(meta))
        _fsync(staged_meta)
        with _pair_lock(path, exclusive=True):
            staged.replace(path)
            staged_meta.replace(meta_path)

    @classmethod
    def load(cls, path: Path, config: IndexConfig | None = None,
             force_tombstones: bool = False) -> tuple[FaceIndex, dict[str, Any]]:
        """Index and metadata from ``save``; raises OSError/ValueError when missing or inconsistent."""
        with _pair_lock(path, exclusive=False):
            meta = json.loads(path.with_suffix(".json").read_text())
            handle = path.open("rb")  # an open file keeps this save's index even if a new one is renamed in
        with handle:
            if not isinstance(meta, dict) or meta.get("sha256") != sha256_of_handle(handle):
                raise ValueError(f"snapshot {path} does not match its metadata (digest differs)")
            handle.seek(0)  # the bytes just hashed are the ones loaded
            reader = faiss.PyCallbackIOReader(handle.read, 1 << 22)  # type: ignore[attr-defined]
            cpu = faiss.read_index(reader)
        index = cls(int(meta["dimension"]), config, force_tombstones)
        index.kind, index.nprobe = IndexKind(meta["kind"]), int(meta["nprobe"])
        if index.kind is IndexKind.IVF:
            faiss.extract_index_ivf(cpu).nprobe = index.nprobe
        # a FLAT snapshot is an IndexIDMap: faiss's stubs type read_index as plain Index (no id_map)
        stored = (faiss.vector_to_array(cpu.id_map)  # type: ignore[attr-defined]
                  if index.kind is IndexKind.FLAT else _ivf_ids(cpu))
        index._tombstones = set(int(i) for i in meta.get("tombstones", []))
        index._ids = set(stored.tolist()) - index._tombstones
        if len(index._ids) != int(meta["ids"]):
            raise ValueError(f"snapshot {path} holds {len(index._ids)} ids, its metadata says {meta['ids']}")
        index._index = index._to_device(cpu)
        return index, meta


def _exact_top10(queries: Vectors, vectors: Vectors, chunk: int = 65536) -> NDArray[np.int64]:
    """Rows of the 10 best inner products per query, by brute force in chunks (no second index)."""
    best_scores = np.full((len(queries), 0), -np.inf, np.float32)
    best_rows = np.zeros((len(queries), 0), np.int64)
    for start in range(0, len(vectors), chunk):
        scores = queries @ vectors[start : start + chunk].T
        rows = np.broadcast_to(np.arange(start, start + scores.shape[1]), scores.shape)
        best_scores = np.concatenate([best_scores, scores], axis=1)
        best_rows = np.concatenate([best_rows, rows], axis=1)
        keep = np.argsort(-best_scores, axis=1, kind="stable")[:, :10]
        best_scores = np.take_along_axis(best_scores, keep, 1)
        best_rows = np.take_along_axis(best_rows, keep, 1)
    return best_rows


@contextlib.contextmanager
def _pair_lock(path: Path, exclusive: bool) -> Iterator[None]:
    """flock on ``<snapshot>.lock`` around the moments the index/metadata pair is renamed or opened.

    A reader that cannot create the lock file (a read-only folder) goes on unlocked; the digest
    check still catches a mixed pair, and the gallery then rebuilds from the database.
    """
    try:
        fd = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        if exclusive:
            raise
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _fsync(path: Path) -> None:
    with path.open("rb") as handle:
        os.fsync(handle.fileno())


def _ivf_ids(index: Any) -> Ids:
    ivf = faiss.extract_index_ivf(index)
    invlists = cast(faiss.InvertedLists, ivf.invlists)  # always set on an index from read_index
    parts = [faiss.rev_swig_ptr(invlists.get_ids(i), invlists.list_size(i)).copy()
             for i in range(ivf.nlist) if invlists.list_size(i)]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
