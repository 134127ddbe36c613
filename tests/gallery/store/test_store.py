"""GalleryStore on SQLite and PostgreSQL: migrations, collections, identities, faces and the change log."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from numpy.typing import NDArray
from sqlalchemy import Engine, insert, inspect, text

import gallery.store.store as gallery_store
from gallery.errors import Conflict, InvalidEmbedding, ModelMismatch, NotFound
from gallery.store.db import Polled, create_db_engine, migrate
from gallery.store.models import Base, ChangeOp, Identity
from gallery.store.store import GalleryStore, collection_row
from tests import ROOT
from tests.gallery.helpers import (
    MODEL,
    OTHER_MODEL,
    new_faces,
    sql_rows,
    sql_scalar,
    unit_vectors,
    without_times,
)

pytest_plugins = ["tests.gallery.fixtures"]

DIM = 16


def counts(engine: Engine) -> tuple[int, ...]:
    """Rows in identities, faces, faces with a crop, face_changes."""
    return tuple(int(sql_scalar(engine, f"SELECT count(*) FROM {table}"))
                 for table in ("identities", "faces", "faces WHERE crop IS NOT NULL", "face_changes"))


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture
def people(store: GalleryStore) -> GalleryStore:
    store.create_collection("people", MODEL, DIM, 0.5)
    return store


# --- migrations ---------------------------------------------------------------------------------


def test_migrations_are_idempotent_and_match_the_models(db_url: str) -> None:
    engine = create_db_engine(db_url)
    try:
        migrate(engine)
        first = set(inspect(engine).get_table_names())
        migrate(engine)  # a second run is a no-op
        assert set(inspect(engine).get_table_names()) == first
        assert {"collections", "identities", "faces", "face_changes", "alembic_version"} <= first
        assert len(sql_rows(engine, "SELECT version_num FROM alembic_version")) == 1
        with engine.connect() as connection:
            differences = compare_metadata(MigrationContext.configure(connection), Base.metadata)
        assert differences == []
    finally:
        engine.dispose()


# --- collections --------------------------------------------------------------------------------


def test_collections_create_get_list_delete(store: GalleryStore, engine: Engine,
                                            rng: np.random.Generator) -> None:
    first = store.create_collection("first", MODEL, DIM, 0.4)
    second = store.create_collection("second", OTHER_MODEL, 32, 0.6, keep_crops=False)
    assert (first.name, first.embedding_model, first.dimension, first.match_threshold, first.keep_crops) == (
        "first", MODEL, DIM, 0.4, True)
    assert without_times(store.get_collection("second")) == without_times(second)
    assert [c.name for c in store.list_collections()] == ["first", "second"]

    with pytest.raises(Conflict) as conflict:
        store.create_collection("first", MODEL, DIM, 0.4)
    assert conflict.value.code == "conflict"
    with pytest.raises(NotFound):
        store.get_collection("missing")
    with pytest.raises(NotFound):
        store.delete_collection("missing")
    for bad in (("", MODEL, DIM, 0.5), ("x", MODEL, 0, 0.5), ("x", MODEL, DIM, 1.5)):
        with pytest.raises(ValueError):
            store.create_collection(*bad)

    store.add_faces("first", "a", new_faces(unit_vectors(rng, 3, DIM)), MODEL, create=("A", {}))
    store.add_faces("second", "a", new_faces(unit_vectors(rng, 2, 32)), OTHER_MODEL, create=("A", {}))
    assert store.delete_collection("first") == 3
    assert [c.name for c in store.list_collections()] == ["second"]
    with pytest.raises(NotFound):
        store.get_collection("first")
    assert sql_scalar(engine, "SELECT count(*) FROM identities WHERE collection_id = :c", c=first.id) == 0
    assert sql_scalar(engine, "SELECT count(*) FROM faces WHERE collection_id = :c", c=first.id) == 0
    assert sql_scalar(engine, "SELECT count(*) FROM faces") == 2
    assert store.changes_since(0)[-1].op is ChangeOp.DROP
    # the name is free again
    store.create_collection("first", MODEL, DIM, 0.4)


# --- identities ---------------------------------------------------------------------------------


def test_identity_create_conflict_and_scope(people: GalleryStore) -> None:
    store = people
    store.create_collection("others", MODEL, DIM, 0.5)
    alice = store.create_identity("people", "alice", "Alice", {"team": "red"})
    assert (alice.external_id, alice.name, alice.metadata) == ("alice", "Alice", {"team": "red"})
    assert without_times(store.get_identity("people", "alice")) == without_times(alice)
    with pytest.raises(Conflict):
        store.create_identity("people", "alice", "Another Alice")
    elsewhere = store.create_identity("others", "alice", "Alice elsewhere")  # other collection: fine
    assert elsewhere.id != alice.id and elsewhere.collection_id != alice.collection_id
    with pytest.raises(NotFound):
        store.create_identity("missing", "bob")
    with pytest.raises(NotFound):
        store.get_identity("people", "bob")
    with pytest.raises(ValueError):
        store.create_identity("people", "")


def test_identity_list_pagination_and_literal_name_filter(people: GalleryStore) -> None:
    store = people
    names = ["Alice Smith", "ALICE Jones", "Bob", "100% Real", "100 Real", "a_b", "axb", "dir/name",
             "dirxname", "malice"]
    for number, name in enumerate(names):
        store.create_identity("people", f"id{number:02d}", name)

    everyone, total = store.list_identities("people", limit=100)
    assert total == len(names) and [i.name for i in everyone] == names  # ordered by creation (id)
    pages = [store.list_identities("people", offset=offset, limit=3) for offset in range(0, 12, 3)]
    assert [i.name for page, _ in pages for i in page] == names
    assert {page_total for _, page_total in pages} == {len(names)}
    assert [len(page) for page, _ in pages] == [3, 3, 3, 1]

    def named(fragment: str) -> list[str]:
        rows, count = store.list_identities("people", name_contains=fragment, limit=100)
        assert count == len(rows)
        return [i.name for i in rows]

    assert named("alice") == ["Alice Smith", "ALICE Jones", "malice"]
    assert named("ALICE") == ["Alice Smith", "ALICE Jones", "malice"]
    assert named("jOnEs") == ["ALICE Jones"]
    assert named("%") == ["100% Real"]  # literal, not a wildcard
    assert named("0%") == ["100% Real"]
    assert named("_") == ["a_b"]  # literal, not "any character"
    assert named("a_b") == ["a_b"]
    assert named("/") == ["dir/name"]  # the escape character itself is literal too
    assert named("nobody") == []
    page, total = store.list_identities("people", offset=1, limit=1, name_contains="alice")
    assert [i.name for i in page] == ["ALICE Jones"] and total == 3


def test_every_external_id_in_one_query(people: GalleryStore, engine: Engine) -> None:
    """What the compatible APIs list (every subject): in creation order, in one statement however many
    there are (paging counted the collection and skipped an OFFSET per page of 500)."""
    from sqlalchemy import event

    store = people
    with store.db.write() as session:
        owner = collection_row(session, "people").id
        session.execute(insert(Identity), [{"collection_id": owner, "external_id": f"x{n:04d}", "name": ""}
                                           for n in range(1_200)])
    store.create_collection("others", MODEL, DIM, 0.5)
    store.create_identity("others", "elsewhere")
    statements: list[str] = []

    def count(*args: object) -> None:
        statements.append(str(args[2]))

    event.listen(engine, "before_cursor_execute", count)
    try:
        ids = store.external_ids("people")
    finally:
        event.remove(engine, "before_cursor_execute", count)
    assert ids == [f"x{n:04d}" for n in range(1_200)]
    assert len([s for s in statements if "identities" in s]) == 1, statements


def test_identity_update_and_delete(people: GalleryStore, engine: Engine, rng: np.random.Generator) -> None:
    store = people
    created = store.create_identity("people", "carol", "Carol", {"a": 1})
    renamed = store.update_identity("people", "carol", name="Caroline")
    assert (renamed.name, renamed.metadata) == ("Caroline", {"a": 1})
    changed = store.update_identity("people", "carol", metadata={"b": [1, 2]})
    assert (changed.name, changed.metadata) == ("Caroline", {"b": [1, 2]})
    assert without_times(store.get_identity("people", "carol")) == without_times(changed)
    assert changed.id == created.id
    with pytest.raises(NotFound):
        store.update_identity("people", "nobody", name="x")

    _, faces = store.add_faces("people", "carol", new_faces(unit_vectors(rng, 3, DIM)), MODEL)
    assert sorted(store.delete_identity("people", "carol")) == sorted(f.id for f in faces)
    with pytest.raises(NotFound):
        store.get_identity("people", "carol")
    with pytest.raises(NotFound):
        store.delete_identity("people", "carol")
    assert counts(engine)[:3] == (0, 0, 0)


# --- faces --------------------------------------------------------------------------------------


@pytest.mark.parametrize("problem", ["dimension", "nan", "inf", "zero"])
@pytest.mark.parametrize("existing", [False, True], ids=["create", "existing"])
def test_add_faces_is_atomic(people: GalleryStore, engine: Engine, rng: np.random.Generator, problem: str,
                             existing: bool) -> None:
    store = people
    if existing:
        store.add_faces("people", "dave", new_faces(unit_vectors(rng, 1, DIM)), MODEL, create=("Dave", {}))
    before = counts(engine)
    vectors: list[NDArray[np.float32]] = list(unit_vectors(rng, 4, DIM))
    vectors[2] = {"dimension": np.ones(DIM + 1, np.float32), "nan": np.full(DIM, np.nan, np.float32),
                  "inf": np.full(DIM, np.inf, np.float32), "zero": np.zeros(DIM, np.float32)}[problem]
    with pytest.raises(InvalidEmbedding) as error:
        store.add_faces("people", "dave", new_faces(vectors), MODEL, create=("Dave", {}))
    assert error.value.code == "invalid_embedding"
    expected_words = {"dimension": ["dimension", str(DIM)], "nan": ["NaN"], "inf": ["infinite"],
                      "zero": ["zero"]}
    for word in expected_words[problem]:
        assert word in error.value.message
    assert counts(engine) == before  # nothing stored: no face, no log row, no identity
    if existing:
        assert len(store.list_faces("people", "dave")) == 1
    else:
        with pytest.raises(NotFound):
            store.get_identity("people", "dave")


def test_add_faces_wrong_model_and_unknown_identity(people: GalleryStore, engine: Engine,
                                                   rng: np.random.Generator) -> None:
    store = people
    before = counts(engine)
    with pytest.raises(ModelMismatch) as mismatch:
        store.add_faces("people", "erin", new_faces(unit_vectors(rng, 2, DIM)), OTHER_MODEL,
                        create=("Erin", {}))
    assert mismatch.value.code == "embedding_model_mismatch"
    assert mismatch.value.details == {"expected": MODEL, "got": OTHER_MODEL}
    with pytest.raises(NotFound):
        store.add_faces("people", "erin", new_faces(unit_vectors(rng, 2, DIM)), MODEL)
    with pytest.raises(NotFound):
        store.add_faces("missing", "erin", new_faces(unit_vectors(rng, 2, DIM)), MODEL, create=("Erin", {}))
    assert counts(engine) == before


def test_add_faces_stores_normalized_vectors_and_metadata(people: GalleryStore, engine: Engine,
                                                          rng: np.random.Generator) -> None:
    store = people
    raw = rng.standard_normal((2, DIM)).astype(np.float32) * 7  # not normalized on the way in
    identity, faces = store.add_faces("people", "fay", new_faces(raw), MODEL, create=("Fay", {"x": 1}))
    assert (identity.name, identity.metadata) == ("Fay", {"x": 1})
    stored = store.vectors([f.id for f in faces], DIM)
    for face, vector in zip(faces, raw, strict=True):
        np.testing.assert_allclose(stored[face.id], vector / np.linalg.norm(vector), rtol=1e-6)
        assert face.has_crop and face.box == [1.0, 2.0, 50.0, 60.0] and face.quality == {"sharpness": 0.5}
    assert [without_times(f) for f in store.list_faces("people", "fay")] == [without_times(f) for f in faces]
    # enrolling more faces to an existing identity ignores ``create``
    again, more = store.add_faces("people", "fay", new_faces(unit_vectors(rng, 1, DIM), tag="more"), MODEL,
                                  create=("Ignored", {}))
    assert again.id == identity.id and again.name == "Fay"
    assert [f.id for f in store.list_faces("people", "fay")] == [f.id for f in faces + more]


def test_change_log_in_commit_order(people: GalleryStore, rng: np.random.Generator) -> None:
    store = people
    assert store.last_seq() == 0 and store.changes_since(0) == []
    a, a_faces = store.add_faces("people", "a", new_faces(unit_vectors(rng, 2, DIM)), MODEL, create=("A", {}))
    b, b_faces = store.add_faces("people", "b", new_faces(unit_vectors(rng, 3, DIM)), MODEL, create=("B", {}))
    store.delete_face("people", a_faces[0].id)
    _, a_more = store.add_faces("people", "a", new_faces(unit_vectors(rng, 1, DIM)), MODEL)
    removed = store.delete_identity("people", "b")
    store.create_identity("people", "c")  # no vectors change: no log row
    store.update_identity("people", "a", metadata={"team": "x"})  # no label changes: no log row
    store.update_identity("people", "a", name="Renamed")  # the label search results show: a relabel row

    changes = store.changes_since(0)
    expected = ([(ChangeOp.ADD, f.id, a.id) for f in a_faces] + [(ChangeOp.ADD, f.id, b.id) for f in b_faces]
                + [(ChangeOp.REMOVE, a_faces[0].id, a.id)] + [(ChangeOp.ADD, f.id, a.id) for f in a_more]
                + [(ChangeOp.REMOVE, f, b.id) for f in removed] + [(ChangeOp.RELABEL, 0, a.id)])
    assert [(c.op, c.face_id, c.identity_id) for c in changes] == expected
    assert sorted(removed) == sorted(f.id for f in b_faces)
    seqs = [c.seq for c in changes]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    collection_id = store.get_collection("people").id
    assert {c.collection_id for c in changes} == {collection_id}
    assert store.last_seq() == seqs[-1]
    assert store.changes_since(seqs[3]) == changes[4:]
    assert store.changes_since(0, limit=2) == changes[:2]

    count = store.delete_collection("people")
    assert count == 2
    drop = store.changes_since(seqs[-1])
    assert [(c.op, c.collection_id) for c in drop] == [(ChangeOp.DROP, collection_id)]


def test_delete_identity_erases_faces_and_crops(people: GalleryStore, engine: Engine,
                                                rng: np.random.Generator) -> None:
    store = people
    gone, _ = store.add_faces("people", "gone", new_faces(unit_vectors(rng, 4, DIM)), MODEL, create=("G", {}))
    kept, _ = store.add_faces("people", "kept", new_faces(unit_vectors(rng, 2, DIM)), MODEL, create=("K", {}))
    assert sql_scalar(engine, "SELECT count(*) FROM faces WHERE identity_id = :i AND crop IS NOT NULL",
                      i=gone.id) == 4
    store.delete_identity("people", "gone")
    assert sql_scalar(engine, "SELECT count(*) FROM identities WHERE id = :i", i=gone.id) == 0
    assert sql_scalar(engine, "SELECT count(*) FROM faces WHERE identity_id = :i", i=gone.id) == 0
    assert sql_scalar(engine, "SELECT count(*) FROM faces WHERE crop IS NOT NULL") == 2
    assert sql_rows(engine, "SELECT DISTINCT identity_id FROM faces") == [(kept.id,)]


def test_delete_face(people: GalleryStore, engine: Engine, rng: np.random.Generator) -> None:
    store = people
    store.create_collection("others", MODEL, DIM, 0.5)
    _, faces = store.add_faces("people", "h", new_faces(unit_vectors(rng, 3, DIM)), MODEL, create=("H", {}))
    _, foreign = store.add_faces("others", "h", new_faces(unit_vectors(rng, 1, DIM)), MODEL, create=("H", {}))
    store.delete_face("people", faces[1].id)
    assert [f.id for f in store.list_faces("people", "h")] == [faces[0].id, faces[2].id]
    assert sql_scalar(engine, "SELECT count(*) FROM faces WHERE id = :f", f=faces[1].id) == 0
    with pytest.raises(NotFound):
        store.delete_face("people", faces[1].id)
    with pytest.raises(NotFound):  # a face of another collection is not reachable through this one
        store.delete_face("people", foreign[0].id)
    with pytest.raises(NotFound):
        store.delete_face("missing", faces[0].id)
    assert store.get_identity("people", "h").name == "H"  # the identity stays, with its other faces


def test_known_hashes(people: GalleryStore, rng: np.random.Generator) -> None:
    store = people
    store.create_collection("others", MODEL, DIM, 0.5)
    assert store.known_hashes("people") == set()
    _, faces = store.add_faces("people", "i", new_faces(unit_vectors(rng, 3, DIM)), MODEL, create=("I", {}))
    store.add_faces("others", "i", new_faces(unit_vectors(rng, 2, DIM), tag="o"), MODEL, create=("I", {}))
    assert store.known_hashes("people") == {f.image_sha256 for f in faces}
    store.delete_face("people", faces[0].id)
    assert store.known_hashes("people") == {f.image_sha256 for f in faces[1:]}
    with pytest.raises(NotFound):
        store.known_hashes("missing")


def test_keep_crops_false_stores_no_crop(store: GalleryStore, engine: Engine,
                                         rng: np.random.Generator) -> None:
    store.create_collection("nocrops", MODEL, DIM, 0.5, keep_crops=False)
    _, faces = store.add_faces("nocrops", "j", new_faces(unit_vectors(rng, 3, DIM)), MODEL, create=("J", {}))
    assert not any(f.has_crop for f in faces)
    assert sql_scalar(engine, "SELECT count(*) FROM faces") == 3
    assert sql_scalar(engine, "SELECT count(*) FROM faces WHERE crop IS NOT NULL") == 0


def test_face_ids_are_never_reused(people: GalleryStore, rng: np.random.Generator) -> None:
    store = people
    _, first = store.add_faces("people", "k", new_faces(unit_vectors(rng, 3, DIM)), MODEL, create=("K", {}))
    newest = max(f.id for f in first)
    store.delete_face("people", newest)  # the newest id: plain SQLite ROWIDs would hand it out again
    _, second = store.add_faces("people", "k", new_faces(unit_vectors(rng, 1, DIM), tag="2"), MODEL)
    assert second[0].id > newest
    store.delete_identity("people", "k")  # every face gone: the table is empty
    _, third = store.add_faces("people", "k", new_faces(unit_vectors(rng, 1, DIM), tag="3"), MODEL,
                               create=("K", {}))
    assert third[0].id > second[0].id


def test_timestamps_are_utc_aware(people: GalleryStore, db_url: str, request: pytest.FixtureRequest) -> None:
    """Known gap: ``DateTime(timezone=True)`` on SQLite stores no offset, so rows read back carry naive
    datetimes while freshly created ones are UTC-aware (PostgreSQL keeps the offset)."""
    store = people
    store.create_identity("people", "t", "T")
    for info in (store.get_collection("people"), store.get_identity("people", "t")):
        assert info.created_at.utcoffset() is not None, info


def test_concurrent_writers_never_hide_a_change_from_a_poller(people: GalleryStore) -> None:
    """Writers are serialized, so ``seq`` order is commit order: a replica polling ``changes_since``
    while several threads enroll and delete never steps past a change that commits late."""
    store = people
    errors: list[BaseException] = []
    done = threading.Event()
    seen: list[int] = []

    def write(number: int) -> None:
        rng = np.random.default_rng(number)
        try:
            for step in range(12):
                external = f"w{number}-{step}"
                vectors = new_faces(unit_vectors(rng, 2, DIM), tag=external)
                _, faces = store.add_faces("people", external, vectors, MODEL, create=(external, {}))
                if step % 3 == 0:
                    store.delete_face("people", faces[0].id)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    def poll() -> None:
        last = 0
        while True:
            finished = done.is_set()
            changes = store.changes_since(last)
            seen.extend(c.seq for c in changes)
            last = changes[-1].seq if changes else last
            if finished and not changes:
                return

    poller = threading.Thread(target=poll)
    poller.start()
    writers = [threading.Thread(target=write, args=(n,)) for n in range(4)]
    for thread in writers:
        thread.start()
    for thread in writers:
        thread.join()
    done.set()
    poller.join()
    assert not errors, errors
    everything = [c.seq for c in store.changes_since(0)]
    assert len(everything) == 4 * 12 * 2 + 4 * 4
    assert seen == everything  # nothing skipped, nothing out of order



def test_a_new_sqlite_file_waits_for_a_writer_before_switching_to_wal(tmp_path: Path) -> None:
    """Replicas starting together on a new file: one holds a write lock in the rollback journal mode a
    new file starts in, and the next connection's switch to WAL must wait for it, not fail with
    "database is locked" (SQLite skips the busy handler there). Failed before the switch was retried."""
    path = tmp_path / "new.db"
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    holder.execute("CREATE TABLE first_writer (x INTEGER)")
    timer = threading.Timer(0.5, holder.execute, ("COMMIT",))
    timer.start()
    engine = create_db_engine(f"sqlite:///{path}")
    try:
        started = time.monotonic()
        with engine.connect() as connection:
            assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert connection.exec_driver_sql("SELECT count(*) FROM first_writer").scalar() == 0
        assert time.monotonic() - started >= 0.3  # it waited for the writer
    finally:
        timer.join()
        holder.close()
        engine.dispose()


MIGRATE = "import sys; from gallery.store import db; db.migrate(db.create_db_engine(sys.argv[1]))"


def test_concurrent_migrations_on_an_empty_database(db_url: str) -> None:
    """Service replicas starting together on a fresh database all migrate it: one does the work, the
    others wait for it and find it done (processes: Alembic's context is not thread-safe)."""
    processes = [subprocess.Popen([sys.executable, "-c", MIGRATE, db_url], cwd=ROOT, stderr=subprocess.PIPE,
                                  text=True) for _ in range(4)]
    failures = [(p.wait(60), p.stderr.read()) for p in processes if p.stderr is not None]
    assert all(code == 0 for code, _ in failures), [err for code, err in failures if code][:1]
    engine = create_db_engine(db_url)
    try:
        with engine.connect() as connection:
            assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []
    finally:
        engine.dispose()


@pytest.mark.parametrize("counted", [None, 2])
def test_a_collections_vectors_are_read_page_by_page(store: GalleryStore, monkeypatch: pytest.MonkeyPatch,
                                                      counted: int | None) -> None:
    """Pages of 3 rows; with ``counted`` 2, more rows than counted arrive (faces added after the count on
    a read-committed database): the arrays grow, and every row is still there once, in id order."""
    rng = np.random.default_rng(41)
    store.create_collection("c", MODEL, DIM, 0.5)
    store.create_collection("other", MODEL, DIM, 0.5)
    expected = {}
    for number in range(4):
        vectors = unit_vectors(rng, 3, DIM)
        identity, faces = store.add_faces("c", f"p{number}", new_faces(vectors, tag=f"p{number}"), MODEL,
                                          create=(f"P{number}", {}))
        expected.update({f.id: (identity.id, v) for f, v in zip(faces, vectors, strict=True)})
        store.add_faces("other", f"o{number}", new_faces(unit_vectors(rng, 1, DIM), tag=f"o{number}"), MODEL,
                        create=(f"O{number}", {}))
    monkeypatch.setattr(gallery_store, "VECTOR_PAGE", 3)
    if counted is not None:
        monkeypatch.setattr(gallery_store, "_face_count", lambda session, collection_id: counted)
    ids, identities, matrix = store.collection_vectors(store.get_collection("c").id, DIM)
    assert ids.tolist() == sorted(expected) and matrix.shape == (12, DIM) and matrix.dtype == np.float32
    assert identities.tolist() == [expected[f][0] for f in sorted(expected)]
    np.testing.assert_allclose(matrix, np.stack([expected[f][1] for f in sorted(expected)]), atol=1e-6)


def test_vectors_of_added_faces_read_by_their_range_of_ids(store: GalleryStore, engine: Engine,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """What a follower applies after an import (consecutive ids) is read by their range, the other faces in
    it left out (another collection's, of another dimension); ids spread out by the ids themselves; removed
    faces are absent, a stored vector of the wrong size is refused. Before, every read bound each id (5,000
    parameters for an import's 5,000 faces)."""
    rng = np.random.default_rng(8)
    store.create_collection("c", MODEL, DIM, 0.5)
    store.create_collection("other", MODEL, 2 * DIM, 0.5)
    expected: dict[int, NDArray[np.float32]] = {}
    for number in range(6):  # the two collections' faces interleaved, as two imports running at once
        vectors = unit_vectors(rng, 5, DIM)
        _, faces = store.add_faces("c", f"p{number}", new_faces(vectors, tag=f"p{number}"), MODEL,
                                   create=(f"P{number}", {}))
        expected.update({f.id: v for f, v in zip(faces, vectors, strict=True)})
        store.add_faces("other", f"o{number}", new_faces(unit_vectors(rng, 4, 2 * DIM), tag=f"o{number}"),
                        MODEL, create=(f"O{number}", {}))
    ranges: list[dict[str, int]] = []
    real_rows = Polled.rows

    def rows(self: Polled, parameters: dict[str, int] | None = None) -> list[tuple[object, ...]]:
        if parameters and "lo" in parameters:
            ranges.append(parameters)
        return real_rows(self, parameters)

    monkeypatch.setattr(Polled, "rows", rows)
    wanted = sorted(expected)
    got = store.vectors(wanted[::-1], DIM)  # in any order
    assert sorted(got) == wanted and ranges == [{"lo": wanted[0], "hi": wanted[-1]}]
    for face_id, vector in expected.items():
        np.testing.assert_allclose(got[face_id], vector, atol=1e-6)
    spread = [wanted[0], wanted[-1]]  # 2 ids over a range of 50: by the ids
    assert sorted(store.vectors(spread, DIM)) == spread and len(ranges) == 1
    store.delete_face("c", wanted[3])
    assert sorted(store.vectors(wanted[:6], DIM)) == wanted[:3] + wanted[4:6]
    with engine.begin() as connection:
        connection.execute(text("UPDATE faces SET embedding = :blob WHERE id = :id"),
                           {"blob": b"\0" * (4 * DIM - 4), "id": wanted[0]})
    for ids in (wanted[:6], spread):
        with pytest.raises(InvalidEmbedding):
            store.vectors(ids, DIM)


def test_reading_a_collections_vectors_holds_little_more_than_them(store: GalleryStore,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gallery_store, "VECTOR_PAGE", 256, raising=False)  # small beside the 16 MiB read
    rng = np.random.default_rng(42)
    store.create_collection("c", MODEL, 512, 0.5)
    for number in range(8):  # 8,000 x 512: 16 MiB of vectors
        faces = new_faces(unit_vectors(rng, 1000, 512), crop=None, tag=f"p{number}")
        store.add_faces("c", f"p{number}", faces, MODEL, create=(f"P{number}", {}))
    collection = store.get_collection("c").id
    tracemalloc.start()
    try:
        _, _, matrix = store.collection_vectors(collection, 512)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # every row at once, then their bytes joined, then a converted copy: about three times the vectors
    assert peak < 1.5 * matrix.nbytes, (peak, matrix.nbytes)


def test_a_postgresql_server_that_never_answers_fails_the_connection_in_seconds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """libpq waits forever by default for a server that accepted the TCP connection and says nothing (one
    wedged, or a network dropping packets: then the kernel's timeout, minutes), holding a worker thread of
    every readiness check; the engine now gives up after ``CONNECT_TIMEOUT_S`` (unless the URL sets one)."""
    import socket

    from sqlalchemy.exc import OperationalError

    import gallery.store.db as db

    monkeypatch.setattr(db, "CONNECT_TIMEOUT_S", 1)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    outcome: list[BaseException | None] = []

    def connect() -> None:
        engine = create_db_engine(f"postgresql+psycopg://u@127.0.0.1:{silent.getsockname()[1]}/db")
        try:
            with engine.connect():
                outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)
        finally:
            engine.dispose()

    worker = threading.Thread(target=connect, daemon=True)
    try:
        worker.start()
        worker.join(timeout=20)
    finally:
        silent.close()
    assert outcome and isinstance(outcome[0], OperationalError), "still connecting after 20 s"
