"""Transactional operations on the gallery database (the source of truth).

Every write that changes which vectors exist appends ``face_changes`` rows in the same transaction,
so a crash leaves either the whole change (rows + log) or none of it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray
from sqlalchemy import bindparam, delete, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from gallery.embeddings import decode_vector, encode_vector, validate_embeddings
from gallery.errors import Conflict, CropsMissing, ModelMismatch, NotFound
from gallery.store.db import Database
from gallery.store.models import ChangeOp, Collection, Face, FaceChange, Identity

#: Every search runs this (the labels of its candidates): built once.
_LABELS = select(Identity.id, Identity.external_id, Identity.name).where(
    Identity.id.in_(bindparam("ids", expanding=True)))
_FIRST_LABELS = select(Identity.id, Identity.external_id, Identity.name).order_by(Identity.id).limit(
    bindparam("limit"))
#: The follower's poll, built once (building a statement costs as much as running it).
_CHANGES = (select(FaceChange.seq, FaceChange.collection_id, FaceChange.face_id, FaceChange.identity_id,
                   FaceChange.op).where(FaceChange.seq > bindparam("seq")).order_by(FaceChange.seq)
            .limit(bindparam("limit")))
_LAST_SEQ = select(func.max(FaceChange.seq))
#: What a follower reads to apply the faces another process added: their vectors by a range of ids (an
#: import's, an enrolment's, are consecutive), or by the ids themselves where they are spread out.
_FACE_RANGE = select(Face.id, Face.embedding).where(Face.id.between(bindparam("lo"), bindparam("hi")))
_FACES_BY_ID = select(Face.id, Face.embedding).where(Face.id.in_(bindparam("ids", expanding=True)))
#: Rows read at a time when a whole collection's vectors are read (8 MiB of 512-d vectors).
VECTOR_PAGE = 4096


def _face_count(session: Session, collection_id: int) -> int:
    count = session.scalar(select(func.count()).select_from(Face).where(Face.collection_id == collection_id))
    return int(count or 0)


def _decoded(rows: Sequence[tuple[Any, ...]], wanted: NDArray[np.int64], dimension: int
             ) -> tuple[NDArray[np.int64], NDArray[np.float32]]:
    """Face ids and vectors [N, dimension] of the (id, embedding bytes) rows whose id is ``wanted``,
    converted at once (the others, e.g. another collection's faces of another dimension, left unread)."""
    ids = np.fromiter((row[0] for row in rows), np.int64, len(rows))
    keep = np.flatnonzero(np.isin(ids, wanted)).tolist()
    blobs = [rows[n][1] for n in keep]
    for blob in blobs:
        if len(blob) != 4 * dimension:
            decode_vector(blob, dimension)  # raises InvalidEmbedding, naming the sizes
    matrix = np.frombuffer(b"".join(blobs), "<f4").reshape(len(blobs), dimension).astype(np.float32)
    return ids[keep], matrix


@dataclass(frozen=True)
class CollectionInfo:
    id: int
    name: str
    embedding_model: str
    dimension: int
    match_threshold: float
    keep_crops: bool
    created_at: datetime
    match_policy: str = "fixed"  # or "fpir": gallery.calibration
    target_fpir: float | None = None
    calibration: dict[str, Any] | None = None


@dataclass(frozen=True)
class IdentityInfo:
    id: int
    collection_id: int
    external_id: str
    name: str
    metadata: dict[str, Any]
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True)
class FaceInfo:
    id: int
    identity_id: int
    image_sha256: str
    box: list[float]
    detection_score: float
    quality: dict[str, Any]
    has_crop: bool
    created_at: datetime


@dataclass(frozen=True)
class NewFace:
    """A face to enroll; ``embedding`` is validated and L2-normalized on the way in."""

    embedding: NDArray[np.float32]
    image_sha256: str
    box: Sequence[float]
    detection_score: float
    quality: dict[str, Any] = field(default_factory=dict)
    crop: bytes | None = None


class Change(NamedTuple):
    """One row of the change log (a tuple: a follower reads thousands at a time, made cheaply)."""

    seq: int
    collection_id: int
    face_id: int
    identity_id: int
    op: ChangeOp


_OPS = {op.value: op for op in ChangeOp}


def check_model(info: CollectionInfo, embedding_model: str) -> None:
    """``ModelMismatch`` unless the collection holds embeddings of ``embedding_model``."""
    if info.embedding_model != embedding_model:
        raise ModelMismatch(f"collection {info.name!r} holds {info.embedding_model} embeddings, "
                            f"not {embedding_model}", expected=info.embedding_model, got=embedding_model)


def collection_row(session: Session, name: str) -> Collection:
    """The collection's row in this session; ``NotFound`` when there is none of that name."""
    row = session.scalar(select(Collection).where(Collection.name == name))
    if row is None:
        raise NotFound(f"collection {name!r} does not exist", collection=name)
    return row


def _collection_info(row: Collection) -> CollectionInfo:
    return CollectionInfo(row.id, row.name, row.embedding_model, row.dimension, row.match_threshold,
                          row.keep_crops, row.created_at, row.match_policy, row.target_fpir, row.calibration)


def _identity_info(row: Identity) -> IdentityInfo:
    return IdentityInfo(row.id, row.collection_id, row.external_id, row.name, dict(row.attributes),
                        row.created_at, row.updated_at)


def _face_info(row: Face) -> FaceInfo:
    return FaceInfo(row.id, row.identity_id, row.image_sha256, list(row.box), row.detection_score,
                    dict(row.quality), row.crop is not None, row.created_at)


class GalleryStore:
    """Collections, identities and faces; all methods are one transaction each."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self._changes = db.polled(_CHANGES)
        self._face_range = db.polled(_FACE_RANGE)

    # --- collections ------------------------------------------------------------------------



    def create_collection(self, name: str, embedding_model: str, dimension: int, match_threshold: float,
                          keep_crops: bool = True, target_fpir: float | None = None) -> CollectionInfo:
        """A new collection deciding at ``match_threshold``, or at the one derived for ``target_fpir``."""
        if not name or dimension <= 0 or not -1.0 <= match_threshold <= 1.0:
            raise ValueError("a collection needs a name, a positive dimension and a threshold in [-1, 1]")
        if target_fpir is not None and not 0.0 < target_fpir <= 0.5:
            raise ValueError("a target false-positive identification rate is in (0, 0.5]")
        try:
            with self.db.write() as session:
                row = Collection(name=name, embedding_model=embedding_model, dimension=dimension,
                                 match_threshold=match_threshold, keep_crops=keep_crops,
                                 match_policy="fixed" if target_fpir is None else "fpir",
                                 target_fpir=target_fpir)
                session.add(row)
                session.flush()
                return _collection_info(row)
        except IntegrityError as exc:
            raise Conflict(f"collection {name!r} already exists", collection=name) from exc

    def get_collection(self, name: str) -> CollectionInfo:
        with self.db.read() as session:
            return _collection_info(collection_row(session, name))

    def list_collections(self) -> list[CollectionInfo]:
        with self.db.read() as session:
            return [_collection_info(r) for r in session.scalars(select(Collection).order_by(Collection.id))]

    def delete_collection(self, name: str) -> int:
        """Delete a collection with everything in it; returns the number of faces removed."""
        with self.db.write() as session:
            collection = collection_row(session, name)
            count = session.scalar(select(func.count()).where(Face.collection_id == collection.id)) or 0
            self._log(session, collection.id, [(0, 0)], ChangeOp.DROP)
            session.execute(delete(Face).where(Face.collection_id == collection.id))
            session.execute(delete(Identity).where(Identity.collection_id == collection.id))
            session.delete(collection)
            return int(count)

    # --- identities -------------------------------------------------------------------------

    def _identity(self, session: Session, collection_id: int, external_id: str) -> Identity:
        row = session.scalar(select(Identity).where(Identity.collection_id == collection_id,
                                                    Identity.external_id == external_id))
        if row is None:
            raise NotFound(f"identity {external_id!r} does not exist", external_id=external_id)
        return row

    def create_identity(self, collection: str, external_id: str, name: str = "",
                        metadata: dict[str, Any] | None = None) -> IdentityInfo:
        if not external_id:
            raise ValueError("external_id must not be empty")
        try:
            with self.db.write() as session:
                owner = collection_row(session, collection)
                row = Identity(collection_id=owner.id, external_id=external_id, name=name,
                               attributes=dict(metadata or {}))
                session.add(row)
                session.flush()
                return _identity_info(row)
        except IntegrityError as exc:
            raise Conflict(f"identity {external_id!r} already exists in {collection!r}",
                           external_id=external_id) from exc

    def get_identity(self, collection: str, external_id: str) -> IdentityInfo:
        with self.db.read() as session:
            owner = collection_row(session, collection)
            return _identity_info(self._identity(session, owner.id, external_id))

    def list_identities(self, collection: str, offset: int = 0, limit: int = 50,
                        name_contains: str | None = None) -> tuple[list[IdentityInfo], int]:
        with self.db.read() as session:
            query = select(Identity).where(Identity.collection_id == collection_row(session, collection).id)
            if name_contains:
                query = query.where(
                    func.lower(Identity.name).contains(name_contains.lower(), autoescape=True))
            total = session.scalar(select(func.count()).select_from(query.subquery())) or 0
            rows = session.scalars(query.order_by(Identity.id).offset(offset).limit(limit))
            return [_identity_info(r) for r in rows], int(total)

    def external_ids(self, collection: str) -> list[str]:
        """Every identity's external id, in creation order, in one query (not pages: OFFSET costs squared)."""
        with self.db.read() as session:
            owner = collection_row(session, collection).id
            query = select(Identity.external_id).where(Identity.collection_id == owner).order_by(Identity.id)
            return list(session.scalars(query))

    def update_identity(self, collection: str, external_id: str, name: str | None = None,
                        metadata: dict[str, Any] | None = None) -> IdentityInfo:
        with self.db.write() as session:
            row = self._identity(session, collection_row(session, collection).id, external_id)
            if name is not None and name != row.name:
                row.name = name
                self._log(session, row.collection_id, [(0, row.id)], ChangeOp.RELABEL)
            if metadata is not None:
                row.attributes = dict(metadata)
            session.flush()
            return _identity_info(row)

    def delete_identity(self, collection: str, external_id: str) -> list[int]:
        """Erase an identity: its faces (vectors, crops) and its row. Returns the removed face ids."""
        with self.db.write() as session:
            owner = collection_row(session, collection)
            row = self._identity(session, owner.id, external_id)
            face_ids = list(session.scalars(select(Face.id).where(Face.identity_id == row.id)))
            self._log(session, owner.id, [(f, row.id) for f in face_ids], ChangeOp.REMOVE)
            session.execute(delete(Face).where(Face.identity_id == row.id))
            session.delete(row)
            return face_ids

    # --- faces ------------------------------------------------------------------------------

    def add_faces(self, collection: str, external_id: str, faces: Sequence[NewFace], embedding_model: str,
                  create: tuple[str, dict[str, Any]] | None = None) -> tuple[IdentityInfo, list[FaceInfo]]:
        """Enroll faces to an identity, all or none; with ``create`` = (name, metadata) it is made first."""
        with self.db.write() as session:
            owner = collection_row(session, collection)
            check_model(_collection_info(owner), embedding_model)  # in the transaction: a re-embed may race
            vectors = validate_embeddings([f.embedding for f in faces], owner.dimension)
            identity = session.scalar(select(Identity).where(Identity.collection_id == owner.id,
                                                             Identity.external_id == external_id))
            if identity is None and create is None:
                raise NotFound(f"identity {external_id!r} does not exist", external_id=external_id)
            if identity is None and create is not None:
                identity = Identity(collection_id=owner.id, external_id=external_id, name=create[0],
                                    attributes=dict(create[1]))
                session.add(identity)
                session.flush()
            assert identity is not None  # narrowed above; not input validation
            rows = [
                Face(identity_id=identity.id, collection_id=owner.id, embedding=encode_vector(vector),
                     embedding_model=embedding_model, image_sha256=face.image_sha256,
                     box=[float(v) for v in face.box], detection_score=float(face.detection_score),
                     quality=dict(face.quality), crop=face.crop if owner.keep_crops else None)
                for face, vector in zip(faces, vectors, strict=True)
            ]
            session.add_all(rows)
            session.flush()
            self._log(session, owner.id, [(r.id, identity.id) for r in rows], ChangeOp.ADD)
            return _identity_info(identity), [_face_info(r) for r in rows]

    def list_faces(self, collection: str, external_id: str) -> list[FaceInfo]:
        with self.db.read() as session:
            identity = self._identity(session, collection_row(session, collection).id, external_id)
            return [_face_info(r) for r in session.scalars(
                select(Face).where(Face.identity_id == identity.id).order_by(Face.id))]

    def delete_face(self, collection: str, face_id: int) -> None:
        with self.db.write() as session:
            owner = collection_row(session, collection)
            row = session.scalar(select(Face).where(Face.id == face_id, Face.collection_id == owner.id))
            if row is None:
                raise NotFound(f"face {face_id} does not exist in {collection!r}", face_id=face_id)
            self._log(session, owner.id, [(row.id, row.identity_id)], ChangeOp.REMOVE)
            session.delete(row)

    def known_hashes(self, collection: str) -> set[str]:
        """sha256 of every image already enrolled in the collection (import resumability)."""
        with self.db.read() as session:
            owner = collection_row(session, collection)
            return set(session.scalars(select(Face.image_sha256).where(Face.collection_id == owner.id)))

    # --- re-embedding --------------------------------------------------------------------------

    def stored_crops(self, collection: str) -> tuple[list[int], list[bytes]]:
        """Face ids and PNG crops of a whole collection; ``CropsMissing`` when any face has none."""
        with self.db.read() as session:
            owner = collection_row(session, collection)
            missing = session.scalar(select(func.count()).where(Face.collection_id == owner.id,
                                                                Face.crop.is_(None))) or 0
            if missing:
                raise CropsMissing(f"{missing} face(s) of {collection!r} have no stored crop: re-embedding "
                                   "needs the aligned crops (collections created with keep_crops=false "
                                   "cannot be re-embedded; re-import the images instead)",
                                   faces_without_crop=int(missing))
            rows = session.execute(select(Face.id, Face.crop).where(Face.collection_id == owner.id)
                                   .order_by(Face.id)).all()
        return [r[0] for r in rows], [r[1] for r in rows if r[1] is not None]  # none is NULL (checked)

    def replace_embeddings(self, collection: str, face_ids: Sequence[int], vectors: NDArray[np.float32],
                           embedding_model: str, dimension: int, match_threshold: float) -> None:
        """Give every face of the collection its new vector and the collection its new model, in one
        transaction, with a DROP in the change log so every index replica rebuilds it. ``Conflict`` when
        the collection's faces are not exactly ``face_ids`` any more."""
        matrix = validate_embeddings(vectors, dimension) if len(face_ids) else vectors
        with self.db.write() as session:
            owner = session.scalar(select(Collection).where(Collection.name == collection))
            current = (set(session.scalars(select(Face.id).where(Face.collection_id == owner.id)))
                       if owner else set())
            if owner is None or current != set(face_ids):
                raise Conflict(f"collection {collection!r} changed during re-embedding; run it again")
            if face_ids:
                session.execute(update(Face), [{"id": face_id, "embedding": encode_vector(vector),
                                                "embedding_model": embedding_model}
                                               for face_id, vector in zip(face_ids, matrix, strict=True)])
            owner.embedding_model, owner.dimension, owner.match_threshold = (embedding_model, dimension,
                                                                             match_threshold)
            owner.calibration = None  # measured on the old model's scores
            self._log(session, owner.id, [(0, 0)], ChangeOp.DROP)

    # --- change log and bulk reads for the index ---------------------------------------------

    @staticmethod
    def _log(session: Session, collection_id: int, faces: Iterable[tuple[int, int]], op: ChangeOp) -> None:
        session.add_all(FaceChange(collection_id=collection_id, face_id=f, identity_id=i, op=op.value)
                        for f, i in faces)

    def changes_since(self, seq: int, limit: int = 10_000) -> list[Change]:
        """Log rows after ``seq``, in order (every replica asks this every follower interval)."""
        rows = self._changes.rows({"seq": seq, "limit": limit})
        return [Change(s, c, f, i, _OPS[op]) for s, c, f, i, op in rows]

    def last_seq(self) -> int:
        return int(self.db.fetch(_LAST_SEQ)[0][0] or 0)

    def vectors(self, face_ids: Sequence[int], dimension: int) -> dict[int, NDArray[np.float32]]:
        """Embeddings of the faces that still exist, by id. A follower applies thousands of consecutive ids
        after an import: they are read 5,000 at a time by their range (spread ids by the ids themselves) on a
        pooled DB-API connection (``Polled``), the bytes converted at once: the interpreter's lock, which
        searches wait for, is held far less than through the ORM with a vector decoded per row."""
        wanted = np.unique(np.asarray(face_ids, np.int64))
        found: dict[int, NDArray[np.float32]] = {}
        for start in range(0, len(wanted), 5000):
            group = wanted[start : start + 5000]
            low, high = int(group[0]), int(group[-1])
            if high - low < 2 * len(group):
                rows = self._face_range.rows({"lo": low, "hi": high})
            else:
                rows = self.db.fetch(_FACES_BY_ID, {"ids": group.tolist()})
            ids, matrix = _decoded(rows, group, dimension)
            found.update(zip(ids.tolist(), matrix, strict=True))
        return found

    def collection_vectors(self, collection_id: int, dimension: int
                           ) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.float32]]:
        """Face ids, identity ids and embeddings [N, D] of a whole collection, read in pages of
        ``VECTOR_PAGE`` rows into arrays sized by a count first: the peak is the result and one page, not
        the three times the result of every row's bytes joined, then converted."""
        where = Face.collection_id == collection_id
        statement = select(Face.id, Face.identity_id, Face.embedding).where(where).order_by(Face.id)
        with self.db.read() as session:
            capacity = _face_count(session, collection_id)
            ids, identities = np.empty(capacity, np.int64), np.empty(capacity, np.int64)
            matrix = np.empty((capacity, dimension), np.float32)
            filled = 0
            for page in session.execute(statement.execution_options(yield_per=VECTOR_PAGE)).partitions():
                stop = filled + len(page)
                if stop > capacity:  # faces added since the count (a read-committed database)
                    capacity = max(stop, capacity + capacity // 4 + VECTOR_PAGE)
                    ids, identities = np.resize(ids, capacity), np.resize(identities, capacity)
                    grown = np.empty((capacity, dimension), np.float32)
                    grown[:filled] = matrix[:filled]
                    matrix = grown
                ids[filled:stop] = [r[0] for r in page]
                identities[filled:stop] = [r[1] for r in page]
                blobs = b"".join(r[2] for r in page)
                matrix[filled:stop] = np.frombuffer(blobs, "<f4").reshape(-1, dimension)
                filled = stop
        return ids[:filled], identities[:filled], matrix[:filled]

    def collection_identities(self, collection_id: int) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """Face ids and identity ids of a whole collection (no vectors)."""
        with self.db.read() as session:
            rows = session.execute(select(Face.id, Face.identity_id)
                                   .where(Face.collection_id == collection_id).order_by(Face.id)).all()
        return np.array([r[0] for r in rows], np.int64), np.array([r[1] for r in rows], np.int64)

    def identity_labels(self, identity_ids: Iterable[int]) -> dict[int, tuple[str, str]]:
        """(external_id, name) by identity id."""
        wanted = sorted(set(identity_ids))
        if not wanted:
            return {}
        return {r[0]: (r[1], r[2]) for r in self.db.fetch(_LABELS, {"ids": wanted})}

    def first_identity_labels(self, limit: int) -> dict[int, tuple[str, str]]:
        """(external_id, name) by identity id of the first ``limit`` identities (by id), of any collection."""
        return {r[0]: (r[1], r[2]) for r in self.db.fetch(_FIRST_LABELS, {"limit": limit})}

    def identity_vectors(self, collection: str, external_id: str) -> NDArray[np.float32]:
        """Embeddings [N, D] of one identity's faces (for 1:1 verification)."""
        with self.db.read() as session:
            owner = collection_row(session, collection)
            identity = self._identity(session, owner.id, external_id)
            blobs = list(session.scalars(select(Face.embedding).where(Face.identity_id == identity.id)))
        return np.array([decode_vector(b, owner.dimension) for b in blobs], dtype=np.float32).reshape(
            -1, owner.dimension)
