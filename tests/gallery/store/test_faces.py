"""FaceRecords' bulk deletions (CompreFace's "delete all examples", "delete every subject") on SQLite and
PostgreSQL: every deleted face reaches the change log, so the index followers drop it, whatever the size
of the collection."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from sqlalchemy import Engine, text

from gallery.engines.selection import IndexConfig
from gallery.gallery import Gallery
from gallery.store.faces import FaceRecords
from gallery.store.models import ChangeOp
from gallery.store.store import GalleryStore
from tests.gallery.helpers import MODEL, db_faces, new_faces, sql_scalar, unit_vectors

pytest_plugins = ["tests.gallery.fixtures"]

DIM = 16
#: More faces than a statement may have bind parameters: SQLite's 250,000 on some builds (32,766 by
#: default), psycopg's 65,535.
MANY = 250_001
_COLUMNS = ("identity_id, collection_id, embedding, embedding_model, image_sha256, box, detection_score, "
            "quality, crop, created_at")


def enrolled(store: GalleryStore) -> dict[str, int]:
    """Collections ``c`` (ann and bob, a face each) and ``other`` (ann, a face); the identity ids of ``c``."""
    rng = np.random.default_rng(3)
    store.create_collection("c", MODEL, DIM, 0.5)
    store.create_collection("other", MODEL, DIM, 0.5)
    ann, _ = store.add_faces("c", "ann", new_faces(unit_vectors(rng, 1, DIM), tag="ann"), MODEL,
                             create=("Ann", {}))
    bob, _ = store.add_faces("c", "bob", new_faces(unit_vectors(rng, 1, DIM), tag="bob"), MODEL,
                             create=("Bob", {}))
    store.add_faces("other", "ann", new_faces(unit_vectors(rng, 1, DIM), tag="other"), MODEL, create=("", {}))
    return {"ann": ann.id, "bob": bob.id}


def removed_since(store: GalleryStore, seq: int) -> dict[int, int]:
    """face id -> identity id of the REMOVE rows after ``seq`` (every other row there is a failure)."""
    changes = store.changes_since(seq, limit=10 * MANY)
    assert {c.op for c in changes} <= {ChangeOp.REMOVE}, {c.op for c in changes}
    removed = {c.face_id: c.identity_id for c in changes}
    assert len(removed) == len(changes), "a face logged twice"
    return removed


def test_deleting_every_example_of_a_big_collection(store: GalleryStore, engine: Engine,
                                                    tmp_path: Path) -> None:
    """The faces are deleted by collection, not by a list of their ids (one bind parameter each: beyond the
    driver's limit the database refused it, a 503 on every try); each is logged, so an index drops it."""
    enrolled(store)
    in_c = "WHERE collection_id = (SELECT id FROM collections WHERE name = 'c')"
    with engine.begin() as connection:  # copies of c's faces, straight in SQL: 2 faces become 2**18
        while connection.execute(text(f"SELECT count(*) FROM faces {in_c}")).scalar_one() < MANY:
            connection.execute(text(f"INSERT INTO faces ({_COLUMNS}) SELECT {_COLUMNS} FROM faces {in_c}"))
    before = db_faces(engine, "c")
    assert len(before) > MANY
    gallery = Gallery(store, tmp_path / "index", IndexConfig(exact_max=2 * MANY, exact_always=2 * MANY))
    gallery.load()
    assert len(gallery.face_ids("c")) == len(before)
    seq = store.last_seq()

    assert FaceRecords(store.db).delete_faces_of("c", None) == len(before)

    assert db_faces(engine, "c") == {} and len(db_faces(engine, "other")) == 1
    assert removed_since(store, seq) == before
    assert sql_scalar(engine, "SELECT count(*) FROM identities") == 3  # the subjects stay
    gallery.sync()
    assert gallery.face_ids("c") == set() and len(gallery.face_ids("other")) == 1


def test_deleting_the_examples_of_one_subject(store: GalleryStore, engine: Engine) -> None:
    identities = enrolled(store)
    faces = FaceRecords(store.db)
    before = db_faces(engine, "c")
    seq = store.last_seq()
    assert faces.delete_faces_of("c", "nobody") == 0 and store.last_seq() == seq
    assert faces.delete_faces_of("c", "ann") == 1
    assert removed_since(store, seq) == {f: i for f, i in before.items() if i == identities["ann"]}
    assert db_faces(engine, "c") == {f: i for f, i in before.items() if i == identities["bob"]}
    assert len(db_faces(engine, "other")) == 1
    assert store.get_identity("c", "ann").external_id == "ann"  # the subject stays


def test_deleting_every_subject_logs_each_face(store: GalleryStore, engine: Engine) -> None:
    enrolled(store)
    before = db_faces(engine, "c")
    seq = store.last_seq()
    assert FaceRecords(store.db).delete_identities("c") == 2
    assert removed_since(store, seq) == before
    assert db_faces(engine, "c") == {} and len(db_faces(engine, "other")) == 1
    assert sql_scalar(engine, "SELECT count(*) FROM identities") == 1
