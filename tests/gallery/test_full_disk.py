"""FAISS snapshots on a real filesystem that fills up: a tmpfs of 2 MB under the snapshot folder
(``small_fs.py``; skipped where mounting is not permitted). The write fails with ENOSPC and leaves nothing
staged behind, the previous snapshot stays whole, the gallery keeps searching, a restart loads the old
snapshot and replays the log, and the next snapshot succeeds once space returns (the erasures too)."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gallery.engines.index import FaceIndex
from gallery.gallery import Gallery
from gallery.store.store import GalleryStore
from tests.gallery.helpers import new_faces, unit_vectors
from tests.gallery.small_fs import fill, small_filesystem

pytest_plugins = ["tests.gallery.fixtures"]

DIM = 128  # 512 bytes a face: 600 faces make a snapshot of about 300 KB


@pytest.fixture
def small_folder(tmp_path: Path) -> Iterator[Path]:
    with small_filesystem(tmp_path / "idx", "2m") as folder:
        yield folder


def enroll(store: GalleryStore, people: range, rng: np.random.Generator) -> None:
    for person in people:
        store.add_faces("c", f"p{person}", new_faces(unit_vectors(rng, 2, DIM), tag=str(person)), "m",
                        create=(f"P{person}", {}))


def database_faces(store: GalleryStore) -> set[int]:
    return set(store.collection_identities(store.get_collection("c").id)[0].tolist())


def test_a_snapshot_on_a_full_filesystem_fails_cleanly_and_succeeds_once_space_returns(
        store: GalleryStore, small_folder: Path) -> None:
    rng = np.random.default_rng(0)
    store.create_collection("c", "m", DIM, 0.5)
    enroll(store, range(300), rng)
    gallery = Gallery(store, small_folder)
    gallery.load()
    (path,) = gallery.snapshot()
    saved = FaceIndex.load(path)[0].ids
    ballast = fill(small_folder)

    enroll(store, range(300, 310), rng)
    erased = set(store.delete_identity("c", "p0"))
    gallery.sync()
    for attempt in (gallery.snapshot, gallery.snapshot_erasures):
        with pytest.raises(OSError) as failed:
            attempt()
        assert failed.value.errno == errno.ENOSPC
    assert sorted(p.name for p in small_folder.iterdir()) == sorted(
        [path.name, path.stem + ".json", path.stem + ".lock", ballast.name])  # nothing staged left
    assert FaceIndex.load(path)[0].ids == saved  # the previous snapshot is whole
    newest = store.list_faces("c", "p309")[0].id
    assert gallery.face_ids("c") == database_faces(store)
    assert gallery.search("c", gallery.replica.store.vectors([newest], DIM)[newest][None])[0].candidates[0] \
        .face_id == newest  # searching goes on

    restarted = Gallery(store, small_folder)  # the old snapshot and the log after it
    restarted.load()
    assert restarted.face_ids("c") == database_faces(store)

    ballast.unlink()
    assert gallery.snapshot_erasures() == [path]  # the erasure tried again
    on_disk, meta = FaceIndex.load(path)
    assert on_disk.ids == database_faces(store) and not on_disk.ids & erased
    assert meta["seq"] == store.last_seq()
