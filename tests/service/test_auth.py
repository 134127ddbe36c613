"""Remembered API keys (``service/auth.py``): a key found valid needs no query on its next requests, and a
revocation or a collection deletion is never hidden by that memory, here at once, on another replica
at its next check of the key table. Against the real database (SQLite and PostgreSQL)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from gallery.store.db import Database
from gallery.store.store import GalleryStore
from service.auth import KeyStore, Principal, _hash

pytest_plugins = ["tests.gallery.fixtures"]

ADMIN = "admin-secret-for-tests"


class Counting:
    """Wraps ``KeyRecords.find`` to count the queries (and run ``during`` inside one)."""

    def __init__(self, keys: KeyStore) -> None:
        self.calls = 0
        self.during: Any = None
        self._find = keys.records.find
        keys.records.find = self  # type: ignore[method-assign]

    def __call__(self, key_hash: str) -> tuple[int, str] | None:
        self.calls += 1
        found = self._find(key_hash)
        if self.during is not None:
            self.during()
        return found


@pytest.fixture
def db(store: GalleryStore) -> Database:
    store.create_collection("alpha", "sface", 128, 0.363)
    return store.db


def test_a_valid_key_is_remembered_and_a_revocation_here_forgets_it(db: Database) -> None:
    keys = KeyStore(db, ADMIN)
    counting = Counting(keys)
    secret, info = keys.create("alpha", "kiosk")
    assert keys.remembered(secret) is None
    expected = Principal(admin=False, collection="alpha", key_id=info.id)
    assert keys.authenticate(secret) == expected and keys.authenticate(secret) == expected
    assert counting.calls == 1 and keys.remembered(secret) == expected
    keys.revoke("alpha", info.id)
    assert keys.remembered(secret) is None and keys.authenticate(secret) is None and counting.calls == 2
    assert keys.authenticate(ADMIN) == Principal(admin=True) and keys.remembered(ADMIN) is None


def test_a_refusal_is_not_remembered(db: Database) -> None:
    keys, other = KeyStore(db, ADMIN), KeyStore(db, ADMIN)
    presented = "frk_0000_made-up-before-it-exists"
    assert keys.authenticate(presented) is None
    other.records.add("alpha", "0000", _hash(presented), "late")  # created through another replica
    found = keys.authenticate(presented)
    assert found is not None and found.collection == "alpha"


def test_a_revocation_on_another_replica_is_seen_at_the_next_check(db: Database) -> None:
    here, there = KeyStore(db, ADMIN), KeyStore(db, ADMIN)
    secret, info = there.create("alpha")
    here.refresh()
    assert here.authenticate(secret) is not None
    there.revoke("alpha", info.id)
    assert here.remembered(secret) is not None  # until the check
    assert here.refresh() and here.authenticate(secret) is None
    assert not here.refresh()  # nothing changed since


def test_the_watch_thread_applies_another_replicas_revocation(db: Database) -> None:
    here, there = KeyStore(db, ADMIN), KeyStore(db, ADMIN)
    secret, info = there.create("alpha")
    here.start_watch(0.05)
    try:
        assert here.authenticate(secret) is not None
        there.revoke("alpha", info.id)
        deadline = time.monotonic() + 5
        while here.remembered(secret) is not None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert here.remembered(secret) is None and here.authenticate(secret) is None
    finally:
        here.stop_watch()


def test_a_deleted_collection_s_keys_are_forgotten_even_when_a_key_is_added_meanwhile(
        store: GalleryStore, db: Database) -> None:
    here, there = KeyStore(db, ADMIN), KeyStore(db, ADMIN)
    old, _ = there.create("alpha")
    here.refresh()
    assert here.authenticate(old) is not None
    store.delete_collection("alpha")  # elsewhere: the keys go with it (cascade)
    store.create_collection("alpha", "sface", 128, 0.363)
    there.create("alpha")  # as many keys as before: the count alone would not change
    assert here.refresh() and here.authenticate(old) is None


def test_a_lookup_that_raced_a_forget_does_not_remember(db: Database) -> None:
    keys = KeyStore(db, ADMIN)
    secret, _ = keys.create("alpha")
    counting = Counting(keys)
    counting.during = keys.forget  # a revocation noticed while the row was being read
    assert keys.authenticate(secret) is not None
    assert keys.remembered(secret) is None
    counting.during = None
    keys.authenticate(secret)
    assert keys.remembered(secret) is not None and counting.calls == 2


def test_the_memory_is_bounded(db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("service.auth.MAX_REMEMBERED", 2)
    keys = KeyStore(db, ADMIN)
    secrets = [keys.create("alpha")[0] for _ in range(3)]
    for secret in secrets:
        assert keys.authenticate(secret) is not None
    assert [keys.remembered(s) is not None for s in secrets] == [False, False, True]



def test_while_the_key_table_cannot_be_read_nothing_is_remembered(db: Database) -> None:
    keys = KeyStore(db, ADMIN)
    secret, _ = keys.create("alpha")
    failures = {"left": 3}
    signature = keys.records.signature

    def flaky() -> tuple[int, int, int]:
        if failures["left"]:
            failures["left"] -= 1
            raise ConnectionError("database unreachable")
        return signature()

    keys.records.signature = flaky  # type: ignore[method-assign]
    assert keys.authenticate(secret) is not None
    keys.start_watch(0.02)
    try:
        deadline = time.monotonic() + 5
        while keys.remembered(secret) is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert keys.remembered(secret) is None  # forgotten on the failed check
        while keys._signature is None and time.monotonic() < deadline:  # the watch goes on after them
            time.sleep(0.01)
        assert keys.authenticate(secret) is not None and keys.remembered(secret) is not None
    finally:
        keys.stop_watch()
