"""Database schema (SQLAlchemy 2.0, typed). The database is the source of truth; FAISS is a cache.

Every change to a collection's faces (and to an identity's label: name, external id) appends a row to
``face_changes``: index replicas replay that log in ``seq`` order to stay equal to the database.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    UniqueConstraint,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

# SQLite only auto-increments INTEGER PRIMARY KEY; PostgreSQL gets BIGINT identities.
BigId = BigInteger().with_variant(Integer(), "sqlite")


def utcnow() -> datetime:
    return datetime.now(UTC)


class UtcDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC timestamps on every engine (SQLite stores them without an offset)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("timestamps must be timezone-aware")
        return None if value is None else value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    type_annotation_map: ClassVar[dict[Any, Any]] = {dict[str, Any]: JSON}


class ChangeOp(StrEnum):
    ADD = "add"
    REMOVE = "remove"
    DROP = "drop"  # the whole collection was deleted
    RELABEL = "relabel"  # an identity's name or external id changed (face_id 0): its label is read again
    POLICY = "policy"  # the collection's match policy or its calibration changed: it is read again


class Collection(Base):
    """One tenant's gallery: every face in it comes from one embedding model."""

    __tablename__ = "collections"
    __table_args__ = ({"sqlite_autoincrement": True},)  # ids are never reused (replicas may lag)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    embedding_model: Mapped[str] = mapped_column(String(128))
    dimension: Mapped[int] = mapped_column(Integer)
    match_threshold: Mapped[float] = mapped_column(Float)
    keep_crops: Mapped[bool] = mapped_column(default=True)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)
    #: "fixed" (decide at ``match_threshold``) or "fpir" (a threshold derived for ``target_fpir`` at the
    #: collection's size: ``gallery.calibration``)
    match_policy: Mapped[str] = mapped_column(String(8), default="fixed", server_default="fixed")
    target_fpir: Mapped[float | None] = mapped_column(Float, nullable=True)
    #: the impostor score tail measured on the collection's own faces (``gallery.calibration``)
    calibration: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)

    identities: Mapped[list[Identity]] = relationship(
        back_populates="collection", cascade="all, delete-orphan", passive_deletes=True
    )


class Identity(Base):
    """A person, known to the caller by ``external_id`` (unique within the collection)."""

    __tablename__ = "identities"
    __table_args__ = (UniqueConstraint("collection_id", "external_id", name="uq_identity_external_id"),
                      {"sqlite_autoincrement": True})

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    collection_id: Mapped[int] = mapped_column(ForeignKey("collections.id", ondelete="CASCADE"), index=True)
    external_id: Mapped[str] = mapped_column(String(256))
    name: Mapped[str] = mapped_column(String(256), default="")
    attributes: Mapped[dict[str, Any]] = mapped_column("metadata", JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow, onupdate=utcnow)

    collection: Mapped[Collection] = relationship(back_populates="identities")
    faces: Mapped[list[Face]] = relationship(
        back_populates="identity", cascade="all, delete-orphan", passive_deletes=True
    )


class Face(Base):
    """One enrolled face. Its primary key is its FAISS id."""

    __tablename__ = "faces"
    # AUTOINCREMENT: SQLite must never reuse the id of a deleted face (ids are FAISS ids).
    __table_args__ = (Index("ix_faces_collection_sha256", "collection_id", "image_sha256"),
                      {"sqlite_autoincrement": True})

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    identity_id: Mapped[int] = mapped_column(ForeignKey("identities.id", ondelete="CASCADE"), index=True)
    collection_id: Mapped[int] = mapped_column(ForeignKey("collections.id", ondelete="CASCADE"), index=True)
    embedding: Mapped[bytes] = mapped_column(LargeBinary)  # float32, L2-normalized, little-endian
    embedding_model: Mapped[str] = mapped_column(String(128))
    image_sha256: Mapped[str] = mapped_column(String(64))
    box: Mapped[list[float]] = mapped_column(JSON)
    detection_score: Mapped[float] = mapped_column(Float)
    quality: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    crop: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)  # PNG of the aligned 112x112 face
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)

    identity: Mapped[Identity] = relationship(back_populates="faces")


class FaceChange(Base):
    """Append-only log of index changes, in commit order (``seq``)."""

    __tablename__ = "face_changes"
    __table_args__ = ({"sqlite_autoincrement": True},)

    seq: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    collection_id: Mapped[int] = mapped_column(BigInteger, index=True)  # no FK: outlives the collection
    face_id: Mapped[int] = mapped_column(BigInteger)
    identity_id: Mapped[int] = mapped_column(BigInteger)
    op: Mapped[str] = mapped_column(String(8))
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)


class ApiKey(Base):
    """A per-collection API key. Only a SHA-256 of the secret is stored; revoked keys stay for audit."""

    __tablename__ = "api_keys"
    __table_args__ = ({"sqlite_autoincrement": True},)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    collection_id: Mapped[int] = mapped_column(ForeignKey("collections.id", ondelete="CASCADE"), index=True)
    prefix: Mapped[str] = mapped_column(String(16))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    label: Mapped[str] = mapped_column(String(128), default="")
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)
