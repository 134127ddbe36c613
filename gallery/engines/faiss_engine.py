"""The FAISS engine: each collection's index in this process's memory (``index.py``), persisted as snapshot
files with the change-log position they include; every process holds its own copy."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from gallery.engines.base import CollectionIndex, Faces, Ids, IndexInfo, Vectors
from gallery.engines.index import FaceIndex, IndexConfig, IndexKind, remove_stale_partials
from gallery.store.store import CollectionInfo

log = logging.getLogger(__name__)


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
