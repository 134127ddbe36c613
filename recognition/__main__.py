"""``python -m recognition``: work that runs faces through the pipeline from the command line.

``import`` enrolls a folder tree (one subfolder per identity) or a CSV manifest, straight to Triton and the
database or through a deployed stack's REST API (``--api``); the rules are ``recognition.importer``'s.
Defaults come from the settings every entry point reads (``facecore/settings.py``): the database from
FACEREC_DATABASE__URL or FACEREC_DB_*, Triton from FACEREC_TRITON__URL, the quality gate from
FACEREC_QUALITY__*, the request sizes from FACEREC_LIMITS__*.

``evaluate`` measures the served model on a labelled folder (``recognition.evaluate``): 1:1 ROC, open-set
1:N by gallery size at the fixed and the FPIR-calibrated thresholds (docs/calibration.md).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from facecore.client import AsyncPipelineClient, PipelineError
from facecore.settings import Settings
from gallery.cli import open_store, root_parser, run, triton_argument
from gallery.errors import GalleryError
from recognition.evaluate import add_parser as add_evaluate
from recognition.importer import (
    Importer,
    ImportOptions,
    ItemResult,
    check_report_path,
    read_manifest,
    scan_folder,
    write_report,
)
from recognition.rest_import import ApiFailure, RestBackend

log = logging.getLogger("recognition")

#: ``import --concurrency``: more requests in flight than this only queue at Triton or the gateway.
MAX_CONCURRENCY = 64
#: The exit status of an import stopped with Ctrl-C (128 + SIGINT, as a shell reports it).
INTERRUPTED = 130


def _import(args: argparse.Namespace) -> int:
    if args.api and not args.key:
        raise ValueError("--api needs --key (a key of the collection, or the admin key)")
    if args.report:
        check_report_path(args.report)
    items = scan_folder(args.folder) if args.folder else read_manifest(args.manifest)
    quality = replace(args.settings.quality, min_face_size=args.min_face_size,
                      min_blur=args.min_blur)
    importing = _import_rest if args.api else _import_local
    done: list[ItemResult] = []
    try:
        results: list[ItemResult] = asyncio.run(importing(args, items, quality, done))
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
                                           spec.match_threshold,
                                           target_fpir=args.settings.gallery.default_fpir or None)
        if (info.embedding_model, info.dimension) != (spec.name, spec.embedding_dim):
            raise ValueError(f"collection {info.name} holds {info.embedding_model} ({info.dimension}-d) "
                             f"embeddings but Triton serves {spec.name} ({spec.embedding_dim}-d): import "
                             f"into another collection, or `reembed` this one first")
        options = ImportOptions(args.collection, spec.name, args.concurrency, args.dry_run,
                                args.largest_face, quality, args.settings.limits)
        return await Importer(store, client, options).run(items, not args.quiet, done)
    finally:
        await client.close()


async def _import_rest(args: argparse.Namespace, items: list[Any], quality: Any,
                       done: list[Any]) -> list[Any]:
    """Through a deployed stack's REST API with a key (the server's quality gate applies)."""
    options = ImportOptions(args.collection, "", args.concurrency, args.dry_run, args.largest_face, quality,
                            args.settings.limits)
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


def _concurrency(value: str) -> int:
    """``--concurrency``: a whole number from 1 to ``MAX_CONCURRENCY``."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {value!r}") from None
    if not 1 <= number <= MAX_CONCURRENCY:
        raise argparse.ArgumentTypeError(f"must be from 1 to {MAX_CONCURRENCY}, not {number}")
    return number


def parser(settings: Settings | None = None) -> argparse.ArgumentParser:
    root, sub = root_parser("python -m recognition", __doc__, settings)
    settings = root.get_default("settings")
    p = sub.add_parser("import", help="import a folder tree (one subfolder per identity) or a CSV manifest")
    p.add_argument("--collection", required=True)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--folder", type=Path)
    source.add_argument("--manifest", type=Path, help="UTF-8 CSV with columns path,external_id,name "
                        "(an invalid row refuses the whole manifest)")
    triton_argument(p, settings)
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
    add_evaluate(sub, settings, _concurrency)

    return root


def main(argv: list[str] | None = None) -> int:
    return run(parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
