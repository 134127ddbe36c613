"""The index stays equal to the database: erasure, model changes, restarts, SIGKILL crashes, replicas."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np
import pytest
from numpy.typing import NDArray
from sqlalchemy import Engine, inspect

from gallery.errors import ModelMismatch, NotFound
from gallery.gallery import Gallery
from gallery.replica import Replica
from gallery.store.db import Database, create_db_engine, migrate
from gallery.store.store import GalleryStore
from tests import ROOT
from tests.gallery import crash_worker as worker
from tests.gallery.helpers import (
    MODEL,
    OTHER_MODEL,
    GalleryFactory,
    assert_gallery_matches_db,
    db_faces,
    new_faces,
    sql_scalar,
    unit_vectors,
)

pytest_plugins = ["tests.gallery.fixtures"]

DIM = 16


def enroll(store: GalleryStore, rng: np.random.Generator, collection: str, external_id: str, count: int,
           model: str = MODEL) -> list[int]:
    faces = new_faces(unit_vectors(rng, count, DIM), tag=external_id)
    _, stored = store.add_faces(collection, external_id, faces, model, create=(external_id.title(), {}))
    return [f.id for f in stored]


# --- erasure ------------------------------------------------------------------------------------


@pytest.mark.parametrize("tombstones", [False, True], ids=["remove_ids", "tombstones"])
def test_erasure_removes_vectors_rows_and_crops(store: GalleryStore, engine: Engine, tombstones: bool,
                                                make_gallery: GalleryFactory) -> None:
    if tombstones and make_gallery.backend == "milvus":  # type: ignore[attr-defined]
        pytest.skip("tombstones are the FAISS GPU path; Milvus deletes by primary key")
    rng = np.random.default_rng(21)
    store.create_collection("e", MODEL, DIM, 0.5)
    erased = enroll(store, rng, "e", "erased", 5)
    for number in range(15):
        enroll(store, rng, "e", f"p{number}", int(rng.integers(1, 4)))
    gallery = Gallery(store, force_tombstones=tombstones) if tombstones else make_gallery(store)
    gallery.load()
    # learns about the erasure from the log only (on Milvus: a second gateway on the same server)
    replica = Gallery(store, force_tombstones=tombstones) if tombstones else make_gallery(store)
    replica.load()
    identity_id = store.get_identity("e", "erased").id
    own_vectors = np.stack([v for _, v in sorted(store.vectors(erased, DIM).items())])
    assert gallery.search("e", own_vectors, k=1)[0].candidates[0].identity_id == identity_id

    assert sorted(store.delete_identity("e", "erased")) == sorted(erased)
    gallery.sync()
    replica.sync()
    everyone = 16
    for g in (gallery, replica):
        assert not g.face_ids("e") & set(erased)
        for result in g.search("e", own_vectors, k=everyone):
            assert identity_id not in {c.identity_id for c in result.candidates}
            assert not {c.face_id for c in result.candidates} & set(erased)
            assert len(result.candidates) == everyone - 1
        assert_gallery_matches_db(g, engine, "e", DIM)
    assert sql_scalar(engine, "SELECT count(*) FROM identities WHERE id = :i", i=identity_id) == 0
    assert sql_scalar(engine, "SELECT count(*) FROM identities WHERE external_id = 'erased'") == 0
    for table_filter in ("identity_id = :i", "identity_id = :i AND crop IS NOT NULL"):
        assert sql_scalar(engine, f"SELECT count(*) FROM faces WHERE {table_filter}", i=identity_id) == 0
    placeholders = ", ".join(str(int(f)) for f in erased)
    assert sql_scalar(engine, f"SELECT count(*) FROM faces WHERE id IN ({placeholders})") == 0
    with pytest.raises(NotFound):
        store.get_identity("e", "erased")


# --- model changes ------------------------------------------------------------------------------


def test_other_embedding_model_is_refused(store: GalleryStore, engine: Engine,
                                          make_gallery: GalleryFactory) -> None:
    rng = np.random.default_rng(22)
    store.create_collection("m", MODEL, DIM, 0.5)
    enroll(store, rng, "m", "a", 2)
    gallery = make_gallery(store)
    gallery.load()
    before = sql_scalar(engine, "SELECT count(*) FROM faces")
    with pytest.raises(ModelMismatch) as error:
        enroll(store, rng, "m", "b", 2, model=OTHER_MODEL)
    assert error.value.details == {"expected": MODEL, "got": OTHER_MODEL}
    with pytest.raises(ModelMismatch):
        enroll(store, rng, "m", "a", 1, model=OTHER_MODEL)  # an existing identity too
    assert sql_scalar(engine, "SELECT count(*) FROM faces") == before
    query = unit_vectors(rng, 1, DIM)
    with pytest.raises(ModelMismatch) as error:
        gallery.search("m", query, embedding_model=OTHER_MODEL)
    assert error.value.code == "embedding_model_mismatch"
    with pytest.raises(ModelMismatch):
        gallery.require_model("m", OTHER_MODEL)
    assert gallery.require_model("m", MODEL).embedding_model == MODEL
    assert gallery.search("m", query, embedding_model=MODEL)[0].candidates


def test_a_follower_behind_a_reembed_to_another_dimension_applies_the_log_on(
        store: GalleryStore, engine: Engine, make_gallery: GalleryFactory, monkeypatch: pytest.MonkeyPatch
        ) -> None:
    """A follower reads the log in batches (of 10,000 rows; 2 here): a batch with faces added to a collection
    whose re-embed to another dimension (its DROP) is in a later batch finds their rows holding the new
    vectors. The collection's index is dropped then (built from the database when next used) and the log
    applied on. Failed before: InvalidEmbedding at every sync, which read the same first rows each time, so
    no change of any collection was applied any more (deletions included)."""
    rng = np.random.default_rng(29)
    for name in ("c", "other"):
        store.create_collection(name, MODEL, DIM, 0.5)
        enroll(store, rng, name, "seed", 2)
    gallery = make_gallery(store)
    gallery.load()
    enroll(store, rng, "c", "late", 3)  # not applied by the follower yet
    ids = sorted(db_faces(engine, "c"))
    store.replace_embeddings("c", ids, unit_vectors(rng, len(ids), 2 * DIM), OTHER_MODEL, 2 * DIM, 0.5)
    enroll(store, rng, "other", "after", 2)
    store.delete_identity("other", "seed")
    changes_since = store.changes_since
    monkeypatch.setattr(store, "changes_since", lambda seq, limit=2: changes_since(seq, min(limit, 2)))
    gallery.sync()
    assert gallery.applied_seq == store.last_seq()
    assert_gallery_matches_db(gallery, engine, "other", DIM)
    assert gallery.collection_info("c").embedding_model == OTHER_MODEL
    assert_gallery_matches_db(gallery, engine, "c", 2 * DIM)


# --- restarts -----------------------------------------------------------------------------------


def test_load_from_snapshot_plus_newer_changes(store: GalleryStore, engine: Engine, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               make_gallery: GalleryFactory) -> None:
    rng = np.random.default_rng(23)
    for name in ("a", "b", "dropped"):
        store.create_collection(name, MODEL, DIM, 0.5)
        for number in range(8):
            enroll(store, rng, name, f"p{number}", int(rng.integers(1, 4)))
    gallery = make_gallery(store, tmp_path)
    gallery.load()
    assert len(gallery.snapshot()) == (3 if make_gallery.backend == "faiss" else 0)  # type: ignore[attr-defined]
    snapshot_seq = gallery.applied_seq

    # newer changes: adds, deletes of snapshotted faces, erasures, a new and a dropped collection
    enroll(store, rng, "a", "new", 3)
    enroll(store, rng, "a", "p1", 2)
    store.delete_face("a", store.list_faces("a", "p2")[0].id)
    store.delete_identity("a", "p3")
    store.delete_identity("b", "p0")
    store.create_collection("late", MODEL, DIM, 0.5)
    enroll(store, rng, "late", "x", 2)
    store.delete_collection("dropped")
    assert store.last_seq() > snapshot_seq

    built: list[str] = []
    original = Replica.build

    def spy(self: Replica, info: Any) -> Any:
        built.append(info.name)
        return original(self, info)

    monkeypatch.setattr(Replica, "build", spy)
    restarted = make_gallery(store, tmp_path)
    restarted.load()
    assert built == ["late"]  # a and b came from their snapshots, replayed forward
    assert restarted.applied_seq == store.last_seq()
    for name in ("a", "b", "late"):
        assert_gallery_matches_db(restarted, engine, name, DIM)
    with pytest.raises(NotFound):
        restarted.face_ids("dropped")


def test_rebuild_equals_database(store: GalleryStore, engine: Engine, make_gallery: GalleryFactory) -> None:
    rng = np.random.default_rng(24)
    for name in ("a", "b"):
        store.create_collection(name, MODEL, DIM, 0.5)
        for number in range(6):
            enroll(store, rng, name, f"p{number}", 2)
    loaded = make_gallery(store)
    loaded.load()
    # the database changes behind the gallery's back (no sync)
    enroll(store, rng, "a", "late", 2)
    store.delete_identity("a", "p0")
    store.delete_face("b", store.list_faces("b", "p1")[0].id)
    loaded.rebuild()
    for name in ("a", "b"):
        assert_gallery_matches_db(loaded, engine, name, DIM)
    assert loaded.applied_seq == store.last_seq()

    # a gallery that was never load()ed builds collections lazily; rebuilding one of them must not
    # skip the pending changes of the others
    lazy = make_gallery(store)
    assert lazy.face_ids("b")
    enroll(store, rng, "b", "pending", 2)  # committed, not yet applied by ``lazy``
    enroll(store, rng, "a", "pending", 1)
    lazy.rebuild("a")
    for name in ("a", "b"):
        assert_gallery_matches_db(lazy, engine, name, DIM)


# --- crash safety -------------------------------------------------------------------------------


class Lines:
    """Lines of a child's stdout, read by a thread so that waits can time out."""

    def __init__(self, stream: IO[str]) -> None:
        self._queue: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:
            for line in stream:
                self._queue.put(line.rstrip("\n"))
            self._queue.put(None)

        threading.Thread(target=pump, daemon=True).start()

    def wait_for(self, predicate: Callable[[str], bool], timeout: float, what: str) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(deadline - time.monotonic(), 0.001))
            except queue.Empty:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}") from None
            if line is None:
                raise AssertionError(f"the child exited while waiting for {what}")
            if predicate(line):
                return line


def python_module(module: str, *args: str, stdin: int | None = None, stderr: IO[bytes],
                  env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, stdin=stdin,
                            stdout=subprocess.PIPE, stderr=stderr, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def kill_worker(db_url: str, snapshots: Path, seed: int, stage: str, delay: float, log: Path,
                pause: str = "", milvus: tuple[str, ...] = ()) -> None:
    """Start the worker, wait for ``stage``, let it run ``delay`` seconds more, SIGKILL it."""
    with log.open("wb") as stderr:
        process = python_module("tests.gallery.crash_worker", db_url, str(snapshots), str(seed), *milvus,
                                stderr=stderr, env={"GALLERY_CRASH_PAUSE": pause})
        try:
            assert process.stdout is not None
            Lines(process.stdout).wait_for(lambda line: line == stage, 60, f"stage {stage!r}")
            time.sleep(delay)
            assert process.poll() is None, f"the worker died on its own:\n{log.read_text()}"
            os.kill(process.pid, signal.SIGKILL)
            assert process.wait(10) == -signal.SIGKILL
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()


def test_sigkill_at_any_moment_converges(db_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                         make_gallery: GalleryFactory) -> None:
    """A writer SIGKILLed at any moment (mid-migration, mid-snapshot, mid-anything) leaves a database and
    snapshot directory (or Milvus server) from which a restarted gallery equals the database."""
    on_milvus = make_gallery.backend == "milvus"  # type: ignore[attr-defined]
    milvus: tuple[str, ...] = make_gallery.milvus if on_milvus else ()  # type: ignore[attr-defined]
    rng = np.random.default_rng(25)
    snapshots = tmp_path / "snapshots"
    engine = create_db_engine(db_url)
    # inside the migration transaction, right after start (migrations, first load, first snapshot),
    # then after 0.3-2.0 s of random work, with two kills inside snapshot writes among them
    schedule = [("paused-in-ddl", 0.0, "ddl"), ("migrating", rng.uniform(0, 0.15), ""),
                ("snapshotting", rng.uniform(0, 0.003), "")]
    schedule += [("started", rng.uniform(0.3, 2.0), "") for _ in range(8)]
    if on_milvus:  # between writing changes to Milvus and recording the position that includes them
        schedule.insert(7, ("paused-in-record", 0.0, f"record:{rng.integers(3, 12)}"))
        schedule.insert(9, ("paused-in-record", 0.0, f"record:{rng.integers(12, 30)}"))
    else:
        schedule.insert(7, ("paused-in-fsync", 0.0, f"fsync:{2 * rng.integers(4, 12)}"))  # torn snapshot
        schedule.insert(9, ("paused-in-fsync", 0.0, f"fsync:{2 * rng.integers(4, 12) + 1}"))  # .partial only
    replayed = 0
    try:
        for seed, (stage, delay, pause) in enumerate(schedule):
            kill_worker(db_url, snapshots, seed, stage, delay, tmp_path / f"worker-{seed}.log", pause, milvus)
            if pause == "ddl":  # the half-done migration left nothing behind
                assert inspect(engine).get_table_names() == []

            migrate(engine)  # what a restarted service does first
            store = GalleryStore(Database(engine))
            collections = store.list_collections()
            assert [c.name for c in collections] in ([], [worker.COLLECTION]), collections
            snapshot_seq: int | None = None
            gallery = make_gallery(store, snapshots)
            if collections and on_milvus:
                snapshot_seq = gallery.engine.position()
            elif collections:
                with contextlib.suppress(OSError, ValueError, KeyError):  # torn or missing: load ignores it
                    meta = snapshots / f"collection-{collections[0].id}.json"
                    snapshot_seq = int(json.loads(meta.read_text())["seq"])
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="gallery.gallery"):
                gallery.load()
            if collections:
                assert_gallery_matches_db(gallery, engine, worker.COLLECTION, worker.DIMENSION)
                ignored = any("ignoring snapshot" in r.getMessage() for r in caplog.records)
                replayed += snapshot_seq is not None and not ignored and snapshot_seq < store.last_seq()
        faces = sql_scalar(engine, "SELECT count(*) FROM faces")
        changes = sql_scalar(engine, "SELECT count(*) FROM face_changes")
        # the workers really worked (Milvus writes are slower: fewer operations fit in the same delays)
        assert faces >= (10 if on_milvus else 20) and changes >= (50 if on_milvus else 100), (faces, changes)
        assert replayed >= 2  # restarts loaded a snapshot and replayed newer changes on top of it
    finally:
        engine.dispose()


# --- replicas -----------------------------------------------------------------------------------


@pytest.fixture
def follower(db_url: str, store: GalleryStore, tmp_path: Path, make_gallery: GalleryFactory
             ) -> Iterator[tuple[Lines, GalleryStore]]:
    """A Gallery in another process following the same database (collection ``r``, some faces); on
    Milvus, a second gateway on the same Milvus server."""
    milvus = make_gallery.milvus if make_gallery.backend == "milvus" else ()  # type: ignore[attr-defined]
    rng = np.random.default_rng(26)
    store.create_collection("r", MODEL, DIM, 0.5)
    for number in range(3):
        enroll(store, rng, "r", f"seed{number}", 2)
    log = tmp_path / "follower.log"
    with log.open("wb") as stderr:
        process = python_module("tests.gallery.follower", db_url, "r", *milvus, stdin=subprocess.PIPE,
                                stderr=stderr)
        try:
            assert process.stdout is not None
            lines = Lines(process.stdout)
            lines.wait_for(lambda line: line == "ready", 60, "the follower to start")
            yield lines, store
        finally:
            if process.stdin is not None:
                process.stdin.close()  # the follower exits at the end of its input
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def test_replica_sees_each_change_within_a_second(follower: tuple[Lines, GalleryStore],
                                                  engine: Engine, make_gallery: GalleryFactory) -> None:
    lines, store = follower
    rng = np.random.default_rng(27)
    writer = make_gallery(store)  # the writer's own gallery, in this process
    writer.load()

    def seen(expected: dict[int, int]) -> Callable[[str], bool]:
        def check(line: str) -> bool:
            return {int(k): v for k, v in json.loads(line)["faces"].items()} == expected
        return check

    lines.wait_for(seen(db_faces(engine, "r")), 10, "the initial state")
    steps: list[Callable[[], object]] = [
        lambda: enroll(store, rng, "r", "alice", 2),
        lambda: store.add_faces("r", "alice", new_faces(unit_vectors(rng, 1, DIM), tag="a2"), MODEL),
        lambda: enroll(store, rng, "r", "bob", 3),
        lambda: store.delete_face("r", store.list_faces("r", "bob")[0].id),
        lambda: store.delete_identity("r", "alice"),
        lambda: store.delete_identity("r", "seed1"),
        lambda: enroll(store, rng, "r", "carol", 4),
        lambda: store.delete_face("r", store.list_faces("r", "seed0")[1].id),
    ]
    latencies = []
    for number, step in enumerate(steps):
        step()  # committed when it returns
        started = time.monotonic()
        expected = db_faces(engine, "r")
        # the replica's index holds exactly these faces, and searching each face's own vector ranks its
        # identity first
        lines.wait_for(seen(expected), 5, f"step {number} to reach the replica")
        latencies.append(time.monotonic() - started)
        writer.sync()
        assert writer.face_ids("r") == set(expected)
    assert max(latencies) < 1.0, latencies


def lock_is_free(lock: Any) -> bool:
    """Whether another thread could take ``lock`` now (a search waiting for the gallery's lock)."""
    taken: list[bool] = []

    def probe() -> None:
        taken.append(lock.acquire(blocking=False))
        if taken[0]:
            lock.release()

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return taken[0]


def test_a_follower_reads_the_log_without_holding_searches_up(store: GalleryStore, engine: Engine,
                                                              make_gallery: GalleryFactory,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(31)
    store.create_collection("r", MODEL, DIM, 0.5)
    enroll(store, rng, "r", "alice", 2)
    gallery = make_gallery(store)
    gallery.load()
    free: list[bool] = []
    changes_since = gallery.store.changes_since

    def reading(seq: int, limit: int = 10_000) -> Any:
        free.append(lock_is_free(gallery.replica.lock))
        return changes_since(seq, limit)

    monkeypatch.setattr(gallery.store, "changes_since", reading)
    assert gallery.sync() == 0  # an interval with nothing new: one read, searches free to go on
    assert free == [True]
    enroll(store, rng, "r", "bob", 1)
    assert gallery.sync() == 1  # something new: applied under the lock, as before
    assert free[0] and False in free[1:]
    assert_gallery_matches_db(gallery, engine, "r", DIM)


def finishes(call: Callable[[], object], within_s: float = 5.0) -> bool:
    """Whether ``call`` returns within ``within_s`` on another thread (it may still be waiting after)."""
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(within_s)
    return not thread.is_alive()


@contextlib.contextmanager
def while_held(monkeypatch: pytest.MonkeyPatch, target: Any, name: str, call: Callable[[], object]
               ) -> Iterator[None]:
    """The block runs while ``call``, on another thread, is held inside ``target.name`` (made to wait
    there until the block ends)."""
    reached, release = threading.Event(), threading.Event()
    original = getattr(target, name)

    def waiting(*args: Any, **kwargs: Any) -> Any:
        reached.set()
        assert release.wait(30), "never released"
        return original(*args, **kwargs)

    monkeypatch.setattr(target, name, waiting)
    thread = threading.Thread(target=call)
    thread.start()
    try:
        assert reached.wait(10), f"{name} was not reached"
        yield
    finally:
        release.set()
        thread.join(30)


def two_collections(store: GalleryStore, make_gallery: GalleryFactory, rng: np.random.Generator
                    ) -> tuple[Gallery, NDArray[np.float32]]:
    """A loaded gallery of collections ``a`` and ``b``, and a query."""
    for name in ("a", "b"):
        store.create_collection(name, MODEL, DIM, 0.5)
        enroll(store, rng, name, "alice", 2)
    gallery = make_gallery(store)
    gallery.load()
    return gallery, unit_vectors(rng, 1, DIM)


def test_searches_wait_for_no_database_read_of_a_sync(store: GalleryStore, engine: Engine,
                                                      make_gallery: GalleryFactory,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(32)
    gallery, query = two_collections(store, make_gallery, rng)
    enroll(store, rng, "a", "bob", 3)  # the next sync reads these vectors from the database...
    with while_held(monkeypatch, gallery.store, "vectors", gallery.sync):  # ... under the gallery's lock
        assert finishes(lambda: gallery.search("b", query)), "another collection's search waited"
        assert finishes(lambda: gallery.search("a", query)), "a search of the collection itself waited"
        assert finishes(gallery.sizes) and finishes(gallery.reselection_state), "the metrics waited"
    assert_gallery_matches_db(gallery, engine, "a", DIM)


def test_a_search_waits_for_no_other_collections_search(store: GalleryStore, make_gallery: GalleryFactory,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    gallery, query = two_collections(store, make_gallery, np.random.default_rng(33))
    index = gallery.replica.entry("a").index
    with while_held(monkeypatch, index, "search", lambda: gallery.search("a", query)):
        assert finishes(lambda: gallery.search("b", query)), "it waited for collection a's search"


def test_searches_go_on_while_a_snapshot_is_written(store: GalleryStore, engine: Engine, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(34)
    store.create_collection("a", MODEL, DIM, 0.5)
    enroll(store, rng, "a", "alice", 3)
    gallery = Gallery(store, tmp_path / "snapshots")
    gallery.load()
    query = unit_vectors(rng, 1, DIM)
    with while_held(monkeypatch, gallery.engine, "persist", gallery.snapshot):
        assert finishes(lambda: gallery.search("a", query)), "the search waited for the snapshot"
    assert list((tmp_path / "snapshots").glob("collection-*"))


def test_searches_run_without_errors_while_changes_are_applied(store: GalleryStore, engine: Engine,
                                                               make_gallery: GalleryFactory) -> None:
    rng = np.random.default_rng(35)
    store.create_collection("r", MODEL, DIM, 0.5)
    enroll(store, rng, "r", "seed", 4)
    gallery = make_gallery(store)
    gallery.load()
    queries = unit_vectors(rng, 8, DIM)
    stop, failures = threading.Event(), []

    def search() -> None:
        while not stop.is_set():
            try:
                for result in gallery.search("r", queries[rng.integers(0, 8, 2)], k=3):
                    assert all(c.score <= 1.0 + 1e-4 for c in result.candidates)
            except Exception as exc:  # reported below
                failures.append(exc)
                return

    searchers = [threading.Thread(target=search) for _ in range(4)]
    for thread in searchers:
        thread.start()
    try:
        for number in range(12):
            enroll(store, rng, "r", f"p{number}", 2)
            if number % 3 == 2:
                store.delete_identity("r", f"p{number - 1}")
            gallery.sync()
    finally:
        stop.set()
        for thread in searchers:
            thread.join(30)
    assert failures == []
    assert_gallery_matches_db(gallery, engine, "r", DIM)
