"""The gallery: the database (truth) plus one index per collection in an engine (a copy that follows it).

Indexes follow the change log: ``sync()`` replays every ``face_changes`` row newer than the last one
applied. Writers call it right after their commit; replicas in other processes call it from a
follower thread. Persisted indexes (FAISS snapshots, or the Milvus collections with the position
recorded in Milvus) include a log position, so a restart replays only what is newer. Replay is
idempotent, so a crash at any moment (before or after a commit, during a snapshot) converges to the
database. The engine (``gallery/engines.py``) is FAISS in this process or a shared Milvus server.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Set as AbstractSet
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from itertools import groupby
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from facecore.periodic import Periodic
from facecore.settings import Settings
from gallery.batching import SearchBatcher
from gallery.embeddings import validate_embeddings
from gallery.engines import CollectionIndex, Engine, FaissEngine, IndexInfo, make_engine
from gallery.errors import InvalidEmbedding
from gallery.index import IndexConfig
from gallery.models import ChangeOp
from gallery.store import Change, CollectionInfo, GalleryStore, check_model
from gallery.threads import at_low_priority

log = logging.getLogger(__name__)

#: Names the database lock under which one process at a time applies the log to a shared engine.
ENGINE_LOCK = 0x6661636574
#: A search of at most this many multiply-adds (queries x faces x dimension, the exact scan's) is answered
#: by ``search_inline`` on the calling thread: about 0.1 ms, less than the hop to a worker thread costs.
INLINE_WORK = 1 << 20
#: Identity labels remembered at most; past it the memory starts again empty.
MAX_LABELS = 100_000
#: How a background index selection ends: the new index took over; the collection was dropped, re-embedded
#: or rebuilt meanwhile (the new index was thrown away); or it raised (tried again after RESELECT_RETRY_S).
RESELECT_OUTCOMES = ("chosen", "outdated", "failed")
#: After a background index selection failed, seconds before the collection's next one.
RESELECT_RETRY_S = 600.0


def _depth(k: int) -> int:
    """Faces a first search fetches for ``k`` identities (widened later when too few identities)."""
    return max(4 * k, 32)


def _identities(best: list[list[tuple[int, float, int]]]) -> set[int]:
    return {identity for row in best for identity, _, _ in row}


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
    index: CollectionIndex
    #: held while the index is searched or changed (adds, removes, a dropped collection forgotten), not
    #: while it is written to a snapshot (a read: changes wait for the gallery's lock, held by the snapshot)
    lock: threading.RLock = field(default_factory=threading.RLock)

    def search(self, queries: NDArray[np.float32], k: int) -> tuple[NDArray[Any], ...]:
        """The index's search, under the lock (what ``SearchBatcher`` runs: a call serves only requests
        that found this entry)."""
        with self.lock:
            return self.index.search(queries, k)


def open_gallery(store: GalleryStore, settings: Settings, snapshot_dir: Path | None = None) -> Gallery:
    """The gallery the settings describe: its engine (FAISS or Milvus) and its request batching
    (``snapshot_dir`` overrides the settings' one)."""
    config = IndexConfig(exact_max=settings.gallery.exact_max,
                         reselect_growth=settings.gallery.reselect_growth)
    folder = snapshot_dir or settings.gallery.snapshot_dir
    engine = make_engine(settings.gallery, folder, config)
    return Gallery(store, folder, config, engine=engine,
                   batcher=SearchBatcher(settings.gallery.batch_window_ms / 1000))


class Gallery:
    """Thread-safe. The gallery's lock orders what changes the set of indexes and what they hold (syncs,
    loads, rebuilds, snapshots); each collection's own lock is held while its index is searched or
    changed, so a search waits only for a change to its own index, never for a database read, another
    collection's search or a snapshot being written; the labels have a lock of their own. The database
    does its own locking.

    ``engine`` holds the vectors (default: FAISS in this process, with snapshots in ``snapshot_dir``);
    ``batcher`` gathers concurrent searches of one collection into one engine call.
    """

    def __init__(self, store: GalleryStore, snapshot_dir: Path | None = None,
                 config: IndexConfig | None = None, force_tombstones: bool = False,
                 engine: Engine | None = None, batcher: SearchBatcher | None = None) -> None:
        self.store = store
        self.snapshot_dir = snapshot_dir
        self.config = config or IndexConfig()
        self.engine: Engine = engine or FaissEngine(snapshot_dir, self.config, force_tombstones)
        self.batcher = batcher or SearchBatcher()
        self._collections: dict[int, _Collection] = {}
        self._applied = 0
        #: the last sync ran to its end (a failed one, e.g. Milvus not recording its position, is run
        #: again in full by the next, new changes or not)
        self._settled = False
        self._lock = threading.RLock()
        self._follower = Periodic("gallery-follower", self.sync, "change-log sync failed")
        self._erased: set[str] = set()  # collections with removals not yet persisted
        #: (external_id, name) by identity id, as the database had them; the change log says when to read
        #: one again (removed faces, a relabel, a dropped collection); bumped generations refuse reads
        #: that began before such a change was applied
        self._labels: dict[int, tuple[str, str]] = {}
        self._label_generation = 0
        self._labels_lock = threading.Lock()
        self.loaded = False
        #: collections whose index is being chosen again in the background (they outgrew exact search),
        #: and when such a choice last failed (tried again only after ``RESELECT_RETRY_S``)
        self._reselecting: dict[int, threading.Thread] = {}
        self._reselect_failed: dict[int, float] = {}
        #: Background selections finished, by outcome (``RESELECT_OUTCOMES``).
        self._reselections: dict[str, int] = dict.fromkeys(RESELECT_OUTCOMES, 0)
        #: the process is stopping (``close``): a background selection that fails is abandoned, not an error
        self._closing = False

    # --- loading, replay, snapshots -----------------------------------------------------------

    @property
    def applied_seq(self) -> int:
        return self._applied

    def _exclusive(self) -> AbstractContextManager[object]:
        """A shared engine is changed by one process at a time (a lock in the database)."""
        return self.store.db.exclusive(ENGINE_LOCK) if self.engine.shared else nullcontext()

    def load(self) -> None:
        """Persisted indexes where valid, else a rebuild from the database; then the newer changes."""
        with self._lock, self._exclusive():
            start = self.store.last_seq()
            self._collections.clear()
            floor = start
            for info in self.store.list_collections():
                entry, seq = self._open(info, start) or (self._build(info), start)
                self._collections[info.id] = entry
                floor = min(floor, seq)
            self._applied = floor
            self.sync()
            if self.engine.shared:
                self.engine.record(self._applied)  # every collection now includes the log up to here
            self._erased.add("")  # what the engine stores of collections dropped meanwhile, snapshots unused
            self.loaded = True

    def _open(self, info: CollectionInfo, last: int) -> tuple[_Collection, int] | None:
        def faces() -> tuple[NDArray[np.int64], NDArray[np.int64]]:
            return self.store.collection_identities(info.id)

        opened = self.engine.open(info, faces)
        if opened is None:
            return None
        index, seq = opened
        if seq > last:
            log.warning("ignoring the persisted index of %s: it is at change %d, the database only at %d "
                        "(restored from an older backup?)", info.name, seq, last)
            if not self.engine.shared:  # a snapshot: deleted at the next prune (once the log grew past its
                self.engine.forget(info.id)  # position, a restart would take it for valid)
                self._erased.add("")
            return None
        return _Collection(info, index), seq

    def _build(self, info: CollectionInfo) -> _Collection:
        ids, identities, vectors = self.store.collection_vectors(info.id, info.dimension)
        return _Collection(info, self.engine.build(info, ids, identities, vectors))

    def rebuild(self, collection: str | None = None) -> None:
        """Recreate indexes from the database (all collections, or one)."""
        with self._lock, self._exclusive():
            seq = self.store.last_seq()
            kept = set(self._collections)  # indexes not rebuilt here still need every change after _applied
            for info in self.store.list_collections():
                if collection is None or info.name == collection:
                    self._collections[info.id] = self._build(info)
                    kept.discard(info.id)
            self._applied = min(self._applied, seq) if self.loaded or kept else seq
            self.sync()

    def snapshot(self, collection: str | None = None, erased: bool = False) -> list[Path]:
        """Persist indexes (all, or one collection's) with the change-log position they include.

        Erased vectors never reach the disk: a tombstoned index is rebuilt from the database first,
        and what the engine stored of deleted collections (and of forgotten ones: re-embedded, or changed
        while not loaded here) is removed.
        """
        written: list[str] = []
        with self._lock:
            self.sync()
            with self._exclusive():
                for entry in list(self._collections.values()):
                    if collection is not None and entry.info.name != collection:
                        continue
                    if entry.index.has_tombstones:
                        entry = self._collections[entry.info.id] = self._build(entry.info)
                    written += self.engine.persist(entry.index, entry.info, self._applied, erased)
                self.engine.prune({info.id for info in self.store.list_collections()})
        return [Path(p) for p in written]

    def snapshot_erasures(self) -> list[Path]:
        """Persist the collections that lost faces since they were last persisted, so that erased
        vectors do not stay in storage (the gateway calls this a few seconds after deletions)."""
        with self._lock:
            self.sync()
            pending, self._erased = self._erased, set()
        written: list[Path] = []
        names = sorted(pending)
        for number, name in enumerate(names):
            try:
                written += self.snapshot(name, erased=True)  # "" (a dropped collection): only prunes
            except BaseException:
                with self._lock:  # the erased vectors are still on disk: tried again at the next call
                    self._erased.update(names[number:])
                raise
        return written

    def sync(self) -> int:
        """Apply every logged change newer than the last applied one; returns how many.

        A shared engine records its own position: changes another process already applied to it are
        only noted here (a dropped collection forgotten), not applied again."""
        if self._settled and self._nothing_new():
            return 0
        applied = 0
        with self._lock, self._exclusive():
            self._settled = False
            engine_at = self.engine.position() if self.engine.shared else None
            start = self._applied if engine_at is None else min(self._applied, engine_at)
            while changes := self.store.changes_since(start):
                self._apply(changes, self._applied if engine_at is None else engine_at)
                start = self._applied = changes[-1].seq
                engine_at = None if engine_at is None else max(engine_at, start)
                applied += len(changes)
            if self.engine.shared and applied:
                self.engine.record(self._applied)
            for entry in list(self._collections.values()):
                if entry.index.stale:
                    self._collections[entry.info.id] = self._build(entry.info)
                elif entry.index.outgrown and self._may_reselect(entry.info.id):
                    self._reselect_later(entry)
            self._settled = True
        return applied

    def _nothing_new(self) -> bool:
        """True when the change log holds nothing after the change this process applied last and no index
        waits to be rebuilt or chosen again: what a follower finds nearly every time. The log is read
        without the lock, so searches are not held up by the read, and without the shared engine's lock
        and position, so an idle gateway on Milvus asks neither the database's lock nor Milvus anything
        (on PostgreSQL and milvus-lite an idle interval took 4.9 ms, 3.0 ms of it CPU, when it took both;
        0.8 ms and 0.5 ms this way)."""
        if self.store.changes_since(self._applied, limit=1):
            return False
        with self._lock:
            return not any(entry.index.stale or (entry.index.outgrown and self._may_reselect(entry.info.id))
                           for entry in self._collections.values())

    def _may_reselect(self, collection_id: int) -> bool:
        failed = self._reselect_failed.get(collection_id)
        return collection_id not in self._reselecting and (
            failed is None or time.monotonic() - failed >= RESELECT_RETRY_S)

    def _reselect_later(self, entry: _Collection) -> None:
        """Choose ``entry``'s index again in a background thread (called under the lock) when its
        collection grew (by enrollments or an import) past the size its index was chosen for
        (``FaissIndex.outgrown``): an exact collection past ``exact_max``, or to twice the size its exact
        scan was timed at, instead of staying an exact scan (100 ms per query at 1M x 128 on 2 cores); a
        measured one to ``reselect_growth`` times the size it was measured at, whose re-rank depth or
        nprobe may no longer reach the targets. Searches go on against the current index meanwhile."""
        thread = threading.Thread(target=self._reselect, args=(entry,), name=f"reselect-{entry.info.id}",
                                  daemon=True)
        self._reselecting[entry.info.id] = thread
        thread.start()

    def _reselect(self, entry: _Collection) -> None:
        info, began = entry.info, time.perf_counter()
        try:
            with self._lock:
                since = self._applied  # the vectors read below include at least every change up to here
            log.info("collection %s grew past the size its index was chosen for (%d faces): choosing it "
                     "again in the background", info.name, len(entry.index))

            def build() -> CollectionIndex:
                ids, identities, vectors = self.store.collection_vectors(info.id, info.dimension)
                return self.engine.build(info, ids, identities, vectors)

            built = at_low_priority(build)  # the requests served meanwhile go first (gallery/threads.py)
            with self._lock:
                if self._collections.get(info.id) is not entry:
                    self._reselections["outdated"] += 1
                    return  # dropped, re-embedded or rebuilt meanwhile: this build is out of date
                start, fresh = since, _Collection(info, built)
                while start < self._applied and (changes := self.store.changes_since(start)):
                    mine = [c for c in changes if c.seq <= self._applied and c.collection_id == info.id]
                    if not self._apply_to(fresh, [c for c in mine if c.op is not ChangeOp.RELABEL]):
                        self._reselections["outdated"] += 1
                        return  # re-embedded meanwhile: its DROP, not applied yet, drops the current index
                    start = changes[-1].seq
                self._collections[info.id] = fresh
                self._erased.add(info.name)  # persisted within seconds: a restart loads the new kind
                self._reselections["chosen"] += 1
            log.info("collection %s: new index in %.1f s (%d faces)", info.name, time.perf_counter() - began,
                     len(built))
        except Exception:  # the current index keeps serving; tried again after RESELECT_RETRY_S
            if self._closing:  # e.g. the index's search threads were shut down with the interpreter under it
                log.info("collection %s: choosing its index again was abandoned: the process is stopping "
                         "(it starts again at the next start)", info.name)
                return
            log.exception("choosing the index of collection %s again failed", info.name)
            with self._lock:
                self._reselect_failed[info.id] = time.monotonic()
                self._reselections["failed"] += 1
        finally:
            with self._lock:
                self._reselecting.pop(info.id, None)

    def reselection_state(self) -> tuple[int, dict[str, int]]:
        """Collections whose index is being chosen again in the background now, and the selections
        finished so far by outcome (``RESELECT_OUTCOMES``): for the metrics, read on the event loop, so
        without the lock (``sizes``; ``len`` and copying a dict are atomic)."""
        return len(self._reselecting), dict(self._reselections)

    def join_reselections(self, timeout: float | None = None) -> None:
        """Wait for the background index selections under way (tests, shutdown)."""
        for thread in list(self._reselecting.values()):
            thread.join(timeout)

    def _apply(self, changes: list[Change], engine_at: int) -> None:
        """Apply ``changes`` in order; those at or below ``engine_at`` are already in the engine."""
        by_collection: dict[int, list[Change]] = defaultdict(list)
        self._forget_labels(changes)
        for change in changes:
            if change.op is ChangeOp.RELABEL:
                continue  # the engines hold no labels
            if change.op is ChangeOp.DROP:
                dropped = self._collections.pop(change.collection_id, None)
                if change.seq > engine_at:
                    with dropped.lock if dropped is not None else nullcontext():  # searches under way end
                        self.engine.forget(change.collection_id)
                self._erased.add("")  # snapshot("") prunes the dropped collection's files
                by_collection.pop(change.collection_id, None)
            elif change.seq > engine_at:
                by_collection[change.collection_id].append(change)
        unopened = by_collection.keys() - self._collections.keys()
        if self.engine.shared and unopened:
            self._open_held(unopened)
        for collection_id, items in by_collection.items():
            entry = self._collections.get(collection_id)
            if entry is not None:
                if not self._apply_to(entry, items):
                    self._collections.pop(collection_id)  # built from the database when first used
            elif not self.engine.shared and any(c.op is ChangeOp.REMOVE for c in items):
                # built lazily from the database when first used; a snapshot of it (written before a re-embed,
                # or by another process sharing the folder) holds the removed vectors: deleted with the
                # dropped collections' (a shared engine holds no collection left unopened by _open_held)
                self.engine.forget(collection_id)
                self._erased.add("")

    def _open_held(self, collection_ids: AbstractSet[int]) -> None:
        """Open those of these collections that the shared engine holds (built by another process) so that
        the changes being applied reach them: the position recorded next covers every collection the engine
        holds, so a process that skipped one would lose its changes for every process. Called under the lock
        and the engine's."""
        last = self.store.last_seq()
        for info in self.store.list_collections():
            if info.id in collection_ids and (opened := self._open(info, last)) is not None:
                self._collections[info.id] = opened[0]

    def _apply_to(self, entry: _Collection, items: list[Change]) -> bool:
        """Apply one collection's adds and removes, in order, to its index (the vectors added are read
        from the database first, outside the index's lock). False, with nothing applied, when the entry is
        out of date: the faces added hold vectors of another dimension, the collection re-embedded since
        (its DROP further on in the log, beyond the batch of changes being applied)."""
        info, index = entry.info, entry.index
        added = [c.face_id for c in items if c.op is ChangeOp.ADD]
        try:
            vectors = self.store.vectors(added, info.dimension) if added else {}
        except InvalidEmbedding:
            if not self._reembedded(info):
                raise
            log.info("collection %s was re-embedded: its index is built again from the database", info.name)
            return False
        # in seq order, a run of adds or of removes at a time: an add then a remove of the same
        # face ends removed (a face whose row is gone, removed later in the log, is not added)
        with entry.lock:
            for op, run in groupby(items, key=lambda c: c.op):
                if op is ChangeOp.ADD:
                    adds = [c for c in run if c.face_id in vectors]
                    if adds:
                        index.add(np.array([c.face_id for c in adds]),
                                  np.array([c.identity_id for c in adds]),
                                  np.stack([vectors[c.face_id] for c in adds]))
                elif op is ChangeOp.REMOVE:
                    index.remove(np.array([c.face_id for c in run]))
                    self._erased.add(info.name)
        return True

    def _reembedded(self, info: CollectionInfo) -> bool:
        """The database holds the collection with another model or dimension than ``info`` (or no more)."""
        current = next((c for c in self.store.list_collections() if c.id == info.id), None)
        return current is None or (current.embedding_model, current.dimension) != (info.embedding_model,
                                                                                   info.dimension)

    def _forget_labels(self, changes: list[Change]) -> None:
        """Labels these changes may have made wrong: the identity's (faces removed, possibly with it, or a
        relabel), every one on a dropped collection. Called under the lock."""
        stale = {c.identity_id for c in changes if c.op in (ChangeOp.REMOVE, ChangeOp.RELABEL)}
        dropped = any(c.op is ChangeOp.DROP for c in changes)
        if not stale and not dropped:
            return
        with self._labels_lock:
            if dropped:
                self._labels.clear()
            for identity in stale:
                self._labels.pop(identity, None)
            self._label_generation += 1  # a read begun before these changes may hold what they replaced

    def _labels_for(self, identity_ids: AbstractSet[int]) -> dict[int, tuple[str, str]]:
        """(external_id, name) of these identities: remembered ones, the rest from the database (an
        identity deleted there is left out)."""
        with self._labels_lock:
            known = {i: self._labels[i] for i in identity_ids if i in self._labels}
            generation = self._label_generation
        missing = identity_ids - known.keys()
        if missing:
            read = self.store.identity_labels(missing)
            with self._labels_lock:
                if generation == self._label_generation:  # no change to labels applied meanwhile
                    if len(self._labels) + len(read) > MAX_LABELS:
                        self._labels.clear()
                    self._labels.update(read)
            known.update(read)
        return known

    # --- followers (replicas in other processes) ---------------------------------------------

    def start_follower(self, interval_s: float = 0.2) -> None:
        """Poll the change log in a daemon thread so that other processes' writes become visible."""
        self._follower.start(interval_s)

    def stop_follower(self) -> None:
        self._follower.stop()

    def close(self) -> None:
        """At shutdown: stop following the change log; a background selection of an index still under way
        (minutes at a million faces, not waited for) ends without a result and is logged as abandoned, not
        as a failure (the process's thread pools, the index's search threads among them, are shut down
        under it at exit). The next start chooses again: the collection is still past its size."""
        self._closing = True
        self.stop_follower()

    # --- queries -----------------------------------------------------------------------------

    def _entry(self, collection: str) -> _Collection:
        entry = self._loaded(collection)
        if entry is not None:
            return entry
        self.store.get_collection(collection)  # raises NotFound
        self.sync()
        with self._lock, self._exclusive():
            # read again with the log applied: a collection deleted (a new one of its name created) or
            # re-embedded meanwhile, its DROP applied by that sync, would be built as it was, and kept
            info = self.store.get_collection(collection)
            if info.id not in self._collections:
                last = self.store.last_seq()
                opened = self._open(info, last) if self.engine.shared else None  # built by another process
                self._collections[info.id] = opened[0] if opened else self._build(info)
            return self._collections[info.id]

    def sizes(self) -> dict[str, int]:
        """Faces per loaded collection index, by collection name. Without the lock (copying the dict's
        values is atomic): the event loop calls it (metrics, the collection list), and the lock can be held
        for seconds (a snapshot of a million faces being written, an index rebuilt)."""
        return {entry.info.name: len(entry.index) for entry in list(self._collections.values())}

    def size(self, collection: str) -> int:
        return len(self._entry(collection).index)

    def describe(self, collection: str) -> tuple[IndexInfo, bool]:
        """The collection's index (``CollectionIndex.describe``), and whether a new one is being chosen for
        it in the background (``FaissIndex.outgrown``)."""
        entry = self._entry(collection)
        described = entry.index.describe()  # Milvus counts its rows: not under the lock
        with self._lock:
            return described, entry.info.id in self._reselecting

    def face_ids(self, collection: str) -> set[int]:
        return self._entry(collection).index.face_ids()

    def face_identities(self, collection: str) -> dict[int, int]:
        """face id -> identity id as the index holds them."""
        return self._entry(collection).index.identities()

    def cached_info(self, collection: str) -> CollectionInfo | None:
        """The collection as this gallery holds it, without touching the database or the lock
        (None when not loaded here yet). Safe from the event loop: copying the dict's values is atomic."""
        entry = self._loaded(collection)
        return None if entry is None else entry.info

    def _loaded(self, collection: str) -> _Collection | None:
        """The collection's entry when this gallery holds it, without the lock (copying the dict's values
        is atomic)."""
        return next((e for e in list(self._collections.values()) if e.info.name == collection), None)

    def collection_info(self, collection: str) -> CollectionInfo:
        """The collection, loading its index first when needed; ``NotFound`` when it does not exist."""
        return self._entry(collection).info

    def search(self, collection: str, queries: ArrayLike, k: int = 5, threshold: float | None = None,
               embedding_model: str | None = None, exclude: AbstractSet[int] = frozenset()
               ) -> list[SearchResult]:
        """Top-k identities (best face each) per query, with the match decision at ``threshold``
        (default: the collection's). With ``embedding_model``, queries of another model are refused.
        Faces whose ids are in ``exclude`` are left out (search by a stored face). Concurrent calls on
        one collection that found the same index are searched together (``batcher``)."""
        if k < 1:
            raise ValueError("k must be >= 1")
        entry = self._entry(collection)
        info = entry.info
        if embedding_model is not None:
            check_model(info, embedding_model)
        matrix = validate_embeddings(queries, info.dimension)
        fetch = _depth(k) + len(exclude)
        # batched only with requests that found this entry: the collection's index may have been replaced
        first = self.batcher.search(info.id, matrix, fetch, entry.search)
        best = self._ranked(entry, matrix, k, exclude, first)
        return self._results(best, self._labels_for(_identities(best)), info, threshold)

    def search_inline(self, collection: str, queries: ArrayLike, k: int = 5, threshold: float | None = None
                      ) -> list[SearchResult] | None:
        """``search`` on the calling thread (the event loop), or None when it cannot answer at once: the
        engine is not in this process, the collection is not loaded here, the search is larger than
        ``INLINE_WORK``, the index is being searched or changed in another thread, or a label is not
        remembered. Then ``search`` (in a worker thread) answers, and remembers the labels."""
        if self.engine.shared or k < 1:
            return None
        entry = self._loaded(collection)
        if entry is None:
            return None
        info = entry.info
        matrix = validate_embeddings(queries, info.dimension)
        fetch = _depth(k)
        if matrix.shape[0] * max(len(entry.index), fetch) * info.dimension > INLINE_WORK:
            return None
        if not entry.lock.acquire(blocking=False):
            return None
        try:
            if self._collections.get(info.id) is not entry:
                return None  # replaced while this call looked
            best = self._ranked(entry, matrix, k, frozenset(), entry.index.search(matrix, fetch))
        finally:
            entry.lock.release()
        wanted = _identities(best)
        if not self._labels_lock.acquire(blocking=False):
            return None
        try:
            if not wanted <= self._labels.keys():
                return None
            labels = {i: self._labels[i] for i in wanted}
        finally:
            self._labels_lock.release()
        return self._results(best, labels, info, threshold)

    def _ranked(self, entry: _Collection, matrix: NDArray[np.float32], k: int, exclude: AbstractSet[int],
                first: tuple[NDArray[Any], ...]) -> list[list[tuple[int, float, int]]]:
        """(identity, score, face) of the best ``k`` identities per query, from a first search's rows."""
        return [self._best_identities(entry, query, k, exclude, [a[row:row + 1] for a in first])
                for row, query in enumerate(matrix)]

    @staticmethod
    def _results(best: list[list[tuple[int, float, int]]], labels: dict[int, tuple[str, str]],
                 info: CollectionInfo, threshold: float | None) -> list[SearchResult]:
        limit = info.match_threshold if threshold is None else float(threshold)
        return [SearchResult([Candidate(i, *labels[i], score=s, face_id=f) for i, s, f in row if i in labels],
                             limit) for row in best]

    def _best_identities(self, entry: _Collection, query: NDArray[np.float32], k: int,
                         exclude: AbstractSet[int], first: list[NDArray[Any]]
                         ) -> list[tuple[int, float, int]]:
        """Exact per-identity aggregation: widen the face search until k identities are certain. The
        index's size is asked only when a search came back full without k identities: on Milvus it is a
        query of its own (``count(*)``), which every identify used to make. Each widening fetches more than
        the last, at least a first search's depth (a first search of an index empty then, filled since,
        came back with no column), so the loop ends by the index's size at the latest."""
        fetch = first[1].shape[1]
        scores, ids, owners = first
        total: int | None = None
        while True:
            best: dict[int, tuple[float, int]] = {}
            for score, face_id, identity in zip(scores[0].tolist(), ids[0].tolist(), owners[0].tolist(),
                                                strict=True):
                if face_id >= 0 and identity >= 0 and identity not in best and face_id not in exclude:
                    best[identity] = (score, face_id)
            # fewer than k identities in a full answer (fewer faces than asked for: the index holds no more)
            if len(best) < k and int((ids[0] >= 0).sum()) >= fetch:
                total = len(entry.index) if total is None else total
                if fetch < total:
                    fetch = min(total, max(fetch * 4, _depth(k) + len(exclude)))
                    with entry.lock:
                        scores, ids, owners = entry.index.search(query[None], fetch)
                    continue
            ranked = sorted(best.items(), key=lambda item: (-item[1][0], item[0]))[:k]
            return [(identity, score, face) for identity, (score, face) in ranked]

    def require_model(self, collection: str, embedding_model: str) -> CollectionInfo:
        info = self.collection_info(collection)
        check_model(info, embedding_model)
        return info
