"""One FAISS index per collection: inner product on L2-normalized vectors, FAISS ids = face ids.

Exact (``IndexFlatIP``) up to ``exact_always`` vectors, and up to ``exact_max`` while the exact scan,
timed at build, is within the p99 target (an exact collection that grows past either bound is chosen
again in the background by ``Gallery``: ``FaissIndex.outgrown``; so is one whose index was measured, at
``reselect_growth`` times the size it was measured at). Otherwise the index is chosen from
measurements on the collection itself (``selection.py``): 4-bit PQ fast-scan or 8-bit
scalar-quantized codes with an exact re-rank from the stored vectors (``refine.py``), or IVF, each
kept only when its recall@10 lower bound and its decision agreement with exact search reach the targets
and it is fast enough; otherwise the collection stays exact. On a GPU (when FAISS reports one) flat and
IVF indexes are copied to it; GPU indexes cannot ``remove_ids``, so removals become tombstones filtered
at search time until the gallery rebuilds the index from the database. A face added again after such a
removal (an identity merged into another: its faces are removed, then added to the other) is held under a
FAISS id of its own (``ALIAS_BASE`` and up), mapped back to its face id, beside its hidden old vector.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import uuid
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path
from typing import Any, BinaryIO, cast

import faiss
import numpy as np
from numpy.typing import NDArray

from facecore.files import sha256_of, sha256_of_handle
from gallery.engines.refine import RefinedIndex
from gallery.engines.selection import (
    IndexConfig,
    Measurement,
    genuine_probes,
    impostor_probes,
    recall_at_k,
    recall_lower_bound,
    select,
    worth_selecting,
)
from gallery.engines.threads import threads_for

__all__ = ["FaceIndex", "IndexConfig", "IndexKind", "Measurement", "genuine_probes", "impostor_probes",
           "recall_at_k", "recall_lower_bound", "remove_stale_partials"]

log = logging.getLogger(__name__)

Ids = NDArray[np.int64]
Vectors = NDArray[np.float32]
#: FAISS ids from here up stand for faces added again while their removed vector is still held (tombstoned).
ALIAS_BASE = 1 << 62


class IndexKind(StrEnum):
    FLAT = "flat"
    IVF = "ivf"
    PQ4FS = "pq4fs"  # 4-bit PQ fast-scan codes + exact re-rank
    PQ4FS_FINE = "pq4fs-fine"  # the same with twice the sub-quantizers: a longer scan, a shorter re-rank
    SQ8 = "sq8"  # 8-bit scalar-quantized codes + exact re-rank

    @property
    def refined(self) -> bool:
        return self in (IndexKind.PQ4FS, IndexKind.PQ4FS_FINE, IndexKind.SQ8)


def gpu_available() -> bool:
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


def _flat(dimension: int) -> Any:
    return faiss.IndexIDMap2(faiss.IndexFlatIP(dimension))


class FaceIndex:
    """A FAISS index with idempotent add/remove and top-k search returning (scores, ids)."""

    def __init__(self, dimension: int, config: IndexConfig | None = None,
                 force_tombstones: bool = False) -> None:
        self.dimension = dimension
        self.config = config or IndexConfig()
        self.kind = IndexKind.FLAT
        self.nprobe = 0  # IVF: lists scanned; refined kinds: re-rank depth (the tuned search effort)
        self.recall: float | None = None
        #: What the build measured (every candidate tried), empty for an exact index never compared.
        self.selection: list[Measurement] = []
        #: Faces when the exact scan was last timed within target (0: never timed).
        self.exact_checked = 0
        #: Faces when the candidates were last measured (0: never; ``selection`` is then empty).
        self.selected_at = 0
        self._ids: set[int] = set()
        #: FAISS ids whose vectors are held but removed (hidden at search time)
        self._tombstones: set[int] = set()
        #: FAISS id -> face id, and back, for faces added again after a tombstoned removal
        self._aliases: dict[int, int] = {}
        self._alias_of: dict[int, int] = {}
        self._next_alias = ALIAS_BASE
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
        """Add vectors whose ids are not present yet; returns how many were added. A face whose removed
        vector is still held (a tombstone) gets a FAISS id of its own, an alias."""
        ids = np.asarray(ids, dtype=np.int64)
        fresh = np.array([i not in self._ids for i in ids.tolist()], dtype=bool)
        if not fresh.any():
            return 0
        matrix = np.ascontiguousarray(vectors if fresh.all() else vectors[fresh], dtype=np.float32)
        if matrix.shape[1] != self.dimension:
            raise ValueError(f"vectors have dimension {matrix.shape[1]}, index has {self.dimension}")
        added = ids[fresh]
        labels = np.array([self._new_alias(i) if i in self._tombstones else i for i in added.tolist()],
                          dtype=np.int64)
        self._index.add_with_ids(matrix, labels)
        self._ids.update(added.tolist())
        return len(added)

    def _new_alias(self, face_id: int) -> int:
        alias, self._next_alias = self._next_alias, self._next_alias + 1
        self._aliases[alias], self._alias_of[face_id] = face_id, alias
        return alias

    def remove(self, ids: Ids) -> int:
        present = [i for i in np.asarray(ids, dtype=np.int64).tolist() if i in self._ids]
        if not present:
            return 0
        labels = [self._alias_of.get(i, i) for i in present]
        if self._tombstoning:
            self._tombstones.update(labels)
        else:
            self._index.remove_ids(np.array(labels, dtype=np.int64))
        for face_id, label in zip(present, labels, strict=True):
            if label != face_id:
                del self._alias_of[face_id], self._aliases[label]
        self._ids.difference_update(present)
        return len(present)

    def search(self, queries: Vectors, k: int) -> tuple[Vectors, Ids]:
        """Top-k (scores, ids) per query, best first; missing slots have id -1 and score -inf."""
        queries = np.ascontiguousarray(queries, dtype=np.float32).reshape(-1, self.dimension)
        k = max(1, min(k, len(self._ids)))
        if not self._ids:
            return np.full((len(queries), 0), -np.inf, np.float32), np.full((len(queries), 0), -1, np.int64)
        fetch = k + len(self._tombstones)
        with threads_for(len(queries), len(queries) * len(self._ids) * self.dimension):
            scores, ids = self._index.search(queries, fetch)
        if self._tombstones:
            dead = np.isin(ids, np.fromiter(self._tombstones, dtype=np.int64))
            scores = np.where(dead, -np.inf, scores)
            ids = np.where(dead, -1, ids)
            order = np.argsort(-scores, axis=1, kind="stable")
            scores, ids = np.take_along_axis(scores, order, 1), np.take_along_axis(ids, order, 1)
        scores = np.where(ids < 0, -np.inf, scores)
        scores, ids = scores[:, :k].astype(np.float32), ids[:, :k].astype(np.int64)
        if self._aliases:
            aliased = ids >= ALIAS_BASE
            ids[aliased] = [self._aliases[i] for i in ids[aliased].tolist()]
        return scores, ids

    # --- building -----------------------------------------------------------------------------

    @classmethod
    def build(cls, dimension: int, ids: Ids, vectors: Vectors, config: IndexConfig | None = None,
              force_tombstones: bool = False, identities: Ids | None = None,
              threshold: float | None = None) -> FaceIndex:
        """A fresh index over these vectors: exact, or the candidate chosen by measurement above
        ``exact_max`` (or above ``exact_always`` when the exact scan misses the p99 target;
        ``identities`` and the collection's ``threshold`` make the decision agreement count identities;
        without them each face is its own identity)."""
        index = cls(dimension, config, force_tombstones)
        measure, exact_p99 = worth_selecting(vectors, index.config)
        if exact_p99 is not None and not measure:
            index.exact_checked = len(ids)  # timed within target at this size
        if measure:
            ids = np.asarray(ids, np.int64)
            chosen, index.selection, _ = select(ids, vectors, identities, threshold, index.config)
            index.selected_at = len(ids)
            if chosen is not None:
                index._adopt(chosen.index, IndexKind(chosen.kind), ids)
            index.recall = next((m.recall for m in index.selection if m.kind == index.kind.value),
                                index.selection[-1].recall if index.selection else None)
        if index.kind is IndexKind.FLAT:
            index.add(ids, vectors)
        return index

    def _adopt(self, built: Any, kind: IndexKind, ids: Ids) -> None:
        self.kind = kind
        self.nprobe = int(built.rerank) if kind.refined else int(built.nprobe)
        self._index = built if kind.refined else self._to_device(built)
        self._ids = set(ids.tolist())

    # --- snapshots ----------------------------------------------------------------------------

    def save(self, path: Path, seq: int, extra: dict[str, Any] | None = None) -> None:
        """Write the index and its metadata (with the index file's sha256), each atomically.

        Both files are staged under names unique to this writer, then renamed together under an
        exclusive lock on ``<name>.lock``; ``load`` reads the pair under a shared lock, so even two
        processes sharing the folder never pair one save's index with another's metadata. The staged files
        hold embeddings: a save that fails (a full disk) removes them, and each is flocked while its writer
        lives, so that ``remove_stale_partials`` deletes those of a writer killed meanwhile, not a live one's.
        """
        token = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        staged = path.with_name(f"{path.name}.{token}.partial")
        meta_path = path.with_suffix(".json")
        staged_meta = meta_path.with_name(f"{meta_path.name}.{token}.partial")
        with _staging(staged) as handle, _staging(staged_meta) as meta_handle:
            if self.kind.refined:
                self._index.write(handle)
            else:
                cpu = faiss.index_gpu_to_cpu(self._index) if self.on_gpu else self._index
                faiss.write_index(cpu, faiss.PyCallbackIOWriter(handle.write))  # type: ignore[attr-defined]
            _fsync(handle)
            meta = {"seq": seq, "dimension": self.dimension, "kind": self.kind.value, "nprobe": self.nprobe,
                    "ids": len(self._ids), "tombstones": sorted(self._tombstones),
                    "aliases": sorted(self._aliases.items()), "sha256": sha256_of(staged),
                    "selection": [m.as_dict() for m in self.selection], "exact_checked": self.exact_checked,
                    "selected_at": self.selected_at, **(extra or {})}
            meta_handle.write(json.dumps(meta).encode())
            _fsync(meta_handle)
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
            kind = IndexKind(meta["kind"])
            cpu = (RefinedIndex.from_file(handle) if kind.refined
                   else faiss.read_index(faiss.PyCallbackIOReader(handle.read, 1 << 22)))  # type: ignore[attr-defined]
        index = cls(int(meta["dimension"]), config, force_tombstones)
        index.kind, index.nprobe = kind, int(meta["nprobe"])
        index.selection = [Measurement(**m) for m in meta.get("selection", [])]
        index.exact_checked = int(meta.get("exact_checked", 0))
        # a snapshot written before the size was recorded: measured again once grown from its size now
        index.selected_at = int(meta.get("selected_at") or (meta["ids"] if index.selection else 0))
        if kind is IndexKind.IVF and not isinstance(cpu, RefinedIndex):
            faiss.extract_index_ivf(cpu).nprobe = index.nprobe
        stored = _stored_ids(cpu, kind)
        index._tombstones = set(int(i) for i in meta.get("tombstones", []))
        index._aliases = {int(alias): int(face) for alias, face in meta.get("aliases", [])}
        index._alias_of = {face: alias for alias, face in index._aliases.items()}
        index._next_alias = max(ALIAS_BASE, int(stored.max()) + 1) if len(stored) else ALIAS_BASE
        index._ids = {index._aliases.get(i, i) for i in set(stored.tolist()) - index._tombstones}
        if len(index._ids) != int(meta["ids"]):
            raise ValueError(f"snapshot {path} holds {len(index._ids)} ids, its metadata says {meta['ids']}")
        if isinstance(cpu, RefinedIndex):  # the snapshot may come from another kind of CPU: measured here
            cpu.pick_lone_kernel(cpu.sample_vectors(40), label=f"snapshot {path}")
        index._index = cpu if kind.refined else index._to_device(cpu)
        return index, meta


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


@contextlib.contextmanager
def _staging(path: Path) -> Iterator[BinaryIO]:
    """A new file at ``path`` (a save's staged copy), flocked while open; deleted when the block raises."""
    handle = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), "w+b")
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        yield handle
    except BaseException:
        path.unlink(missing_ok=True)  # before the lock goes: nobody else deletes it meanwhile
        raise
    finally:
        handle.close()  # closing releases the lock


def remove_stale_partials(folder: Path, pattern: str) -> list[Path]:
    """Delete the staged files (``FaceIndex.save``) matching ``pattern`` in ``folder`` whose writer is gone
    (SIGKILLed mid-save): they hold embeddings, which must not outlive an erasure. A live writer holds a
    lock on each of its own: those are left alone. Returns what was deleted."""
    removed: list[Path] = []
    for staged in sorted(folder.glob(pattern)):
        try:
            fd = os.open(staged, os.O_RDONLY)
        except OSError:  # renamed in place by its writer meanwhile
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # refused while its writer lives
            staged.unlink()
            removed.append(staged)
        except OSError:
            continue
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d staged snapshot files left by writers that are gone: %s", len(removed),
                 ", ".join(p.name for p in removed))
    return removed


def _fsync(handle: BinaryIO) -> None:
    handle.flush()
    os.fsync(handle.fileno())


def _stored_ids(index: Any, kind: IndexKind) -> Ids:
    if kind.refined:
        return cast(Ids, index.live_ids())
    if kind is IndexKind.FLAT:  # an IndexIDMap: faiss's stubs type read_index as plain Index (no id_map)
        return cast(Ids, faiss.vector_to_array(index.id_map))
    return _ivf_ids(index)


def _ivf_ids(index: Any) -> Ids:
    ivf = faiss.extract_index_ivf(index)
    invlists = cast(faiss.InvertedLists, ivf.invlists)  # always set on an index from read_index
    parts = [faiss.rev_swig_ptr(invlists.get_ids(i), invlists.list_size(i)).copy()
             for i in range(ivf.nlist) if invlists.list_size(i)]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
