"""A collection's match policy and the calibration measured on its faces, changed in place.

Each change is one transaction that also appends a ``policy`` row to the change log, so that every
replica reads the collection again and decides with the new policy.
"""

from __future__ import annotations

from typing import Any

from gallery.store.db import Database
from gallery.store.models import ChangeOp, Collection, FaceChange
from gallery.store.store import CollectionInfo, _collection_info, collection_row


class CollectionPolicies:
    def __init__(self, db: Database) -> None:
        self.db = db

    def set_policy(self, collection: str, target_fpir: float | None,
                   match_threshold: float | None = None) -> CollectionInfo:
        """Decide at ``target_fpir`` (a threshold derived at the collection's size), or, with None, at the
        fixed ``match_threshold`` (default: the collection's own)."""
        if target_fpir is not None and not 0.0 < target_fpir <= 0.5:
            raise ValueError("a target false-positive identification rate is in (0, 0.5]")
        if match_threshold is not None and not -1.0 <= match_threshold <= 1.0:
            raise ValueError("a threshold is in [-1, 1]")
        with self.db.write() as session:
            row = collection_row(session, collection)
            row.match_policy = "fixed" if target_fpir is None else "fpir"
            row.target_fpir = target_fpir
            if match_threshold is not None:
                row.match_threshold = match_threshold
            session.add(FaceChange(collection_id=row.id, face_id=0, identity_id=0, op=ChangeOp.POLICY.value))
            session.flush()
            return _collection_info(row)

    def save_calibration(self, collection_id: int, embedding_model: str, calibration: dict[str, Any]) -> bool:
        """Store what was measured on the collection's faces; False (nothing stored) when the collection
        is gone or holds another model's embeddings now (re-embedded while it was measured)."""
        with self.db.write() as session:
            row = session.get(Collection, collection_id)
            if row is None or row.embedding_model != embedding_model:
                return False
            row.calibration = calibration
            session.add(FaceChange(collection_id=row.id, face_id=0, identity_id=0, op=ChangeOp.POLICY.value))
            return True
