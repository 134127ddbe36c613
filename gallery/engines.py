"""The engine boundary: where a collection's vectors live, behind two small Protocols.

``Gallery`` follows the change log and calls an ``Engine`` to open, build, change, search and persist
one ``CollectionIndex`` per collection. Two engines implement it:

- ``FaissEngine`` (this module): the index lives in this process's memory (``FaceIndex``), persisted as
  snapshot files with the change-log position they include; every process holds its own copy.
- ``MilvusEngine`` (``gallery/milvus.py``): the vectors live in a Milvus server shared by every gateway;
  the engine records there the change-log position it applied (``shared``: one process at a time
  applies the log to it, under a lock in the database), and gateways hold no index in memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

from gallery.index import FaceIndex, IndexConfig, IndexKind, Measurement, remove_stale_partials
from gallery.store import CollectionInfo

log = logging.getLogger(__name__)

Ids = NDArray[np.int64]
Vectors = NDArray[np.float32]
#: () -> (face ids, identity ids) of a collection, read from the database
Faces = Callable[[], tuple[Ids, Ids]]


@dataclass(frozen=True)
class IndexInfo:
    """What a collection's index is, and what its build measured (``GET /v1/collections/{name}/index``)."""

    engine: str  # "faiss" or "milvus"
    kind: str  # IndexKind's value (FAISS), the index type (Milvus)
    effort: int | None = None  # re-rank depth or nprobe of an approximate FAISS index
    chosen_at: int | None = None  # faces when the candidates were measured (None: never)
    measured: Measurement | None = None  # the kept candidate's measurement (None: exact, or Milvus)
    faces: int = 0  # faces the index holds


class CollectionIndex(Protocol):
    """One collection's faces in an engine."""

    def __len__(self) -> int: ...

    def face_ids(self) -> set[int]: ...

    def identities(self) -> dict[int, int]:
        """face id -> identity id, for every face held."""
        ...

    def add(self, face_ids: Ids, identity_ids: Ids, vectors: Vectors) -> None:
        """Add (or, for ids already held, replace) faces."""
        ...

    def remove(self, face_ids: Ids) -> None: ...

    def search(self, queries: Vectors, k: int) -> tuple[Vectors, Ids, Ids]:
        """Top-k (scores, face ids, identity ids) per query, best first; -1 ids where fewer."""
        ...

    @property
    def stale(self) -> bool:
        """True when the engine wants this index rebuilt from the database (tombstones piled up)."""
        ...

    @property
    def outgrown(self) -> bool:
        """True when the collection grew past the size its index kind was chosen for: a new selection,
        built in the background while this index serves, is due."""
        ...

    @property
    def has_tombstones(self) -> bool:
        """True while removed vectors are only hidden (a persisted copy would still hold them)."""
        ...

    def describe(self) -> IndexInfo:
        """The index kind, its search effort and what its build measured."""
        ...


class Engine(Protocol):
    #: True when the data is shared by every process (the log is applied once, under a lock).
    shared: bool

    def open(self, info: CollectionInfo, identities: Faces) -> tuple[CollectionIndex, int] | None:
        """The persisted index of ``info`` and the change-log position it includes, if valid
        (``identities()`` gives the collection's face and identity ids from the database)."""
        ...

    def build(self, info: CollectionInfo, ids: Ids, identities: Ids, vectors: Vectors) -> CollectionIndex: ...

    def forget(self, collection_id: int) -> None:
        """The collection was dropped (or re-embedded), or lost faces while not loaded in this process (not
        called for shared engines): delete what the engine stores of it (FAISS: at the next ``prune``)."""
        ...

    def persist(self, index: CollectionIndex, info: CollectionInfo, seq: int, erased: bool) -> list[str]:
        """Make ``index`` durable at position ``seq``; with ``erased``, so that removed vectors leave
        storage. Returns what was written (snapshot paths, collection names)."""
        ...

    def prune(self, live: set[int]) -> None:
        """Delete what the engine stores of collections not in ``live`` (and of those forgotten)."""
        ...

    def position(self) -> int | None:
        """Shared engines: the change-log position applied to the engine (None: never)."""
        ...

    def record(self, seq: int) -> None: ...


def make_engine(settings: Any, snapshot_dir: Path | None, config: IndexConfig) -> Engine:
    """The engine a ``facecore.settings.GallerySettings`` asks for."""
    if settings.backend == "faiss":
        return FaissEngine(snapshot_dir, config)
    if settings.backend == "milvus":
        from gallery.milvus import MilvusEngine  # pymilvus: the `milvus` extra

        token = None if settings.milvus_token is None else settings.milvus_token.get_secret_value()
        return MilvusEngine(settings.milvus_uri, token, settings.milvus_prefix, settings.milvus_index_type,
                            settings.milvus_index_params, settings.milvus_search_params)
    raise ValueError(f"unknown gallery backend {settings.backend!r} (faiss or milvus)")


# --- FAISS, in this process --------------------------------------------------------------------


class FaissIndex:
    """A ``FaceIndex`` with its face -> identity map."""

    def __init__(self, index: FaceIndex, identity_of: dict[int, int]) -> None:
        self.index, self.identity_of = index, identity_of

    def __len__(self) -> int:
        return len(self.index)

    def face_ids(self) -> set[int]:
        return self.index.ids

    def identities(self) -> dict[int, int]:
        return dict(self.identity_of)

    def add(self, face_ids: Ids, identity_ids: Ids, vectors: Vectors) -> None:
        self.index.add(face_ids, vectors)
        self.identity_of.update(zip(face_ids.tolist(), identity_ids.tolist(), strict=True))

    def remove(self, face_ids: Ids) -> None:
        self.index.remove(face_ids)
        for face_id in face_ids.tolist():
            self.identity_of.pop(face_id, None)

    def search(self, queries: Vectors, k: int) -> tuple[Vectors, Ids, Ids]:
        scores, ids = self.index.search(queries, k)
        owners = np.array([self.identity_of.get(f, -1) for f in ids.ravel().tolist()], np.int64)
        return scores, ids, owners.reshape(ids.shape)

    @property
    def stale(self) -> bool:
        return self.index.needs_compaction

    @property
    def outgrown(self) -> bool:
        """Measured (``selection``) and now ``reselect_growth`` times the size it was measured at; or exact
        because it was small (never measured), and now above ``exact_max``, or above ``exact_always`` and
        twice the size its exact scan was last timed within target at."""
        index, config = self.index, self.index.config
        if index.selection:
            growth = config.reselect_growth
            return growth > 1 and index.selected_at > 0 and len(index) > growth * index.selected_at
        limit = min(config.exact_max, max(config.exact_always, 2 * index.exact_checked))
        return index.kind is IndexKind.FLAT and len(index) > limit

    @property
    def has_tombstones(self) -> bool:
        return self.index.has_tombstones

    def describe(self) -> IndexInfo:
        index = self.index
        if index.kind is IndexKind.FLAT:
            return IndexInfo("faiss", index.kind.value, chosen_at=index.selected_at or None, faces=len(index))
        kept = next((m for m in reversed(index.selection) if m.kind == index.kind.value and m.accurate), None)
        return IndexInfo("faiss", index.kind.value, index.nprobe, index.selected_at or None, kept, len(index))


class FaissEngine:
    shared = False

    def __init__(self, snapshot_dir: Path | None = None, config: IndexConfig | None = None,
                 force_tombstones: bool = False) -> None:
        self.snapshot_dir, self.config = snapshot_dir, config or IndexConfig()
        self.force_tombstones = force_tombstones
        #: collections whose snapshot is out of date (dropped, re-embedded, changed while not loaded here, or
        #: one ``open`` could not use): its files may hold erased vectors, deleted by the next ``prune``
        self._forgotten: set[int] = set()

    def _path(self, collection_id: int) -> Path | None:
        return None if self.snapshot_dir is None else self.snapshot_dir / f"collection-{collection_id}.faiss"

    def open(self, info: CollectionInfo, identities: Faces) -> tuple[CollectionIndex, int] | None:
        path = self._path(info.id)
        if path is None or not path.parent.exists():
            return None
        remove_stale_partials(path.parent, f"{path.stem}.*.partial")  # of a save killed before it finished
        if not path.exists():
            return None
        try:
            index, meta = FaceIndex.load(path, self.config, self.force_tombstones)
            seq = int(meta["seq"])
        except (OSError, ValueError, RuntimeError, KeyError, TypeError) as exc:  # malformed metadata too
            log.warning("ignoring snapshot %s (deleted at the next prune): %r", path, exc)
            self._forgotten.add(info.id)
            return None
        if meta.get("embedding_model") != info.embedding_model or index.dimension != info.dimension:
            log.warning("ignoring snapshot %s (deleted at the next prune): made for another model", path)
            self._forgotten.add(info.id)
            return None
        ids, owners = identities()
        return FaissIndex(index, dict(zip(ids.tolist(), owners.tolist(), strict=True))), seq

    def build(self, info: CollectionInfo, ids: Ids, identities: Ids, vectors: Vectors) -> CollectionIndex:
        index = FaceIndex.build(info.dimension, ids, vectors, self.config, self.force_tombstones, identities,
                                info.match_threshold)
        return FaissIndex(index, dict(zip(ids.tolist(), identities.tolist(), strict=True)))

    def forget(self, collection_id: int) -> None:
        """Its snapshot files are deleted by the next ``prune`` (the gallery asks for one within the erasure
        delay), unless a new snapshot of it replaces them first."""
        self._forgotten.add(collection_id)

    def persist(self, index: CollectionIndex, info: CollectionInfo, seq: int, erased: bool) -> list[str]:
        path = self._path(info.id)
        if path is None or not isinstance(index, FaissIndex):
            return []
        path.parent.mkdir(parents=True, exist_ok=True)
        index.index.save(path, seq, {"embedding_model": info.embedding_model})
        self._forgotten.discard(info.id)
        return [str(path)]

    def prune(self, live: set[int]) -> None:
        """Also the snapshots of collections forgotten since (``forget``), and the staged files of saves
        killed before they finished (``remove_stale_partials``)."""
        if self.snapshot_dir is None or not self.snapshot_dir.exists():
            self._forgotten.clear()  # nothing stored
            return
        remove_stale_partials(self.snapshot_dir, "collection-*.partial")
        names = {f"collection-{i}" for i in live - self._forgotten}
        for stale in self.snapshot_dir.glob("collection-*"):
            if stale.name.split(".")[0] not in names and stale.suffix in (".faiss", ".json", ".lock"):
                stale.unlink(missing_ok=True)
        self._forgotten.clear()

    def position(self) -> int | None:
        return None

    def record(self, seq: int) -> None:
        """Positions live in the snapshots (``persist``)."""
