"""A collection's match policy: a fixed threshold, or a target false-positive identification rate, and the
impostor score tail measured on its own faces.

Collections that exist keep their fixed threshold (``match_policy`` 'fixed'): their decisions do not change
with the upgrade. New ones get the gateway's default policy.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("collections", sa.Column("match_policy", sa.String(8), nullable=False,
                                           server_default="fixed"))
    op.add_column("collections", sa.Column("target_fpir", sa.Float(), nullable=True))
    op.add_column("collections", sa.Column("calibration", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("collections") as batch:
        batch.drop_column("calibration")
        batch.drop_column("target_fpir")
        batch.drop_column("match_policy")
