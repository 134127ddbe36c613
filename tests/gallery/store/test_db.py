"""``Database.polled``: the change-log and key-table polls that every gateway runs five times a second, on a
pooled DB-API connection below SQLAlchemy's execution layer, on SQLite and PostgreSQL; ``storage_full``."""

from __future__ import annotations

import sqlite3

import numpy as np
import psycopg
import pytest
from sqlalchemy import Engine, event, exc, literal_column, select, table

from gallery.store.db import storage_full
from gallery.store.keys import _SIGNATURE, KeyRecords
from gallery.store.store import _CHANGES, GalleryStore
from tests.gallery.helpers import MODEL, new_faces, unit_vectors

pytest_plugins = ["tests.gallery.fixtures"]

DIM = 16


def test_polled_rows_are_the_rows_fetch_returns(store: GalleryStore) -> None:
    rng = np.random.default_rng(3)
    store.create_collection("people", MODEL, DIM, 0.5)
    for person in ("ann", "bob"):
        store.add_faces("people", person, new_faces(unit_vectors(rng, 2, DIM)), MODEL, create=(person, {}))
    store.delete_identity("people", "ann")
    keys = KeyRecords(store.db)
    first = keys.add("people", "aaaa", "hash-a", "")
    keys.add("people", "bbbb", "hash-b", "")
    keys.revoke("people", first.id)
    for statement, parameters in ((_CHANGES, {"seq": 0, "limit": 10_000}), (_CHANGES, {"seq": 2, "limit": 3}),
                                  (_CHANGES, {"seq": 10**9, "limit": 10}), (_SIGNATURE, {})):
        polled = store.db.polled(statement).rows(parameters)
        assert polled == store.db.fetch(statement, parameters)
    assert len(store.changes_since(0)) == 6 and [c.seq for c in store.changes_since(2, limit=3)] == [3, 4, 5]
    assert [int(v) for v in keys.signature()] == [2, 1, first.id + first.id + 1]


def test_the_polls_skip_sqlalchemys_execution_layer(store: GalleryStore, engine: Engine) -> None:
    executed: list[str] = []
    event.listen(engine, "before_cursor_execute", lambda *args: executed.append(args[2]))
    store.create_collection("people", MODEL, DIM, 0.5)
    executed.clear()
    assert store.changes_since(0) == [] and KeyRecords(store.db).signature() == (0, 0, 0)
    assert executed == [], "a poll went through SQLAlchemy's connection (Database.fetch costs ~3x the CPU)"
    assert store.last_seq() == 0 and executed, "the listener sees what goes through it"


def test_a_driver_error_is_raised_as_sqlalchemys_and_the_next_poll_works(store: GalleryStore) -> None:
    broken = store.db.polled(select(literal_column("1")).select_from(table("no_such_table")))
    for _ in range(3):  # more than once: a PostgreSQL connection left in a failed transaction would show
        with pytest.raises(exc.DBAPIError) as raised:
            broken.rows()
        assert "no_such_table" in str(raised.value)
        assert store.changes_since(0) == [] and KeyRecords(store.db).signature() == (0, 0, 0)


def test_a_full_disk_is_told_apart_from_a_database_that_is_down() -> None:
    """``storage_full``: the gateway answers 507 ``storage_full`` for these, 503 for the others."""
    full = sqlite3.OperationalError("database or disk is full")
    full.sqlite_errorcode = sqlite3.SQLITE_FULL  # as sqlite3 sets it (Python 3.11+)
    assert storage_full(full) and storage_full(psycopg.errors.DiskFull("could not extend file"))
    locked = sqlite3.OperationalError("database is locked")
    locked.sqlite_errorcode = sqlite3.SQLITE_BUSY
    assert not any(storage_full(e) for e in (locked, psycopg.OperationalError("connection refused"), None))
