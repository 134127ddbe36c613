"""The gallery: the database (truth) plus one index per collection in an engine (a copy that follows it).

A facade over its parts, each a module of its own:

- ``replica.py``: the indexes following the database's change log (load, sync, rebuild);
- ``snapshots.py``: the indexes persisted with the log position they include, erasures promptly;
- ``search.py``: top identities per query, the match decision, the inline search of the event loop;
- ``labels.py``: identity labels remembered for answers, forgotten when the log says;
- ``reselection.py``: an outgrown collection's index chosen again in the background.

The engine (``engines/base.py``) is FAISS in this process or a shared Milvus server; the store
(``store/``) is the SQL database.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

from numpy.typing import ArrayLike

from facecore.periodic import Periodic
from facecore.settings import Settings
from gallery.calibration import Decision, decide
from gallery.engines.base import Engine, IndexInfo, make_engine
from gallery.engines.batching import SearchBatcher
from gallery.engines.faiss_engine import FaissEngine
from gallery.engines.index import IndexConfig
from gallery.recalibration import Recalibration
from gallery.replica import Replica
from gallery.reselection import Reselection
from gallery.search import Candidate, Searcher, SearchResult
from gallery.snapshots import Snapshots
from gallery.store.policies import CollectionPolicies
from gallery.store.store import CollectionInfo, GalleryStore, check_model

__all__ = ["Candidate", "Gallery", "SearchResult", "open_gallery"]


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
    """Thread-safe (``replica.py`` says how it locks).

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
        self.replica = Replica(store, self.engine)
        self.reselection = Reselection(self.replica)
        self.policies = CollectionPolicies(store.db)
        self.recalibration = Recalibration(self.replica, self.policies)
        self.replica.upkeep = [self.reselection, self.recalibration]
        #: the last decision per collection, with what it was derived from (the row, the faces)
        self._decisions: dict[int, tuple[CollectionInfo, int, Decision]] = {}
        self.snapshots = Snapshots(self.replica)
        self.searcher = Searcher(self.replica, self.batcher)
        self._follower = Periodic("gallery-follower", self.sync, "change-log sync failed")

    # --- the replica --------------------------------------------------------------------------

    @property
    def loaded(self) -> bool:
        return self.replica.loaded

    @property
    def applied_seq(self) -> int:
        return self.replica.applied

    def load(self) -> None:
        """Persisted indexes where valid, else a rebuild from the database; then the newer changes."""
        self.replica.load()

    def rebuild(self, collection: str | None = None) -> None:
        """Recreate indexes from the database (all collections, or one)."""
        self.replica.rebuild(collection)

    def sync(self) -> int:
        """Apply every logged change newer than the last applied one; returns how many."""
        return self.replica.sync()

    def snapshot(self, collection: str | None = None, erased: bool = False) -> list[Path]:
        """Persist indexes (all, or one collection's) with the change-log position they include."""
        return self.snapshots.write(collection, erased)

    def snapshot_erasures(self) -> list[Path]:
        """Persist the collections that lost faces since they were last persisted."""
        return self.snapshots.erasures()

    def start_follower(self, interval_s: float = 0.2) -> None:
        """Poll the change log in a daemon thread so that other processes' writes become visible."""
        self._follower.start(interval_s)

    def stop_follower(self) -> None:
        self._follower.stop()

    def close(self) -> None:
        """At shutdown: stop following the change log; a background selection of an index still under way
        (not waited for) ends without a result and is logged as abandoned, not as a failure (the process's
        thread pools, the index's search threads among them, are shut down under it at exit). The next
        start chooses again: the collection is still past its size."""
        self.reselection.closing = self.recalibration.closing = True
        self.stop_follower()

    def reselection_state(self) -> tuple[int, dict[str, int]]:
        """Collections whose index is being chosen again now, and the selections finished by outcome."""
        return self.reselection.state()

    def join_reselections(self, timeout: float | None = None) -> None:
        """Wait for the background index selections and score measurements under way (tests, shutdown)."""
        self.reselection.join(timeout)
        self.recalibration.join(timeout)

    # --- collections --------------------------------------------------------------------------

    def sizes(self) -> dict[str, int]:
        """Faces per loaded collection index, by collection name. Without the lock (copying the dict's
        values is atomic): the event loop calls it (metrics, the collection list), and the lock can be held
        for seconds (a snapshot of a million faces being written, an index rebuilt)."""
        return {entry.info.name: len(entry.index) for entry in list(self.replica.collections.values())}

    def size(self, collection: str) -> int:
        return len(self.replica.entry(collection).index)

    def describe(self, collection: str) -> tuple[IndexInfo, bool]:
        """The collection's index (``CollectionIndex.describe``), and whether a new one is being chosen for
        it in the background (``FaissIndex.outgrown``)."""
        entry = self.replica.entry(collection)
        described = entry.index.describe()  # Milvus counts its rows: not under the lock
        with self.replica.lock:
            return described, entry.info.id in self.reselection.running

    def face_ids(self, collection: str) -> set[int]:
        return self.replica.entry(collection).index.face_ids()

    def face_identities(self, collection: str) -> dict[int, int]:
        """face id -> identity id as the index holds them."""
        return self.replica.entry(collection).index.identities()

    def cached_info(self, collection: str) -> CollectionInfo | None:
        """The collection as this gallery holds it, without touching the database or the lock
        (None when not loaded here yet). Safe from the event loop."""
        entry = self.replica.loaded_entry(collection)
        return None if entry is None else entry.info

    def collection_info(self, collection: str) -> CollectionInfo:
        """The collection, loading its index first when needed; ``NotFound`` when it does not exist."""
        return self.replica.entry(collection).info

    def decision(self, collection: str, reference: dict[str, Any]) -> Decision:
        """How the collection decides at its current size (``gallery.calibration.decide``), given the
        embedding model's score reference. Cheap when nothing changed: remembered per collection."""
        entry = self.replica.loaded_entry(collection) or self.replica.entry(collection)
        info, faces = entry.info, len(entry.index)
        known = self._decisions.get(info.id)
        if known is not None and known[0] is info and known[1] == faces:
            return known[2]
        made = decide(info, faces, reference)
        self._decisions[info.id] = (info, faces, made)
        return made

    def require_model(self, collection: str, embedding_model: str) -> CollectionInfo:
        info = self.collection_info(collection)
        check_model(info, embedding_model)
        return info

    # --- search -------------------------------------------------------------------------------

    def search(self, collection: str, queries: ArrayLike, k: int = 5, threshold: float | None = None,
               embedding_model: str | None = None, exclude: AbstractSet[int] = frozenset()
               ) -> list[SearchResult]:
        """Top-k identities (best face each) per query with the match decision (``Searcher.search``)."""
        return self.searcher.search(collection, queries, k, threshold, embedding_model, exclude)

    def search_inline(self, collection: str, queries: ArrayLike, k: int = 5, threshold: float | None = None
                      ) -> list[SearchResult] | None:
        """``search`` on the calling thread, or None when it cannot answer at once (``Searcher.inline``)."""
        return self.searcher.inline(collection, queries, k, threshold)
