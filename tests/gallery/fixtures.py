"""Fixtures and helpers for the gallery tests: every database test runs on SQLite and on PostgreSQL.

Test modules load this file with ``pytest_plugins = ["tests.gallery.fixtures"]`` (never import it:
pytest must import it itself to rewrite its asserts); helpers are in ``tests/gallery/helpers.py``.

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

from gallery.engines.index import IndexConfig
from gallery.engines.milvus import MilvusEngine
from gallery.engines.milvus_lite import MilvusLite
from gallery.gallery import Gallery
from gallery.store.db import Database, create_db_engine, migrate
from gallery.store.store import GalleryStore
from tests.gallery.helpers import GalleryFactory

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


# --- engines: every gallery test runs on FAISS and on Milvus ---------------------------------------


@pytest.fixture(scope="session")
def milvus_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Milvus (milvus-lite 2.4, the Milvus server packaged as a wheel) on a free local port, for
    this test session; other processes (crash workers, replicas) reach it by URI."""
    server = MilvusLite(tmp_path_factory.mktemp("milvus") / "milvus.db")
    with server:
        yield server.uri


@pytest.fixture(params=["faiss", "milvus"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_gallery(backend: str, request: pytest.FixtureRequest) -> Iterator[GalleryFactory]:
    """``make_gallery(store, snapshot_dir=None, config=None)``: a Gallery on this test's engine. Milvus
    galleries of one test share a collection-name prefix unique to the test (isolation on one server)."""
    prefix = f"t{secrets.token_hex(4)}"
    uri = request.getfixturevalue("milvus_uri") if backend == "milvus" else ""
    engines: list[MilvusEngine] = []

    def make(store: GalleryStore, snapshot_dir: Path | None = None, config: IndexConfig | None = None
             ) -> Gallery:
        if backend == "faiss":
            return Gallery(store, snapshot_dir, config)
        engine = MilvusEngine(uri, prefix=prefix)
        engines.append(engine)
        return Gallery(store, snapshot_dir, config, engine=engine)

    make.backend = backend  # type: ignore[attr-defined]
    make.milvus = (uri, prefix)  # type: ignore[attr-defined]
    yield make
    if engines:  # leave the shared server as empty as this test found it
        engines[0].prune(set())
        engines[0].client.drop_collection(engines[0].state_name)
