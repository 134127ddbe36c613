"""API keys: one admin key from the settings, per-collection keys created by the admin.

Keys travel in the ``X-API-Key`` header (or ``Authorization: Bearer``). Collection keys look like
``frk_<prefix>_<secret>``; only the SHA-256 of the whole key is stored (the keys are 256-bit random,
so a fast hash is enough), and revoked keys stop working at once.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from gallery.db import Database
from gallery.keys import KeyInfo, KeyRecords

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


class KeyStore:
    def __init__(self, db: Database, admin_key: str) -> None:
        self.records = KeyRecords(db)
        self._admin_hash = _hash(admin_key)

    def is_admin(self, presented: str) -> bool:
        """The admin key needs no database: callers check it first, on the event loop."""
        return hmac.compare_digest(_hash(presented), self._admin_hash)

    def needs_lookup(self, presented: str) -> bool:
        return presented.startswith(KEY_PREFIX)

    def authenticate(self, presented: str) -> Principal | None:
        """The principal behind a presented key, or None when it is unknown or revoked."""
        digest = _hash(presented)
        if hmac.compare_digest(digest, self._admin_hash):
            return Principal(admin=True)
        if not presented.startswith(KEY_PREFIX):
            return None
        found = self.records.find(digest)
        return None if found is None else Principal(admin=False, collection=found[1], key_id=found[0])

    def create(self, collection: str, label: str = "") -> tuple[str, KeyInfo]:
        """A new key for ``collection``; the secret is returned once and never stored."""
        prefix = secrets.token_hex(4)
        key = f"{KEY_PREFIX}{prefix}_{secrets.token_urlsafe(32)}"
        return key, self.records.add(collection, prefix, _hash(key), label)

    def list(self, collection: str) -> list[KeyInfo]:
        return self.records.list(collection)

    def revoke(self, collection: str, key_id: int) -> None:
        self.records.revoke(collection, key_id)
