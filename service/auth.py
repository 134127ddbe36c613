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
from datetime import datetime

from sqlalchemy import select

from gallery.db import Database
from gallery.errors import NotFound
from gallery.models import ApiKey, Collection, utcnow

KEY_PREFIX = "frk_"


@dataclass(frozen=True)
class Principal:
    """Who is calling: the admin, or the holder of one collection's key."""

    admin: bool
    collection: str | None = None
    key_id: int | None = None

    def can_access(self, collection: str) -> bool:
        return self.admin or self.collection == collection


@dataclass(frozen=True)
class KeyInfo:
    id: int
    collection: str
    prefix: str
    label: str
    created_at: datetime
    revoked_at: datetime | None


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class KeyStore:
    def __init__(self, db: Database, admin_key: str) -> None:
        self.db = db
        self._admin_hash = _hash(admin_key)

    def authenticate(self, presented: str) -> Principal | None:
        """The principal behind a presented key, or None when it is unknown or revoked."""
        digest = _hash(presented)
        if hmac.compare_digest(digest, self._admin_hash):
            return Principal(admin=True)
        if not presented.startswith(KEY_PREFIX):
            return None
        with self.db.read() as session:
            row = session.execute(
                select(ApiKey.id, Collection.name)
                .join(Collection, Collection.id == ApiKey.collection_id)
                .where(ApiKey.key_hash == digest, ApiKey.revoked_at.is_(None))
            ).first()
        return None if row is None else Principal(admin=False, collection=row[1], key_id=row[0])

    def create(self, collection: str, label: str = "") -> tuple[str, KeyInfo]:
        """A new key for ``collection``; the secret is returned once and never stored."""
        prefix = secrets.token_hex(4)
        key = f"{KEY_PREFIX}{prefix}_{secrets.token_urlsafe(32)}"
        with self.db.write() as session:
            owner = session.scalar(select(Collection).where(Collection.name == collection))
            if owner is None:
                raise NotFound(f"collection {collection!r} does not exist", collection=collection)
            row = ApiKey(collection_id=owner.id, prefix=prefix, key_hash=_hash(key), label=label)
            session.add(row)
            session.flush()
            return key, KeyInfo(row.id, collection, prefix, label, row.created_at, None)

    def list(self, collection: str) -> list[KeyInfo]:
        with self.db.read() as session:
            owner = session.scalar(select(Collection).where(Collection.name == collection))
            if owner is None:
                raise NotFound(f"collection {collection!r} does not exist", collection=collection)
            rows = session.scalars(select(ApiKey).where(ApiKey.collection_id == owner.id).order_by(ApiKey.id))
            return [KeyInfo(r.id, collection, r.prefix, r.label, r.created_at, r.revoked_at) for r in rows]

    def revoke(self, collection: str, key_id: int) -> None:
        with self.db.write() as session:
            row = session.scalar(
                select(ApiKey).join(Collection, Collection.id == ApiKey.collection_id)
                .where(ApiKey.id == key_id, Collection.name == collection)
            )
            if row is None:
                raise NotFound(f"key {key_id} does not exist in {collection!r}", key_id=key_id)
            if row.revoked_at is None:
                row.revoked_at = utcnow()
