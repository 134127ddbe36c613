"""The engine boundary: where a collection's vectors live, behind two small Protocols.

``gallery.replica.Replica`` follows the change log and calls an ``Engine`` to open, build, change, search
and persist one ``CollectionIndex`` per collection. Two engines implement it:

- ``FaissEngine`` (``faiss_engine.py``): the index lives in this process's memory (``FaceIndex``),
  persisted as snapshot files with the change-log position they include; every process holds its own copy.
- ``MilvusEngine`` (``milvus.py``): the vectors live in a Milvus server shared by every gateway;
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

from gallery.engines.index import IndexConfig, Measurement
from gallery.store.store import CollectionInfo

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
        from gallery.engines.faiss_engine import FaissEngine

        return FaissEngine(snapshot_dir, config)
    if settings.backend == "milvus":
        from gallery.engines.milvus import MilvusEngine  # pymilvus: the `milvus` extra

        token = None if settings.milvus_token is None else settings.milvus_token.get_secret_value()
        return MilvusEngine(settings.milvus_uri, token, settings.milvus_prefix, settings.milvus_index_type,
                            settings.milvus_index_params, settings.milvus_search_params)
    raise ValueError(f"unknown gallery backend {settings.backend!r} (faiss or milvus)")
