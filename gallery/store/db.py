"""Engines, migrations and transactions for SQLite (embedded default) and PostgreSQL.

Writes that append to the change log are serialized (SQLite: ``BEGIN IMMEDIATE``; PostgreSQL: a
transaction-scoped advisory lock), so ``face_changes.seq`` order is commit order and a replica that
reads ``seq > last_seen`` never skips a change that commits late.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, Executable, create_engine, event, exc, make_url, text
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.compiler import SQLCompiler

log = logging.getLogger(__name__)

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
#: Arbitrary constant naming the advisory lock that serializes change-log writers on PostgreSQL.
CHANGE_LOG_LOCK = 0x6661636572
#: Another one serializing migrations.
MIGRATION_LOCK = 0x6661636573


#: How long a connection waits for other connections' locks (SQLite's busy timeout, and the WAL switch).
SQLITE_BUSY_S = 30.0


def _switch_to_wal(cursor: sqlite3.Cursor) -> None:
    """``journal_mode=WAL``, waiting for other connections. On a fresh (rollback-journal) database the
    switch fails at once with "database is locked" while another connection holds a write lock:
    SQLite does not call the busy handler there, as waiting could deadlock. Processes starting together
    on a new file (replicas migrating it) meet exactly that, so the switch is retried until the busy
    timeout; once the file is in WAL mode (persistent) the pragma takes no lock."""
    deadline = time.monotonic() + SQLITE_BUSY_S
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    dbapi_connection.isolation_level = None  # let SQLAlchemy's "begin" event emit BEGIN itself
    cursor = dbapi_connection.cursor()
    cursor.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_S * 1000)}")
    cursor.execute("PRAGMA foreign_keys=ON")
    _switch_to_wal(cursor)
    cursor.execute("PRAGMA synchronous=NORMAL")  # durable against process crashes in WAL mode
    cursor.close()


def _sqlite_begin(connection: Any) -> None:
    immediate = connection.get_execution_options().get("write", False)
    connection.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


#: PostgreSQL: seconds a new connection may take (libpq's connect_timeout).
CONNECT_TIMEOUT_S = 10


def create_db_engine(url: str, **kwargs: Any) -> Engine:
    """An engine with the pragmas/pooling this project relies on."""
    if url.startswith("sqlite"):
        arguments = {"check_same_thread": False, "timeout": SQLITE_BUSY_S}
        engine = create_engine(url, connect_args=arguments, **kwargs)
        event.listen(engine, "connect", _sqlite_pragmas)
        event.listen(engine, "begin", _sqlite_begin)
        return engine
    # a server that drops packets fails a connection in seconds, not at the kernel's TCP timeout (minutes),
    # unless the URL says otherwise
    arguments = {} if "connect_timeout" in make_url(url).query else {"connect_timeout": CONNECT_TIMEOUT_S}
    arguments.update(kwargs.pop("connect_args", {}))
    return create_engine(url, pool_pre_ping=True, connect_args=arguments, **kwargs)


def migrate(engine: Engine, revision: str = "head") -> None:
    """Apply Alembic migrations up to ``revision`` (idempotent). Processes starting together (service
    replicas) take turns: SQLite ``BEGIN IMMEDIATE``, PostgreSQL an advisory lock; the later ones find
    the schema current."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with engine.execution_options(write=True).begin() as connection:
        if connection.dialect.name == "postgresql":
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK})
        config.attributes["connection"] = connection
        command.upgrade(config, revision)


def storage_full(error: BaseException | None) -> bool:
    """Whether a driver's error says the database's disk is full (SQLite's SQLITE_FULL, PostgreSQL's
    disk_full): the write was rolled back, and writes fail until space is freed, while reads go on."""
    return (getattr(error, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL
            or getattr(error, "sqlstate", None) == "53100")


class Database:
    """Session factories: ``read()`` for queries, ``write()`` for serialized change-log writers."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._read = sessionmaker(engine, expire_on_commit=False)
        self._write = sessionmaker(engine.execution_options(write=True), expire_on_commit=False)
        self._local_lock = threading.RLock()  # threads of this process; flock does not exclude them
        self._holding: dict[int, int] = {}  # exclusive() depth per key (only the holding thread is inside)

    @property
    def is_postgres(self) -> bool:
        return self.engine.dialect.name == "postgresql"

    @contextmanager
    def read(self) -> Iterator[Session]:
        with self._read() as session, session.begin():
            yield session

    def fetch(self, statement: Executable, parameters: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
        """The rows of one read-only statement, on a pooled connection without an ORM session: the
        per-request reads (key lookup, candidate labels; statements built once, with bound parameters)
        cost a fraction of ``read()`` this way."""
        with self.engine.connect() as connection:
            return [tuple(row) for row in connection.execute(statement, parameters or {})]

    def polled(self, statement: ClauseElement) -> Polled:
        """``statement`` made ready to be run many times a second (see ``Polled``)."""
        return Polled(self.engine, statement)

    @contextmanager
    def write(self) -> Iterator[Session]:
        with self._write() as session, session.begin():
            if self.is_postgres:
                session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": CHANGE_LOG_LOCK})
            yield session

    @contextmanager
    def exclusive(self, key: int) -> Iterator[None]:
        """One holder at a time across processes and threads: a transaction-scoped advisory lock on
        PostgreSQL, an flock on ``<database file>.<key>.lock`` beside a SQLite file (in-memory SQLite:
        this process only). Re-entrant: a thread that holds it passes through."""
        with self._local_lock:
            held = self._holding.get(key, 0)
            self._holding[key] = held + 1
            try:
                if held:
                    yield
                else:
                    with self._cross_process(key):
                        yield
            finally:
                self._holding[key] -= 1

    @contextmanager
    def _cross_process(self, key: int) -> Iterator[None]:
        if self.is_postgres:
            with self._read() as session, session.begin():
                session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": key})
                yield
            return
        database = self.engine.url.database
        if not database or database == ":memory:":
            yield
            return
        fd = os.open(f"{database}.{key:x}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def ping(self) -> bool:
        try:
            with self.engine.connect() as connection:
                connection.execute(text("SELECT 1"))
            return True
        except Exception:  # any driver error means "not reachable" to a health check
            return False


class Polled:
    """One read-only statement that a process runs several times a second: the change log every gateway
    and importer follows, the key table every gateway watches (``follow_interval_s``, 0.2 s). Its SQL is
    compiled once for the engine's dialect and run on a pooled DB-API connection, below SQLAlchemy's
    execution layer (its events, the BEGIN and ROLLBACK it issues on SQLite, result processing), which
    more than doubled an idle gateway's CPU for these reads. Rows come as the driver returns them, so the
    statement's columns and parameters must be plain (integers, strings, counts: no type with a result or
    bind processor; a binary column comes as
    the driver's bytes-like value, which its reader takes as is, as ``GalleryStore.vectors`` does); a driver
    error is raised as SQLAlchemy's (``OperationalError`` for a database that went away) and its connection
    discarded."""

    def __init__(self, engine: Engine, statement: ClauseElement) -> None:
        self._engine = engine
        compiled = statement.compile(dialect=engine.dialect)
        if not isinstance(compiled, SQLCompiler):
            raise TypeError(f"not a SQL statement: {statement!r}")
        self._compiled, self._sql = compiled, compiled.string
        self._positions = list(compiled.positiontup or []) if engine.dialect.positional else None

    def rows(self, parameters: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
        values = self._compiled.construct_params(parameters or {}) or {}
        arguments: Any = values if self._positions is None else [values[name] for name in self._positions]
        driver_error = self._engine.dialect.loaded_dbapi.Error
        connection = self._engine.raw_connection()
        try:
            cursor = connection.cursor()
            try:
                cursor.execute(self._sql, arguments)
                return [tuple(row) for row in cursor.fetchall()]
            finally:
                cursor.close()
        except driver_error as error:
            connection.invalidate(error)
            raise exc.DBAPIError.instance(self._sql, arguments, error, driver_error,
                                          dialect=self._engine.dialect) from error
        finally:
            connection.close()
