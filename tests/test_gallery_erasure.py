"""Erasure reaches the disk: snapshots are rewritten without erased vectors; snapshot integrity."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from gallery.gallery import Gallery
from gallery.index import FaceIndex
from gallery.store import GalleryStore, NewFace

pytest_plugins = ["tests.gallery_fixtures"]

DIM = 16


def face(rng: np.random.Generator) -> NewFace:
    return NewFace(rng.standard_normal(DIM).astype(np.float32), "sha", [0, 0, 10, 10], 0.99)


def enroll(store: GalleryStore, collection: str, people: list[str], rng: np.random.Generator) -> None:
    for person in people:
        store.add_faces(collection, person, [face(rng), face(rng)], "m", create=(person, {}))


@pytest.mark.parametrize("tombstones", [False, True], ids=["remove_ids", "tombstones(gpu path)"])
def test_erased_vectors_leave_the_snapshot_files(store: GalleryStore, tmp_path: Path,
                                                  tombstones: bool) -> None:
    rng = np.random.default_rng(0)
    store.create_collection("c", "m", DIM, 0.5)
    enroll(store, "c", ["alice", "bob"], rng)
    gallery = Gallery(store, tmp_path / "idx", force_tombstones=tombstones)
    gallery.load()
    (path,) = gallery.snapshot()
    erased = set(store.delete_identity("c", "alice"))
    gallery.sync()
    assert erased & FaceIndex.load(path)[0].ids == erased, \
        "before the erasure snapshot the file still has them"
    assert gallery.snapshot_erasures() == [path]
    on_disk, meta = FaceIndex.load(path)
    assert not (erased & on_disk.ids) and meta["tombstones"] == []
    assert on_disk.ids == gallery.face_ids("c")
    assert gallery.snapshot_erasures() == []  # nothing pending any more


def test_dropped_collection_files_are_removed(store: GalleryStore, tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    for name in ("keep", "drop"):
        store.create_collection(name, "m", DIM, 0.5)
        enroll(store, name, ["p"], rng)
    gallery = Gallery(store, tmp_path / "idx")
    gallery.load()
    assert len(gallery.snapshot()) == 2
    store.delete_collection("drop")
    gallery.sync()
    gallery.snapshot_erasures()
    keep = store.get_collection("keep").id
    assert sorted(p.name for p in (tmp_path / "idx").iterdir()) == [
        f"collection-{keep}.faiss", f"collection-{keep}.json", f"collection-{keep}.lock"]


def test_an_index_file_paired_with_other_metadata_is_rejected(store: GalleryStore, tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    rng = np.random.default_rng(2)
    store.create_collection("c", "m", DIM, 0.5)
    enroll(store, "c", ["a", "b", "c"], rng)
    gallery = Gallery(store, tmp_path / "idx")
    gallery.load()
    (path,) = gallery.snapshot()
    older = tmp_path / "older.faiss"
    shutil.copy(path, older)
    enroll(store, "c", ["d"], rng)
    gallery.snapshot()
    shutil.copy(older, path)  # another writer's index next to this writer's metadata
    fresh = Gallery(store, tmp_path / "idx")
    fresh.load()
    assert "does not match its metadata" in caplog.text
    assert fresh.face_ids("c") == set(store.collection_vectors(store.get_collection("c").id, DIM)[0].tolist())


def test_a_snapshot_newer_than_the_database_is_ignored(store: GalleryStore, tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    rng = np.random.default_rng(3)
    store.create_collection("c", "m", DIM, 0.5)
    enroll(store, "c", ["a"], rng)
    gallery = Gallery(store, tmp_path / "idx")
    gallery.load()
    (path,) = gallery.snapshot()
    meta = path.with_suffix(".json")
    meta.write_text(meta.read_text().replace('"seq": ', '"seq": 10', 1))  # as if the DB was restored
    fresh = Gallery(store, tmp_path / "idx")
    fresh.load()
    assert "older backup" in caplog.text
    assert fresh.size("c") == 2
