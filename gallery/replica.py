"""A replica of the database's faces in an engine: one index per collection, following the change log.

``sync()`` replays every ``face_changes`` row newer than the last one applied. Writers call it right after
their commit; replicas in other processes call it from a follower thread. Persisted indexes (FAISS
snapshots, or the Milvus collections with the position recorded in Milvus) include a log position, so a
restart replays only what is newer. Replay is idempotent, so a crash at any moment (before or after a
commit, during a snapshot) converges to the database.

Locks: the replica's lock orders what changes the set of indexes and what they hold (syncs, loads,
rebuilds, snapshots); each collection's own lock is held while its index is searched or changed, so a
search waits only for a change to its own index, never for a database read, another collection's search
or a snapshot being written. The database does its own locking.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Set as AbstractSet
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

from gallery.engines.base import CollectionIndex, Engine
from gallery.errors import InvalidEmbedding
from gallery.labels import Labels
from gallery.store.models import ChangeOp
from gallery.store.store import Change, CollectionInfo, GalleryStore

log = logging.getLogger(__name__)

#: Names the database lock under which one process at a time applies the log to a shared engine.
ENGINE_LOCK = 0x6661636574


@dataclass
class CollectionEntry:
    info: CollectionInfo
    index: CollectionIndex
    #: held while the index is searched or changed (adds, removes, a dropped collection forgotten), not
    #: while it is written to a snapshot (a read: changes wait for the replica's lock, held by the snapshot)
    lock: threading.RLock = field(default_factory=threading.RLock)

    def search(self, queries: NDArray[np.float32], k: int) -> tuple[NDArray[Any], ...]:
        """The index's search, under the lock (what ``SearchBatcher`` runs: a call serves only requests
        that found this entry)."""
        with self.lock:
            return self.index.search(queries, k)


class Upkeep(Protocol):
    """Work a replica's sync starts in the background for a collection that needs it (its index chosen
    again: ``gallery.reselection``; its scores measured again: ``gallery.recalibration``)."""

    def due(self, entry: CollectionEntry) -> bool: ...

    def start(self, entry: CollectionEntry) -> None:
        """Begin the work (called under the replica's lock)."""
        ...


class Replica:
    """Thread-safe; see the module's note on locks."""

    def __init__(self, store: GalleryStore, engine: Engine) -> None:
        self.store, self.engine = store, engine
        self.collections: dict[int, CollectionEntry] = {}
        self.applied = 0
        #: the last sync ran to its end (a failed one, e.g. Milvus not recording its position, is run
        #: again in full by the next, new changes or not)
        self._settled = False
        self.lock = threading.RLock()
        #: collections with removals not yet persisted ("": dropped collections' files to prune)
        self.erased: set[str] = set()
        self.labels = Labels(store)
        self.upkeep: list[Upkeep] = []
        self.loaded = False

    def exclusive(self) -> AbstractContextManager[object]:
        """A shared engine is changed by one process at a time (a lock in the database)."""
        return self.store.db.exclusive(ENGINE_LOCK) if self.engine.shared else nullcontext()

    def load(self) -> None:
        """Persisted indexes where valid, else a rebuild from the database; then the newer changes."""
        with self.lock, self.exclusive():
            start = self.store.last_seq()
            self.collections.clear()
            floor = start
            for info in self.store.list_collections():
                entry, seq = self._open(info, start) or (self.build(info), start)
                self.collections[info.id] = entry
                floor = min(floor, seq)
            self.applied = floor
            self.sync()
            if self.engine.shared:
                self.engine.record(self.applied)  # every collection now includes the log up to here
            self.erased.add("")  # what the engine stores of collections dropped meanwhile, snapshots unused
            self.labels.learn()
            self.loaded = True

    def _open(self, info: CollectionInfo, last: int) -> tuple[CollectionEntry, int] | None:
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
                self.erased.add("")
            return None
        return CollectionEntry(info, index), seq

    def build_index(self, info: CollectionInfo) -> CollectionIndex:
        """The collection's index built from the database's vectors."""
        ids, identities, vectors = self.store.collection_vectors(info.id, info.dimension)
        return self.engine.build(info, ids, identities, vectors)

    def build(self, info: CollectionInfo) -> CollectionEntry:
        return CollectionEntry(info, self.build_index(info))

    def rebuild(self, collection: str | None = None) -> None:
        """Recreate indexes from the database (all collections, or one)."""
        with self.lock, self.exclusive():
            seq = self.store.last_seq()
            kept = set(self.collections)  # indexes not rebuilt here still need every change after applied
            for info in self.store.list_collections():
                if collection is None or info.name == collection:
                    self.collections[info.id] = self.build(info)
                    kept.discard(info.id)
            self.applied = min(self.applied, seq) if self.loaded or kept else seq
            self.sync()

    def sync(self) -> int:
        """Apply every logged change newer than the last applied one; returns how many.

        A shared engine records its own position: changes another process already applied to it are
        only noted here (a dropped collection forgotten), not applied again."""
        if self._settled and self._nothing_new():
            return 0
        applied = 0
        with self.lock, self.exclusive():
            self._settled = False
            engine_at = self.engine.position() if self.engine.shared else None
            start = self.applied if engine_at is None else min(self.applied, engine_at)
            while changes := self.store.changes_since(start):
                self._apply(changes, self.applied if engine_at is None else engine_at)
                start = self.applied = changes[-1].seq
                engine_at = None if engine_at is None else max(engine_at, start)
                applied += len(changes)
            if self.engine.shared and applied:
                self.engine.record(self.applied)
            for entry in list(self.collections.values()):
                if entry.index.stale:
                    self.collections[entry.info.id] = self.build(entry.info)
                else:
                    for job in self.upkeep:
                        if job.due(entry):
                            job.start(entry)
            self._settled = True
        return applied

    def _nothing_new(self) -> bool:
        """True when the change log holds nothing after the change this process applied last and no index
        waits to be rebuilt or chosen again: what a follower finds nearly every time. The log is read
        without the lock, so searches are not held up by the read, and without the shared engine's lock
        and position, so an idle gateway on Milvus asks neither the database's lock nor Milvus anything."""
        if self.store.changes_since(self.applied, limit=1):
            return False
        with self.lock:
            return not any(entry.index.stale or any(job.due(entry) for job in self.upkeep)
                           for entry in self.collections.values())

    def _apply(self, changes: list[Change], engine_at: int) -> None:
        """Apply ``changes`` in order; those at or below ``engine_at`` are already in the engine."""
        by_collection: dict[int, list[Change]] = defaultdict(list)
        self.labels.forget(changes)
        self.labels.learn({c.identity_id for c in changes if c.op in (ChangeOp.ADD, ChangeOp.RELABEL)})
        policies = {c.collection_id for c in changes if c.op is ChangeOp.POLICY}
        for change in changes:
            if change.op in (ChangeOp.RELABEL, ChangeOp.POLICY):
                continue  # the engines hold neither labels nor policies
            if change.op is ChangeOp.DROP:
                dropped = self.collections.pop(change.collection_id, None)
                if change.seq > engine_at:
                    with dropped.lock if dropped is not None else nullcontext():  # searches under way end
                        self.engine.forget(change.collection_id)
                self.erased.add("")  # snapshot("") prunes the dropped collection's files
                by_collection.pop(change.collection_id, None)
            elif change.seq > engine_at:
                by_collection[change.collection_id].append(change)
        unopened = by_collection.keys() - self.collections.keys()
        if self.engine.shared and unopened:
            self._open_held(unopened)
        for collection_id, items in by_collection.items():
            entry = self.collections.get(collection_id)
            if entry is not None:
                if not self.apply_to(entry, items):
                    self.collections.pop(collection_id)  # built from the database when first used
            elif not self.engine.shared and any(c.op is ChangeOp.REMOVE for c in items):
                # built lazily from the database when first used; a snapshot of it (written before a re-embed,
                # or by another process sharing the folder) holds the removed vectors: deleted with the
                # dropped collections' (a shared engine holds no collection left unopened by _open_held)
                self.engine.forget(collection_id)
                self.erased.add("")
        if policies:
            self._read_again(policies)

    def _read_again(self, collection_ids: AbstractSet[int]) -> None:
        """The collections' rows as the database has them now (a policy or calibration changed)."""
        for info in self.store.list_collections():
            entry = self.collections.get(info.id)
            if info.id in collection_ids and entry is not None:
                entry.info = info

    def _open_held(self, collection_ids: AbstractSet[int]) -> None:
        """Open those of these collections that the shared engine holds (built by another process) so that
        the changes being applied reach them: the position recorded next covers every collection the engine
        holds, so a process that skipped one would lose its changes for every process. Called under the lock
        and the engine's."""
        last = self.store.last_seq()
        for info in self.store.list_collections():
            if info.id in collection_ids and (opened := self._open(info, last)) is not None:
                self.collections[info.id] = opened[0]

    def apply_to(self, entry: CollectionEntry, items: list[Change]) -> bool:
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
                    self.erased.add(info.name)
        return True

    def _reembedded(self, info: CollectionInfo) -> bool:
        """The database holds the collection with another model or dimension than ``info`` (or no more)."""
        current = next((c for c in self.store.list_collections() if c.id == info.id), None)
        return current is None or (current.embedding_model, current.dimension) != (info.embedding_model,
                                                                                   info.dimension)

    def entry(self, collection: str) -> CollectionEntry:
        """The collection's entry, its index opened or built first when needed; ``NotFound`` when the
        collection does not exist."""
        entry = self.loaded_entry(collection)
        if entry is not None:
            return entry
        self.store.get_collection(collection)  # raises NotFound
        self.sync()
        with self.lock, self.exclusive():
            # read again with the log applied: a collection deleted (a new one of its name created) or
            # re-embedded meanwhile, its DROP applied by that sync, would be built as it was, and kept
            info = self.store.get_collection(collection)
            if info.id not in self.collections:
                last = self.store.last_seq()
                opened = self._open(info, last) if self.engine.shared else None  # built by another process
                self.collections[info.id] = opened[0] if opened else self.build(info)
            return self.collections[info.id]

    def loaded_entry(self, collection: str) -> CollectionEntry | None:
        """The collection's entry when this replica holds it, without the lock (copying the dict's values
        is atomic): safe from the event loop."""
        return next((e for e in list(self.collections.values()) if e.info.name == collection), None)
