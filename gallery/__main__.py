"""``python -m gallery``: migrate the database, create collections, rebuild or snapshot indexes, show them,
re-embed a collection.

Defaults come from the settings every entry point reads (``facecore/settings.py``): the database URL
from FACEREC_DATABASE__URL or FACEREC_DB_* (else SQLite in data/), the snapshots from
FACEREC_GALLERY__SNAPSHOT_DIR, Triton from FACEREC_TRITON__URL. The batch import is
``python -m recognition import`` (it runs faces through the pipeline: a layer above the gallery).
"""

from __future__ import annotations

import argparse
import logging
import sys

from facecore.client import PipelineClient
from facecore.settings import Settings
from gallery.calibration import FPIR, decide, own_tail
from gallery.cli import open_store, root_parser, run, triton_argument
from gallery.engines.base import IndexInfo
from gallery.store.store import CollectionInfo

log = logging.getLogger("gallery")


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
    fpir = args.fpir
    if fpir is None:  # as the REST API does: a threshold alone is a fixed policy, else the default target
        fpir = None if args.threshold is not None else args.settings.gallery.default_fpir
    info = store.create_collection(args.name, model, dimension, threshold, not args.no_crops, fpir or None)
    print(f"collection {info.name}: {info.embedding_model}, {info.dimension}-d, {policy_summary(info)}")
    return 0


def policy_summary(info: CollectionInfo) -> str:
    """How a collection decides, in a few words (``create-collection``, ``stats``)."""
    if info.match_policy != FPIR:
        return f"fixed threshold {info.match_threshold:g}"
    measured = own_tail(info)
    basis = ("its own scores" if measured is not None
             else "the model's reference (its own scores once it holds enough identities)")
    return f"at most {100 * (info.target_fpir or 0):g} % of strangers matched (from {basis})"


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
        decided = ""
        if own_tail(info) is not None:  # without Triton the model's reference is unknown here
            decided = f" (threshold {decide(info, index.faces, {}).threshold:.4f} at this size)"
        print(f"{info.name}\t{info.embedding_model}\t{info.dimension}-d\t{index.faces} faces\t"
              f"{index_summary(index)}\t{policy_summary(info)}{decided}")
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


def parser(settings: Settings | None = None) -> argparse.ArgumentParser:
    root, sub = root_parser("python -m gallery", __doc__, settings)
    settings = root.get_default("settings")
    sub.add_parser("migrate", help="create or upgrade the database schema").set_defaults(run=_migrate)

    p = sub.add_parser("create-collection", help="create a collection for the served model (or --model ...)")
    p.add_argument("name")
    triton_argument(p, settings)
    p.add_argument("--model", help="embedding model id (default: ask Triton which model it serves)")
    p.add_argument("--dimension", type=int, default=128)
    p.add_argument("--threshold", type=float, help="a fixed match threshold (default: the model's); with "
                   "--fpir, the floor its threshold never goes below")
    p.add_argument("--fpir", type=float, help="decide at this false-positive identification rate at the "
                   "collection's size (default: FACEREC_GALLERY__DEFAULT_FPIR, "
                   f"{settings.gallery.default_fpir:g}, unless --threshold is given; 0: a fixed threshold)")
    p.add_argument("--no-crops", action="store_true",
                   help="do not keep aligned crops (no re-embedding later)")
    p.set_defaults(run=_create_collection)

    p = sub.add_parser("rebuild", help="recreate index(es) from the database and write snapshots")
    p.add_argument("--collection")
    p.set_defaults(run=_rebuild)

    sub.add_parser("stats", help="collections, their sizes and indexes (kind, search effort, what the "
                   "build measured)").set_defaults(run=_stats)

    p = sub.add_parser("reembed", help="re-embed a collection from its stored crops with the served model")
    p.add_argument("--collection", required=True)
    triton_argument(p, settings)
    p.set_defaults(run=_reembed)
    return root


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if _command(argv) == "import":
        log.error("the batch import is `python -m recognition import` now (same options)")
        return 2
    return run(parser(), argv)


def _command(argv: list[str]) -> str | None:
    """The subcommand named in ``argv`` (the first word that is neither an option nor a root option's
    value)."""
    words = iter(argv)
    for word in words:
        if word in ("--database-url", "--snapshot-dir"):
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


if __name__ == "__main__":
    sys.exit(main())
