"""Stored API keys: only the SHA-256 of each key, per collection, with its revocation time.

The gateway's ``service/auth.py`` makes and checks keys; this module is where they are kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import bindparam, func, select

from gallery.errors import NotFound
from gallery.store.db import Database
from gallery.store.models import ApiKey, Collection, utcnow
from gallery.store.store import collection_row

#: Every authenticated request runs this: built once (statement construction costs as much as the query).
_FIND = (select(ApiKey.id, Collection.name).join(Collection, Collection.id == ApiKey.collection_id)
         .where(ApiKey.key_hash == bindparam("key_hash"), ApiKey.revoked_at.is_(None)))

#: What any revocation or deletion of a key changes: ids are never reused (autoincrement), so a deletion
#: that an addition hides from the count still changes the sum.
_SIGNATURE = select(func.count(ApiKey.id), func.count(ApiKey.revoked_at),
                    func.coalesce(func.sum(ApiKey.id), 0))


@dataclass(frozen=True)
class KeyInfo:
    id: int
    collection: str
    prefix: str
    label: str
    created_at: datetime
    revoked_at: datetime | None


class KeyRecords:
    def __init__(self, db: Database) -> None:
        self.db = db
        self._signature = db.polled(_SIGNATURE)

    def find(self, key_hash: str) -> tuple[int, str] | None:
        """(key id, collection name) of a key that is not revoked, by its hash."""
        rows = self.db.fetch(_FIND, {"key_hash": key_hash})
        return (int(rows[0][0]), str(rows[0][1])) if rows else None

    def signature(self) -> tuple[int, int, int]:
        """(keys, revoked keys, sum of key ids): it changes whenever a key is revoked or deleted."""
        count, revoked, total = self._signature.rows()[0]
        return int(count), int(revoked), int(total)

    def add(self, collection: str, prefix: str, key_hash: str, label: str) -> KeyInfo:
        with self.db.write() as session:
            owner = collection_row(session, collection)
            row = ApiKey(collection_id=owner.id, prefix=prefix, key_hash=key_hash, label=label)
            session.add(row)
            session.flush()
            return KeyInfo(row.id, collection, prefix, label, row.created_at, None)

    def list(self, collection: str) -> list[KeyInfo]:
        with self.db.read() as session:
            owner = collection_row(session, collection)
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
