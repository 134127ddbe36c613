"""Erasure reaches the disk: snapshots are rewritten without erased vectors; snapshot integrity."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from numpy.typing import NDArray

from gallery.engines.index import FaceIndex
from gallery.gallery import Gallery
from gallery.store.store import GalleryStore, NewFace
from tests import ROOT

pytest_plugins = ["tests.gallery.fixtures"]

DIM = 16
#: Saves a small index to argv[1] and SIGKILLs itself at the save's first fsync (the index written, staged).
KILLED_SAVE = """
import os, signal, sys
from pathlib import Path
import numpy as np
from gallery.engines.index import FaceIndex
os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
vectors = np.random.default_rng(0).standard_normal((20, 16)).astype(np.float32)
FaceIndex.build(16, np.arange(20), vectors).save(Path(sys.argv[1]), 1)
"""


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


def test_a_snapshot_newer_than_the_database_is_ignored_then_deleted(store: GalleryStore, tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A snapshot past the database's last change (the database restored from an older backup) holds faces
    the database does not: ignored, and deleted at the first erasure snapshot. Failed before: it stayed,
    and once the log grew past its position a restart loaded it, the changes between the two positions
    never applied."""
    rng = np.random.default_rng(3)
    store.create_collection("c", "m", DIM, 0.5)
    enroll(store, "c", ["a"], rng)
    gallery = Gallery(store, tmp_path / "idx")
    gallery.load()
    (path,) = gallery.snapshot()
    meta = path.with_suffix(".json")
    meta.write_text(meta.read_text().replace('"seq": ', '"seq": 10', 1))  # as if the DB was restored
    position = FaceIndex.load(path)[1]["seq"]
    restored = Gallery(store, tmp_path / "idx")
    restored.load()
    assert "older backup" in caplog.text
    assert restored.size("c") == 2
    restored.snapshot_erasures()
    assert not path.exists()
    while store.last_seq() < position:  # the log passes the snapshot's position
        enroll(store, "c", [f"p{store.last_seq()}"], rng)
    restarted = Gallery(store, tmp_path / "idx")
    restarted.load()
    faces = store.collection_identities(store.get_collection("c").id)[0]
    assert restarted.face_ids("c") == set(faces.tolist())


def test_a_snapshot_that_fails_leaves_no_staged_copy(store: GalleryStore, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A snapshot that fails midway (the disk full: fsync reports ENOSPC) deletes its staged files, which
    hold the embeddings; the previous snapshot stays, and the erasure's snapshot is made again at the next
    call. Failed before: a ``.partial`` copy stayed for ever, and the erasure was not tried again."""
    rng = np.random.default_rng(4)
    store.create_collection("c", "m", DIM, 0.5)
    enroll(store, "c", ["alice", "bob"], rng)
    gallery = Gallery(store, tmp_path / "idx")
    gallery.load()
    (path,) = gallery.snapshot()
    before = FaceIndex.load(path)[0].ids
    erased = set(store.delete_identity("c", "alice"))

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        gallery.snapshot_erasures()
    monkeypatch.undo()
    left = sorted(p.name for p in path.parent.iterdir())
    assert left == [path.name, path.stem + ".json", path.stem + ".lock"]
    assert FaceIndex.load(path)[0].ids == before
    assert gallery.snapshot_erasures() == [path]
    assert FaceIndex.load(path)[0].ids == before - erased


def killed_save(path: Path) -> set[Path]:
    """The staged files a process SIGKILLed inside ``FaceIndex.save`` of ``path`` left behind."""
    before = set(path.parent.glob("*.partial"))
    done = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(path)], cwd=ROOT, capture_output=True,
                          timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()
    left = set(path.parent.glob("*.partial")) - before
    assert left, "the killed save left no staged file"
    return left


def test_staged_files_of_a_killed_save_are_removed_not_a_live_ones(store: GalleryStore, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A save SIGKILLed before its rename leaves staged files holding embeddings: opening the collection and
    every snapshot's pruning delete them, but never those of a save under way (another process's, sharing
    the folder). Failed before: nothing ever deleted them."""
    rng = np.random.default_rng(5)
    store.create_collection("c", "m", DIM, 0.5)
    enroll(store, "c", ["alice", "bob"], rng)
    folder = tmp_path / "idx"
    folder.mkdir()
    path = folder / f"collection-{store.get_collection('c').id}.faiss"
    killed_save(path)
    gallery = Gallery(store, folder)
    gallery.load()  # opening the collection deletes them
    assert not list(folder.glob("*.partial"))
    killed = killed_save(path)
    entered, release, real_fsync = threading.Event(), threading.Event(), os.fsync

    def held(fd: int) -> None:
        if threading.current_thread().name == "live-writer":
            entered.set()
            release.wait(10)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", held)
    index = FaceIndex.build(DIM, np.arange(1, 5), rng.standard_normal((4, DIM)).astype(np.float32))
    writer = threading.Thread(target=index.save, args=(path, 0), name="live-writer")
    writer.start()
    try:
        assert entered.wait(10)
        live = set(folder.glob("*.partial")) - killed
        assert live
        gallery.snapshot()  # prunes
        assert set(folder.glob("*.partial")) == live
    finally:
        release.set()
        writer.join(10)
    assert not list(folder.glob("*.partial"))
    assert FaceIndex.load(path)[0].ids == {1, 2, 3, 4}


def held_in(folder: Path, vectors: NDArray[np.float32]) -> dict[str, int]:
    """Files of ``folder`` holding any of these float32 vectors byte for byte: {name: vectors found}."""
    found: dict[str, int] = {}
    for path in sorted(folder.iterdir()):
        data = path.read_bytes()
        count = sum(np.asarray(v, "<f4").tobytes() in data for v in vectors)
        if count:
            found[path.name] = count
    return found


def stored_vectors(store: GalleryStore, collection: str, face_ids: set[int]) -> NDArray[np.float32]:
    info = store.get_collection(collection)
    ids, _, vectors = store.collection_vectors(info.id, info.dimension)
    return vectors[np.isin(ids, sorted(face_ids))]


def reembed(store: GalleryStore, collection: str, dimension: int, rng: np.random.Generator) -> None:
    """What ``gallery.reembed`` writes: every face's new vector (another model, ``dimension``) and a DROP."""
    ids = sorted(store.collection_vectors(store.get_collection(collection).id, DIM)[0].tolist())
    store.replace_embeddings(collection, ids, rng.standard_normal((len(ids), dimension)).astype(np.float32),
                             "m2", dimension, 0.5)


def snapshotted_pair(store: GalleryStore, folder: Path, rng: np.random.Generator
                     ) -> tuple[Gallery, NDArray[np.float32]]:
    """Collection ``c`` of alice and bob, loaded and snapshotted into ``folder``: the gallery and alice's
    vectors, which the snapshot holds."""
    store.create_collection("c", "m", DIM, 0.5)
    enroll(store, "c", ["alice", "bob"], rng)
    gallery = Gallery(store, folder)
    gallery.load()
    gallery.snapshot()
    alice = stored_vectors(store, "c", {f.id for f in store.list_faces("c", "alice")})
    assert held_in(folder, alice)
    return gallery, alice


@pytest.mark.parametrize("deleted", ["after", "before"])
def test_a_reembedded_collections_old_snapshot_keeps_no_erased_vector(store: GalleryStore, tmp_path: Path,
                                                                     deleted: str) -> None:
    """A re-embed drops the collection's index (rebuilt from the database when next used): its snapshot of
    the old model's vectors is deleted at the erasure snapshot, so an identity deleted after the re-embed
    (or before it, its erasure still pending when the index was dropped) leaves no vector on disk. Failed
    before: the old snapshot stayed, with every face's old vector, until the collection was used again and
    a full snapshot rewrote it."""
    rng = np.random.default_rng(6)
    gallery, old = snapshotted_pair(store, tmp_path / "idx", rng)
    if deleted == "before":
        store.delete_identity("c", "alice")
        gallery.sync()
    reembed(store, "c", 8, rng)
    gallery.sync()
    if deleted == "after":
        store.delete_identity("c", "alice")
        gallery.sync()
    gallery.snapshot_erasures()
    assert held_in(tmp_path / "idx", old) == {}
    gallery.snapshot()
    assert gallery.face_ids("c") == {f.id for f in store.list_faces("c", "bob")}


def test_a_snapshot_of_another_model_is_deleted_at_load(store: GalleryStore, tmp_path: Path) -> None:
    """A gateway stopped while its collection was re-embedded and an identity deleted finds a snapshot of
    the old model at its start: unusable, deleted at the first erasure snapshot. Failed before: it stayed
    (ignored) until a full snapshot overwrote it."""
    rng = np.random.default_rng(7)
    _, old = snapshotted_pair(store, tmp_path / "idx", rng)
    reembed(store, "c", DIM, rng)
    store.delete_identity("c", "alice")
    restarted = Gallery(store, tmp_path / "idx")
    restarted.load()
    restarted.snapshot_erasures()
    assert held_in(tmp_path / "idx", old) == {}
    assert restarted.face_ids("c") == {f.id for f in store.list_faces("c", "bob")}


def test_a_snapshot_of_a_collection_not_loaded_here_keeps_no_erased_vector(store: GalleryStore,
                                                                          tmp_path: Path) -> None:
    """Faces removed from a collection this gallery has not loaded (it was created after its start; its
    snapshot was written by another process sharing the folder, gone since): that snapshot is deleted at the
    erasure snapshot. Failed before: the changes were skipped, and the file kept the vectors."""
    rng = np.random.default_rng(8)
    gateway = Gallery(store, tmp_path / "idx")
    gateway.load()
    _, vectors = snapshotted_pair(store, tmp_path / "idx", rng)  # by another process, gone since
    store.delete_identity("c", "alice")
    gateway.sync()
    gateway.snapshot_erasures()
    assert held_in(tmp_path / "idx", vectors) == {}
    assert gateway.face_ids("c") == {f.id for f in store.list_faces("c", "bob")}
