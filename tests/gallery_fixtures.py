"""Fixtures and helpers for the gallery tests: every database test runs on SQLite and on PostgreSQL.

Test modules load this file with ``pytest_plugins = ["tests.gallery_fixtures"]`` (never import it:
pytest must import it itself to rewrite its asserts); helpers are in ``tests/gallery_helpers.py``.

PostgreSQL: one scratch database ``facerec_test_<random>`` per test session (created through an
AUTOCOMMIT connection to the ``postgres`` database, dropped at the end), and a fresh ``public`` schema
per test. The server comes from ``FACEREC_TEST_PG_URL`` (default: the local trust-auth server). When it
is unreachable the PostgreSQL variants FAIL: CI guarantees a server.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url

from gallery.db import Database, create_db_engine, migrate
from gallery.store import GalleryStore

PG_ADMIN_URL = os.environ.get("FACEREC_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")


# --- databases ----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def pg_database() -> Iterator[str]:
    """URL of a scratch PostgreSQL database private to this test session."""
    name = f"facerec_test_{secrets.token_hex(4)}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:  # any driver error: the server is required, so this is a failure
        admin.dispose()
        pytest.fail(f"PostgreSQL at {make_url(PG_ADMIN_URL).render_as_string(hide_password=True)} "
                    f"is unreachable (the gallery tests need it): {exc}", pytrace=False)
    try:
        yield make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def _reset_pg_schema(url: str) -> None:
    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as connection:
            connection.execute(text("DROP SCHEMA IF EXISTS public CASCADE"))
            connection.execute(text("CREATE SCHEMA public"))
    finally:
        engine.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database (no tables): a temp SQLite file, or the session's PostgreSQL database with a
    fresh schema."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'gallery.db'}"
    url: str = request.getfixturevalue("pg_database")
    _reset_pg_schema(url)
    return url


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    """A migrated engine on ``db_url``."""
    engine = create_db_engine(db_url)
    migrate(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def store(engine: Engine) -> GalleryStore:
    return GalleryStore(Database(engine))
