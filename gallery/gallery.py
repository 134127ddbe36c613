"""The gallery: the database (truth) plus one FAISS index per collection (a cache that follows it).

Indexes follow the change log: ``sync()`` replays every ``face_changes`` row newer than the last one
applied. Writers call it right after their commit; replicas in other processes call it from a
follower thread. Snapshots store an index with the log position it includes, so a restart loads the
snapshot and replays only what is newer. Replay is idempotent, so a crash at any moment (before or
after a commit, during a snapshot) converges to the database.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.typing import ArrayLike, NDArray

from gallery.embeddings import validate_embeddings
from gallery.index import FaceIndex, IndexConfig
from gallery.models import ChangeOp
from gallery.store import Change, CollectionInfo, GalleryStore, check_model

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Candidate:
    identity_id: int
    external_id: str
    name: str
    score: float  # cosine similarity of the identity's best face
    face_id: int


@dataclass(frozen=True)
class SearchResult:
    """Top identities for one query; ``match`` is the best one if it reaches the threshold, else None
    (the person is *unknown*)."""

    candidates: list[Candidate]
    threshold: float

    @property
    def match(self) -> Candidate | None:
        best = self.candidates[0] if self.candidates else None
        return best if best is not None and best.score >= self.threshold else None


@dataclass
class _Collection:
    info: CollectionInfo
    index: FaceIndex
    identity_of: dict[int, int]  # face id -> identity id


class Gallery:
    """Thread-safe: one lock guards the indexes; the database does its own locking."""

    def __init__(self, store: GalleryStore, snapshot_dir: Path | None = None,
                 config: IndexConfig | None = None, force_tombstones: bool = False) -> None:
        self.store = store
        self.snapshot_dir = snapshot_dir
        self.config = config or IndexConfig()
        self._force_tombstones = force_tombstones
        self._collections: dict[int, _Collection] = {}
        self._applied = 0
        self._lock = threading.RLock()
        self._follower: threading.Thread | None = None
        self._stop = threading.Event()
        self._erased: set[str] = set()  # collections with removals not yet in a snapshot
        self.loaded = False

    # --- loading, replay, snapshots -----------------------------------------------------------

    @property
    def applied_seq(self) -> int:
        return self._applied

    def load(self) -> None:
        """Snapshots where valid, else a rebuild from the database; then replay the newer changes."""
        with self._lock:
            start = self.store.last_seq()
            self._collections.clear()
            floor = start
            for info in self.store.list_collections():
                entry, seq = self._load_snapshot(info) or (self._build(info), start)
                self._collections[info.id] = entry
                floor = min(floor, seq)
            self._applied = floor
            self.sync()
            self.loaded = True

    def _snapshot_path(self, info: CollectionInfo) -> Path | None:
        return None if self.snapshot_dir is None else self.snapshot_dir / f"collection-{info.id}.faiss"

    def _load_snapshot(self, info: CollectionInfo) -> tuple[_Collection, int] | None:
        path = self._snapshot_path(info)
        if path is None or not path.exists():
            return None
        try:
            index, meta = FaceIndex.load(path, self.config, self._force_tombstones)
            seq = int(meta["seq"])
            if seq > self.store.last_seq():
                raise ValueError(f"snapshot is at change {seq}, the database only at {self.store.last_seq()} "
                                 "(restored from an older backup?)")
        except (OSError, ValueError, RuntimeError, KeyError, TypeError) as exc:  # malformed metadata too
            log.warning("ignoring snapshot %s: %r", path, exc)
            return None
        if meta.get("embedding_model") != info.embedding_model or index.dimension != info.dimension:
            log.warning("ignoring snapshot %s: made for another model", path)
            return None
        ids, identities, _ = self.store.collection_vectors(info.id, info.dimension)
        mapping = dict(zip(ids.tolist(), identities.tolist(), strict=True))
        return _Collection(info, index, mapping), seq

    def _build(self, info: CollectionInfo) -> _Collection:
        ids, identities, vectors = self.store.collection_vectors(info.id, info.dimension)
        index = FaceIndex.build(info.dimension, ids, vectors, self.config, self._force_tombstones)
        return _Collection(info, index, dict(zip(ids.tolist(), identities.tolist(), strict=True)))

    def rebuild(self, collection: str | None = None) -> None:
        """Recreate indexes from the database (all collections, or one)."""
        with self._lock:
            seq = self.store.last_seq()
            kept = set(self._collections)  # indexes not rebuilt here still need every change after _applied
            for info in self.store.list_collections():
                if collection is None or info.name == collection:
                    self._collections[info.id] = self._build(info)
                    kept.discard(info.id)
            self._applied = min(self._applied, seq) if self.loaded or kept else seq
            self.sync()

    def snapshot(self, collection: str | None = None) -> list[Path]:
        """Persist indexes (all, or one collection's) with the change-log position they include.

        Erased vectors never reach the disk: a tombstoned index is rebuilt from the database first,
        and snapshot files of deleted collections are removed.
        """
        if self.snapshot_dir is None:
            return []
        written = []
        with self._lock:
            self.sync()
            for entry in list(self._collections.values()):
                if collection is not None and entry.info.name != collection:
                    continue
                if entry.index.has_tombstones:
                    entry = self._collections[entry.info.id] = self._build(entry.info)
                path = self.snapshot_dir / f"collection-{entry.info.id}.faiss"
                path.parent.mkdir(parents=True, exist_ok=True)
                entry.index.save(path, self._applied, {"embedding_model": entry.info.embedding_model})
                written.append(path)
            live = {f"collection-{info.id}" for info in self.store.list_collections()}
            for stale in self.snapshot_dir.glob("collection-*"):
                if stale.name.split(".")[0] not in live and stale.suffix in (".faiss", ".json", ".lock"):
                    stale.unlink(missing_ok=True)
        return written

    def snapshot_erasures(self) -> list[Path]:
        """Rewrite the snapshots of collections that lost faces since their last snapshot, so that
        erased vectors do not stay on disk (the gateway calls this a few seconds after deletions)."""
        with self._lock:
            self.sync()
            pending, self._erased = self._erased, set()
        # "" (a dropped collection) matches no index: snapshot("") only removes stale files.
        return [path for name in sorted(pending) for path in self.snapshot(name)]

    def sync(self) -> int:
        """Apply every logged change newer than the last applied one; returns how many."""
        applied = 0
        with self._lock:
            while changes := self.store.changes_since(self._applied):
                self._apply(changes)
                self._applied = changes[-1].seq
                applied += len(changes)
            for entry in list(self._collections.values()):
                if entry.index.needs_compaction:
                    self._collections[entry.info.id] = self._build(entry.info)
        return applied

    def _apply(self, changes: list[Change]) -> None:
        by_collection: dict[int, list[Change]] = defaultdict(list)
        for change in changes:
            if change.op is ChangeOp.DROP:
                self._collections.pop(change.collection_id, None)
                self._erased.add("")  # snapshot("") removes the dropped collection's files
                by_collection.pop(change.collection_id, None)
            else:
                by_collection[change.collection_id].append(change)
        for collection_id, items in by_collection.items():
            entry = self._collections.get(collection_id)
            if entry is None:
                continue  # built lazily from the database when first used
            added = [c.face_id for c in items if c.op is ChangeOp.ADD]
            vectors = self.store.vectors(added, entry.info.dimension) if added else {}
            for change in items:  # in seq order: an add then a remove of the same face ends removed
                if change.op is ChangeOp.ADD and change.face_id in vectors:
                    entry.index.add(np.array([change.face_id]), vectors[change.face_id][None])
                    entry.identity_of[change.face_id] = change.identity_id
                elif change.op is ChangeOp.REMOVE:
                    entry.index.remove(np.array([change.face_id]))
                    entry.identity_of.pop(change.face_id, None)
                    self._erased.add(entry.info.name)

    # --- followers (replicas in other processes) ---------------------------------------------

    def start_follower(self, interval_s: float = 0.2) -> None:
        """Poll the change log in a daemon thread so that other processes' writes become visible."""
        if self._follower is not None:
            return
        self._stop.clear()

        def follow() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self.sync()
                except Exception:  # the database may be briefly unreachable; keep following
                    log.exception("change-log sync failed; retrying")

        self._follower = threading.Thread(target=follow, name="gallery-follower", daemon=True)
        self._follower.start()

    def stop_follower(self) -> None:
        self._stop.set()
        if self._follower is not None:
            self._follower.join(timeout=5)
            self._follower = None

    # --- queries -----------------------------------------------------------------------------

    def _entry(self, collection: str) -> _Collection:
        with self._lock:
            for entry in self._collections.values():
                if entry.info.name == collection:
                    return entry
        info = self.store.get_collection(collection)  # raises NotFound
        self.sync()
        with self._lock:
            if info.id not in self._collections:
                self._collections[info.id] = self._build(info)
            return self._collections[info.id]

    def sizes(self) -> dict[str, int]:
        """Faces per loaded collection index, by collection name."""
        with self._lock:
            return {entry.info.name: len(entry.index) for entry in self._collections.values()}

    def size(self, collection: str) -> int:
        return len(self._entry(collection).index)

    def face_ids(self, collection: str) -> set[int]:
        return self._entry(collection).index.ids

    def cached_info(self, collection: str) -> CollectionInfo | None:
        """The collection as this gallery holds it, without touching the database or the lock
        (None when not loaded here yet). Safe from the event loop: copying the dict's values is atomic."""
        entries = list(self._collections.values())
        return next((entry.info for entry in entries if entry.info.name == collection), None)

    def collection_info(self, collection: str) -> CollectionInfo:
        """The collection, loading its index first when needed; ``NotFound`` when it does not exist."""
        return self._entry(collection).info

    def search(self, collection: str, queries: ArrayLike, k: int = 5, threshold: float | None = None,
               embedding_model: str | None = None, exclude: AbstractSet[int] = frozenset()
               ) -> list[SearchResult]:
        """Top-k identities (best face each) per query, with the match decision at ``threshold``
        (default: the collection's). With ``embedding_model``, queries of another model are refused.
        Faces whose ids are in ``exclude`` are left out (search by a stored face)."""
        if k < 1:
            raise ValueError("k must be >= 1")
        entry = self._entry(collection)
        info = entry.info
        if embedding_model is not None:
            check_model(info, embedding_model)
        matrix = validate_embeddings(queries, info.dimension)
        with self._lock:
            best = [self._best_identities(entry, query, k, exclude) for query in matrix]
        labels = self.store.identity_labels(i for row in best for i, _, _ in row)
        limit = info.match_threshold if threshold is None else float(threshold)
        return [SearchResult([Candidate(i, *labels.get(i, ("", "")), score=s, face_id=f) for i, s, f in row
                              if i in labels], limit) for row in best]

    def _best_identities(self, entry: _Collection, query: NDArray[np.float32], k: int,
                         exclude: AbstractSet[int] = frozenset()) -> list[tuple[int, float, int]]:
        """Exact per-identity aggregation: widen the face search until k identities are certain."""
        total = len(entry.index)
        fetch = min(total, max(4 * k, 32) + len(exclude))
        while True:
            scores, ids = entry.index.search(query[None], fetch)
            best: dict[int, tuple[float, int]] = {}
            for score, face_id in zip(scores[0].tolist(), ids[0].tolist(), strict=True):
                identity = entry.identity_of.get(face_id)
                if face_id >= 0 and identity is not None and identity not in best and face_id not in exclude:
                    best[identity] = (score, face_id)
            if len(best) >= k or fetch >= total:
                ranked = sorted(best.items(), key=lambda item: (-item[1][0], item[0]))[:k]
                return [(identity, score, face) for identity, (score, face) in ranked]
            fetch = min(total, fetch * 4)

    def require_model(self, collection: str, embedding_model: str) -> CollectionInfo:
        info = self.collection_info(collection)
        check_model(info, embedding_model)
        return info
