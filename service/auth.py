"""API keys: one admin key from the settings, per-collection keys created by the admin.

Keys travel in the ``X-API-Key`` header (or ``Authorization: Bearer``). Collection keys look like
``frk_<prefix>_<secret>``; only the SHA-256 of the whole key is stored (the keys are 256-bit random,
so a fast hash is enough). A key found in the database is remembered, so that its next requests need no
query: the gateway that revokes a key (or deletes its collection) forgets it at once, and every gateway
checks the key table's signature (``KeyRecords.signature``) every follower interval
(``FACEREC_GALLERY__FOLLOW_INTERVAL_S``, 0.2 s) and forgets every key when it changed, so a revocation
on another replica takes effect within that interval, like an enrolment there.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
from dataclasses import dataclass

from facecore.periodic import Periodic
from gallery.store.db import Database
from gallery.store.keys import KeyInfo, KeyRecords

KEY_PREFIX = "frk_"


@dataclass(frozen=True)
class Principal:
    """Who is calling: the admin, or the holder of one collection's key."""

    admin: bool
    collection: str | None = None
    key_id: int | None = None

    def can_access(self, collection: str) -> bool:
        return self.admin or self.collection == collection


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


#: Keys remembered at most; past it the memory starts again empty (a real gallery has a few keys).
MAX_REMEMBERED = 10_000


class KeyStore:
    """Thread-safe. ``remembered`` answers on the event loop; ``authenticate`` may query the database."""

    def __init__(self, db: Database, admin_key: str) -> None:
        self.records = KeyRecords(db)
        self._admin_hash = _hash(admin_key)
        self._known: dict[str, Principal] = {}  # by key hash: valid keys only, never refusals
        self._generation = 0  # bumped by every forget: a lookup begun before it does not remember
        self._signature: tuple[int, int, int] | None = None
        self._lock = threading.Lock()
        self._watch = Periodic("key-watch", self.refresh, "key table check failed", on_error=self._unsure)

    def is_admin(self, presented: str) -> bool:
        """The admin key needs no database: callers check it first, on the event loop."""
        return hmac.compare_digest(_hash(presented), self._admin_hash)

    def needs_lookup(self, presented: str) -> bool:
        return presented.startswith(KEY_PREFIX)

    def remembered(self, presented: str) -> Principal | None:
        """The principal of a collection key found valid since the last forget, without the database."""
        return self._known.get(_hash(presented))

    def authenticate(self, presented: str) -> Principal | None:
        """The principal behind a presented key, or None when it is unknown or revoked."""
        digest = _hash(presented)
        if hmac.compare_digest(digest, self._admin_hash):
            return Principal(admin=True)
        if not presented.startswith(KEY_PREFIX):
            return None
        known = self._known.get(digest)
        if known is not None:
            return known
        generation = self._generation
        found = self.records.find(digest)
        if found is None:
            return None
        principal = Principal(admin=False, collection=found[1], key_id=found[0])
        with self._lock:
            if generation == self._generation:  # no revocation was noticed while the row was read
                if len(self._known) >= MAX_REMEMBERED:
                    self._known.clear()
                self._known[digest] = principal
        return principal

    def forget(self) -> None:
        """Forget every remembered key (after a revocation or a collection deletion here)."""
        with self._lock:
            self._generation += 1
            self._known.clear()

    def _unsure(self) -> None:
        """The key table cannot be read (the database is down): the remembered keys stay valid, so identify
        keeps answering their callers from the index in memory, and the first check that reads the table
        again forgets them all (its signature is unknown), catching a revocation made on another replica in
        the follower interval before the outage. No revocation can be written while the database is down."""
        self._signature = None

    def refresh(self) -> bool:
        """Forget every remembered key when the key table's signature changed; True when it did."""
        signature = self.records.signature()
        if signature == self._signature:
            return False
        self.forget()
        self._signature = signature
        return True

    def start_watch(self, interval_s: float) -> None:
        """Call ``refresh`` every ``interval_s`` in a daemon thread (revocations by other replicas); while
        the database cannot be read, the remembered keys stay valid (``_unsure``)."""
        self._watch.start(interval_s)

    def stop_watch(self) -> None:
        self._watch.stop()

    def create(self, collection: str, label: str = "") -> tuple[str, KeyInfo]:
        """A new key for ``collection``; the secret is returned once and never stored."""
        prefix = secrets.token_hex(4)
        key = f"{KEY_PREFIX}{prefix}_{secrets.token_urlsafe(32)}"
        return key, self.records.add(collection, prefix, _hash(key), label)

    def list(self, collection: str) -> list[KeyInfo]:
        return self.records.list(collection)

    def revoke(self, collection: str, key_id: int) -> None:
        self.records.revoke(collection, key_id)
        self.forget()
