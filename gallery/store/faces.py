"""Face and identity operations across a collection: one stored face with its vector (search by face,
verification against one face), every face with its identity (paginated), deleting all faces of an
identity or every identity, and renaming an identity (merging into an existing one).

Like ``GalleryStore``, every method is one transaction, and every change of which vectors exist or
to whom they belong is written to the change log in the same transaction.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray
from sqlalchemy import ColumnElement, delete, func, insert, literal, select, update
from sqlalchemy.orm import Session

from gallery.embeddings import decode_vector
from gallery.errors import Conflict, NotFound
from gallery.store.db import Database
from gallery.store.models import ChangeOp, Face, FaceChange, Identity
from gallery.store.store import FaceInfo, GalleryStore, _face_info, collection_row


@dataclass(frozen=True)
class StoredFace:
    face: FaceInfo
    external_id: str
    vector: NDArray[np.float32]


class FaceRecords:
    def __init__(self, db: Database) -> None:
        self.db = db

    def get(self, collection: str, face_id: int) -> StoredFace:
        """One face of the collection with its identity's external id and its embedding."""
        with self.db.read() as session:
            owner = collection_row(session, collection)
            row = session.execute(select(Face, Identity.external_id)
                                  .join(Identity, Identity.id == Face.identity_id)
                                  .where(Face.id == face_id, Face.collection_id == owner.id)).first()
            if row is None:
                raise NotFound(f"face {face_id} does not exist in {collection!r}", face_id=face_id)
            face, external_id = row
            return StoredFace(_face_info(face), external_id, decode_vector(face.embedding, owner.dimension))

    def page(self, collection: str, external_id: str | None, offset: int, limit: int
             ) -> tuple[list[tuple[FaceInfo, str]], int]:
        """Faces (with their identity's external id) of the collection or of one identity, by face id;
        and how many there are in all."""
        with self.db.read() as session:
            owner = collection_row(session, collection)
            query = (select(Face, Identity.external_id).join(Identity, Identity.id == Face.identity_id)
                     .where(Face.collection_id == owner.id))
            if external_id is not None:
                query = query.where(Identity.external_id == external_id)
            total = session.scalar(select(func.count()).select_from(query.subquery())) or 0
            rows = session.execute(query.order_by(Face.id).offset(offset).limit(limit)).all()
            return [(_face_info(face), ext) for face, ext in rows], int(total)

    @staticmethod
    def _remove(session: Session, collection_id: int, *where: ColumnElement[bool]) -> int:
        """Delete the collection's faces that match ``where``, each logged as removed; returns how many.

        By condition, never by a list of ids (one bind parameter per face: SQLite refuses more than its
        limit, 32,766 or 250,000 by build, psycopg more than 65,535). The log rows and the deletion see
        the same faces: change-log writers are serialized (``Database.write``)."""
        which = (Face.collection_id == collection_id, *where)
        connection = session.connection()  # the session's transaction
        connection.execute(insert(FaceChange).from_select(
            ["collection_id", "face_id", "identity_id", "op"],
            select(literal(collection_id), Face.id, Face.identity_id, literal(ChangeOp.REMOVE.value))
            .where(*which).order_by(Face.id)))
        return connection.execute(delete(Face).where(*which)).rowcount

    def delete_faces_of(self, collection: str, external_id: str | None) -> int:
        """Delete every face of one identity (or of the whole collection); the identities stay."""
        with self.db.write() as session:
            owner = collection_row(session, collection)
            if external_id is None:
                return self._remove(session, owner.id)
            identity = session.scalar(select(Identity.id).where(Identity.collection_id == owner.id,
                                                                Identity.external_id == external_id))
            return 0 if identity is None else self._remove(session, owner.id, Face.identity_id == identity)

    def delete_identities(self, collection: str) -> int:
        """Erase every identity of the collection with its faces; returns how many identities."""
        with self.db.write() as session:
            owner = collection_row(session, collection)
            self._remove(session, owner.id)
            count = session.scalar(select(func.count()).where(Identity.collection_id == owner.id)) or 0
            session.execute(delete(Identity).where(Identity.collection_id == owner.id))
            return int(count)

    def rename(self, collection: str, old: str, new: str) -> None:
        """Give identity ``old`` the external id ``new``; when ``new`` exists, ``old``'s faces move to it
        and ``old`` is removed (the change log re-adds the moved faces under their new identity)."""
        if not new:
            raise ValueError("the new external id must not be empty")
        with self.db.write() as session:
            owner = collection_row(session, collection)
            source = session.scalar(select(Identity).where(Identity.collection_id == owner.id,
                                                           Identity.external_id == old))
            if source is None:
                raise NotFound(f"identity {old!r} does not exist", external_id=old)
            target = session.scalar(select(Identity).where(Identity.collection_id == owner.id,
                                                           Identity.external_id == new))
            if target is None:
                source.external_id = new
                GalleryStore._log(session, owner.id, [(0, source.id)], ChangeOp.RELABEL)
                return
            if target.id == source.id:
                raise Conflict(f"identity {old!r} already has that external id")
            moved = [int(f) for f in session.scalars(select(Face.id).where(Face.identity_id == source.id))]
            GalleryStore._log(session, owner.id, [(f, source.id) for f in moved], ChangeOp.REMOVE)
            session.execute(update(Face).where(Face.identity_id == source.id).values(identity_id=target.id))
            GalleryStore._log(session, owner.id, [(f, target.id) for f in moved], ChangeOp.ADD)
            session.execute(delete(Identity).where(Identity.id == source.id))
