"""``python -m gallery``: migrate, create collections, import folders, rebuild/snapshot indexes, re-embed.

Defaults come from the settings every entry point reads (``facecore/settings.py``): the database URL
from FACEREC_DATABASE__URL or FACEREC_DB_* (else SQLite in data/), the snapshots from
FACEREC_GALLERY__SNAPSHOT_DIR, Triton from FACEREC_TRITON__URL, the quality gate from
FACEREC_QUALITY__*. This module is a command line (the top layer): the batch import itself is
``recognition.importer``.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import logging
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from facecore.client import AsyncPipelineClient, PipelineClient, PipelineError
from facecore.settings import Settings, load_settings
from gallery.db import Database, create_db_engine, migrate
from gallery.engines import IndexInfo
from gallery.errors import GalleryError
from gallery.store import GalleryStore

log = logging.getLogger("gallery")

#: ``import --concurrency``: more requests in flight than this only queue at Triton or the gateway.
MAX_CONCURRENCY = 64
#: The exit status of an import stopped with Ctrl-C (128 + SIGINT, as a shell reports it).
INTERRUPTED = 130


def open_store(url: str) -> GalleryStore:
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    engine = create_db_engine(url)
    migrate(engine)
    return GalleryStore(Database(engine))


def _migrate(args: argparse.Namespace) -> int:
    open_store(args.database_url)
    print("database is at the latest schema")
    return 0


def _create_collection(args: argparse.Namespace) -> int:
    store = open_store(args.database_url)
    if args.model is None:
        client = PipelineClient(args.url)
        spec = client.embedder()
        client.close()
        model, dimension, threshold = spec.name, spec.embedding_dim, spec.match_threshold
    elif args.threshold is None:
        raise ValueError("--model needs --threshold (the cosine similarity that counts as a match)")
    else:
        model, dimension, threshold = args.model, args.dimension, args.threshold
    if args.threshold is not None:
        threshold = args.threshold
    info = store.create_collection(args.name, model, dimension, threshold, not args.no_crops)
    print(f"collection {info.name}: {info.embedding_model}, {info.dimension}-d, "
          f"threshold {info.match_threshold}")
    return 0


def _import(args: argparse.Namespace) -> int:
    from recognition.importer import ItemResult, check_report_path, read_manifest, scan_folder, write_report

    if args.api and not args.key:
        raise ValueError("--api needs --key (a key of the collection, or the admin key)")
    if args.report:
        check_report_path(args.report)
    items = scan_folder(args.folder) if args.folder else read_manifest(args.manifest)
    quality = replace(args.settings.quality.thresholds(), min_face_size=args.min_face_size,
                      min_blur=args.min_blur)
    run = _import_rest if args.api else _import_local
    done: list[ItemResult] = []
    try:
        results: list[ItemResult] = asyncio.run(run(args, items, quality, done))
    except KeyboardInterrupt:
        if args.report:
            write_report(done, args.report)
        written = f"; the report of the {len(done)} files finished is in {args.report}" if args.report else ""
        log.error("interrupted after %d of %d files%s (run the import again to resume)", len(done),
                  len(items), written)
        return INTERRUPTED
    if args.report:
        write_report(results, args.report)
    counts = Counter(r.status.value for r in results)
    print(", ".join(f"{status}: {count}" for status, count in sorted(counts.items())) or "nothing to import")
    return 1 if counts.get("failed") else 0


async def _import_local(args: argparse.Namespace, items: list[Any], quality: Any,
                        done: list[Any]) -> list[Any]:
    """Straight to Triton (gRPC) and the database."""
    from recognition.importer import Importer, ImportOptions

    store = open_store(args.database_url)
    client = AsyncPipelineClient(args.url, args.settings.triton.timeout_s)
    try:
        try:
            spec = await client.embedder()
        except PipelineError as exc:
            raise ValueError(f"Triton at {args.url}: {exc}") from exc
        try:
            info = store.get_collection(args.collection)
        except GalleryError:
            if not args.create_collection:
                raise
            info = store.create_collection(args.collection, spec.name, spec.embedding_dim,
                                           spec.match_threshold)
        if (info.embedding_model, info.dimension) != (spec.name, spec.embedding_dim):
            raise ValueError(f"collection {info.name} holds {info.embedding_model} ({info.dimension}-d) "
                             f"embeddings but Triton serves {spec.name} ({spec.embedding_dim}-d): import "
                             f"into another collection, or `reembed` this one first")
        options = ImportOptions(args.collection, spec.name, args.concurrency, args.dry_run,
                                args.largest_face, quality, args.settings.limits.values())
        return await Importer(store, client, options).run(items, not args.quiet, done)
    finally:
        await client.close()


async def _import_rest(args: argparse.Namespace, items: list[Any], quality: Any,
                       done: list[Any]) -> list[Any]:
    """Through a deployed stack's REST API with a key (the server's quality gate applies)."""
    from recognition.importer import Importer, ImportOptions
    from recognition.rest_import import ApiFailure, RestBackend

    options = ImportOptions(args.collection, "", args.concurrency, args.dry_run, args.largest_face, quality,
                            args.settings.limits.values())
    backend = RestBackend(args.api, args.key, options, args.settings.limits.request_timeout_s * 2)
    try:
        info = await backend.ensure_collection(args.create_collection)
        options = replace(options, embedding_model=info["embedding_model"])
        return await Importer(None, None, options, backend).run(items, not args.quiet, done)
    except ApiFailure as exc:  # the key, the collection, the server: nothing to report per file
        raise ValueError(f"{args.api}: {exc}") from exc
    except httpx.HTTPError as exc:  # not reachable before the first file (later, files are reported)
        raise ValueError(f"{args.api}: cannot reach the API ({type(exc).__name__}: {exc})") from exc
    finally:
        await backend.close()


def _rebuild(args: argparse.Namespace) -> int:
    from gallery.gallery import open_gallery

    gallery = open_gallery(open_store(args.database_url), args.settings, args.snapshot_dir)
    gallery.rebuild(args.collection)
    for path in gallery.snapshot():
        print(path)
    return 0


def index_summary(info: IndexInfo) -> str:
    """One line on a collection's index for ``stats``: its kind and effort, and what its build measured."""
    if info.engine != "faiss":
        return f"{info.engine} {info.kind}"
    if info.kind == "flat":
        if info.chosen_at is None:
            return "flat (exact)"
        return f"flat (exact; candidates measured at {info.chosen_at} faces, none kept)"
    line = f"{info.kind} ({'nprobe' if info.kind == 'ivf' else 're-rank'} {info.effort})"
    m = info.measured
    if m is None:
        return line
    latency = "" if m.p99_ms is None else f", p99 {m.p99_ms:.2f} ms"
    return (f"{line}, chosen at {info.chosen_at} faces: recall@10 {m.recall:.4f} (lower bound "
            f"{m.recall_bound:.4f}), agreement {100 * m.genuine_agreement:.2f} % genuine / "
            f"{100 * m.impostor_agreement:.2f} % impostor{latency}")


def _stats(args: argparse.Namespace) -> int:
    from gallery.gallery import open_gallery

    gallery = open_gallery(open_store(args.database_url), args.settings, args.snapshot_dir)
    gallery.load()
    for info in gallery.store.list_collections():
        index, _ = gallery.describe(info.name)
        print(f"{info.name}\t{info.embedding_model}\t{info.dimension}-d\t{index.faces} faces\t"
              f"{index_summary(index)}")
    return 0


def _reembed(args: argparse.Namespace) -> int:
    from gallery.reembed import reembed_collection

    store = open_store(args.database_url)
    pipeline = PipelineClient(args.url, args.settings.triton.timeout_s)
    try:
        count = reembed_collection(store, args.collection, pipeline, spec := pipeline.embedder())
    finally:
        pipeline.close()
    print(f"re-embedded {count} faces of {args.collection} with {spec.name}")
    return 0


def _concurrency(value: str) -> int:
    """``--concurrency``: a whole number from 1 to ``MAX_CONCURRENCY``."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {value!r}") from None
    if not 1 <= number <= MAX_CONCURRENCY:
        raise argparse.ArgumentTypeError(f"must be from 1 to {MAX_CONCURRENCY}, not {number}")
    return number


def _triton_argument(command: argparse.ArgumentParser, settings: Settings) -> None:
    command.add_argument("--url", default=settings.triton.url,
                         help="Triton gRPC address (default: FACEREC_TRITON__URL or %(default)s)")


def parser(settings: Settings | None = None) -> argparse.ArgumentParser:
    settings = settings or load_settings(Settings)
    root = argparse.ArgumentParser(prog="python -m gallery", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    root.set_defaults(settings=settings)
    root.add_argument("--database-url", default=settings.database.url,
                      help="SQLAlchemy URL (default: the settings' database, %(default)s)")
    root.add_argument("--snapshot-dir", type=Path, default=settings.gallery.snapshot_dir,
                      help="index snapshots (default: %(default)s)")
    root.add_argument("-v", "--verbose", action="store_true")
    sub = root.add_subparsers(dest="command", required=True)

    sub.add_parser("migrate", help="create or upgrade the database schema").set_defaults(run=_migrate)

    p = sub.add_parser("create-collection", help="create a collection for the served model (or --model ...)")
    p.add_argument("name")
    _triton_argument(p, settings)
    p.add_argument("--model", help="embedding model id (default: ask Triton which model it serves)")
    p.add_argument("--dimension", type=int, default=128)
    p.add_argument("--threshold", type=float, help="match threshold (default: the model's)")
    p.add_argument("--no-crops", action="store_true",
                   help="do not keep aligned crops (no re-embedding later)")
    p.set_defaults(run=_create_collection)

    p = sub.add_parser("import", help="import a folder tree (one subfolder per identity) or a CSV manifest")
    p.add_argument("--collection", required=True)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--folder", type=Path)
    source.add_argument("--manifest", type=Path, help="UTF-8 CSV with columns path,external_id,name "
                        "(an invalid row refuses the whole manifest)")
    _triton_argument(p, settings)
    p.add_argument("--api", metavar="URL", help="import through a deployed stack's REST API (e.g. "
                   "http://host:8080) instead of Triton and the database; enroll calls are sized by the "
                   "settings' limits (FACEREC_LIMITS__MAX_BATCH_IMAGES, FACEREC_LIMITS__MAX_UPLOAD_BYTES: "
                   "the gateway's defaults unless set), as the API does not publish its own")
    p.add_argument("--key", help="with --api: a key of the collection (the admin key to --create-collection)")
    p.add_argument("--concurrency", type=_concurrency, default=8,
                   help=f"requests in flight to Triton or the API, 1 to {MAX_CONCURRENCY} (default: 8)")
    p.add_argument("--dry-run", action="store_true", help="detect and check every image, write nothing")
    p.add_argument("--report", type=Path, help="per-file report (.csv or .json; its folder must exist). "
                   f"Ctrl-C writes the files finished so far and exits {INTERRUPTED}")
    p.add_argument("--largest-face", action="store_true", help="enroll the largest face of group photos")
    p.add_argument("--create-collection", action="store_true", help="create the collection when missing")
    p.add_argument("--min-face-size", type=float, default=settings.quality.min_face_size,
                   help="quality gate: shorter box side in pixels (default: %(default)s)")
    p.add_argument("--min-blur", type=float, default=settings.quality.min_blur,
                   help="quality gate: variance of the Laplacian (default: %(default)s)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=_import)

    p = sub.add_parser("rebuild", help="recreate index(es) from the database and write snapshots")
    p.add_argument("--collection")
    p.set_defaults(run=_rebuild)

    sub.add_parser("stats", help="collections, their sizes and indexes (kind, search effort, what the "
                   "build measured)").set_defaults(run=_stats)

    p = sub.add_parser("reembed", help="re-embed a collection from its stored crops with the served model")
    p.add_argument("--collection", required=True)
    _triton_argument(p, settings)
    p.set_defaults(run=_reembed)
    return root


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("alembic", "faiss"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return int(args.run(args))
    except GalleryError as exc:
        log.error("%s (%s)", exc.message, exc.code)
        return 2
    except (ValueError, OSError, csv.Error, PipelineError, httpx.HTTPError) as exc:
        log.error("%s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
