"""Alembic environment: migrations run on the connection handed over by ``gallery.store.db.migrate``."""

from __future__ import annotations

from alembic import context

from gallery.store.models import Base

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations through gallery.store.db.migrate(engine) "
                       "or `python -m gallery migrate`")
context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
