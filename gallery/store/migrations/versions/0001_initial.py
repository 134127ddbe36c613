"""Initial schema: collections, identities, faces, face_changes.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "collections",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(128), nullable=False, unique=True),
        sa.Column("embedding_model", sa.String(128), nullable=False),
        sa.Column("dimension", sa.Integer(), nullable=False),
        sa.Column("match_threshold", sa.Float(), nullable=False),
        sa.Column("keep_crops", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sqlite_autoincrement=True,
    )
    op.create_table(
        "identities",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column(
            "collection_id", BigId, sa.ForeignKey("collections.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("external_id", sa.String(256), nullable=False),
        sa.Column("name", sa.String(256), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("collection_id", "external_id", name="uq_identity_external_id"),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_identities_collection_id", "identities", ["collection_id"])
    op.create_table(
        "faces",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("identity_id", BigId, sa.ForeignKey("identities.id", ondelete="CASCADE"), nullable=False),
        sa.Column(
            "collection_id", BigId, sa.ForeignKey("collections.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("embedding", sa.LargeBinary(), nullable=False),
        sa.Column("embedding_model", sa.String(128), nullable=False),
        sa.Column("image_sha256", sa.String(64), nullable=False),
        sa.Column("box", sa.JSON(), nullable=False),
        sa.Column("detection_score", sa.Float(), nullable=False),
        sa.Column("quality", sa.JSON(), nullable=False),
        sa.Column("crop", sa.LargeBinary(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_faces_identity_id", "faces", ["identity_id"])
    op.create_index("ix_faces_collection_id", "faces", ["collection_id"])
    op.create_index("ix_faces_collection_sha256", "faces", ["collection_id", "image_sha256"])
    op.create_table(
        "face_changes",
        sa.Column("seq", BigId, primary_key=True, autoincrement=True),
        sa.Column("collection_id", sa.BigInteger(), nullable=False),
        sa.Column("face_id", sa.BigInteger(), nullable=False),
        sa.Column("identity_id", sa.BigInteger(), nullable=False),
        sa.Column("op", sa.String(8), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_face_changes_collection_id", "face_changes", ["collection_id"])


def downgrade() -> None:
    op.drop_table("face_changes")
    op.drop_table("faces")
    op.drop_table("identities")
    op.drop_table("collections")
