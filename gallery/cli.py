"""What the command lines over the gallery share: the options every command takes, the database they open,
and one way to end (a user's mistake or an unreachable server is one logged line and exit status 2, not a
traceback). ``python -m gallery`` (the database and indexes) and ``python -m recognition`` (work through
the pipeline: the batch import) are built on it."""

from __future__ import annotations

import argparse
import csv
import logging
from collections.abc import Callable
from pathlib import Path

import httpx

from facecore.client import PipelineError
from facecore.settings import Settings, load_settings
from gallery.errors import GalleryError
from gallery.store.db import Database, create_db_engine, migrate
from gallery.store.store import GalleryStore

log = logging.getLogger("gallery")


def open_store(url: str) -> GalleryStore:
    """The gallery database at ``url``, migrated to the latest schema (a SQLite file's folder is made)."""
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    engine = create_db_engine(url)
    migrate(engine)
    return GalleryStore(Database(engine))


def root_parser(prog: str, description: str | None, settings: Settings | None = None
                ) -> tuple[argparse.ArgumentParser, argparse._SubParsersAction[argparse.ArgumentParser]]:
    """The command line's root (the database, the snapshots, -v) and its subcommands, with the settings
    (``facecore/settings.py``) as the defaults."""
    settings = settings or load_settings(Settings)
    root = argparse.ArgumentParser(prog=prog, description=description,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    root.set_defaults(settings=settings)
    root.add_argument("--database-url", default=settings.database.url,
                      help="SQLAlchemy URL (default: the settings' database, %(default)s)")
    root.add_argument("--snapshot-dir", type=Path, default=settings.gallery.snapshot_dir,
                      help="index snapshots (default: %(default)s)")
    root.add_argument("-v", "--verbose", action="store_true")
    return root, root.add_subparsers(dest="command", required=True)


def triton_argument(command: argparse.ArgumentParser, settings: Settings) -> None:
    command.add_argument("--url", default=settings.triton.url,
                         help="Triton gRPC address (default: FACEREC_TRITON__URL or %(default)s)")


def run(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    """Parse ``argv``, configure logging once and run the chosen command (its ``run`` default)."""
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("alembic", "faiss"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    command: Callable[[argparse.Namespace], int] = args.run
    try:
        return int(command(args))
    except GalleryError as exc:
        log.error("%s (%s)", exc.message, exc.code)
        return 2
    except (ValueError, OSError, csv.Error, PipelineError, httpx.HTTPError) as exc:
        log.error("%s", exc)
        return 2
