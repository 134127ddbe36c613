"""Does an index chosen by measurement keep its targets while its collection grows?

    python -m bench.gallery_growth            # 100k -> 150k, 200k, 400k, 1M at 128-d and 512-d (~7 min)
    python -m bench.gallery_growth --first 20000 --sizes 40000 100000 --dims 128

An index is chosen (``gallery/engines/selection.py``) on the collection as it is at build: the search effort
(re-rank depth, nprobe) that reaches the recall and agreement targets there. Enrollments and imports
then add faces to it without a new build. Here, on the synthetic faces of ``bench.gallery``: the index
chosen at ``--first`` faces (the candidates measured as at any build above ``exact_max``), grown by
adds to each of ``--sizes``, measured against exact search on held-out probes of that size (recall@10
with its lower bound, decision agreement on genuine and impostor probes); beside it, the same
collection under the gallery's rule (``FaissIndex.outgrown``: measured again once it holds
``reselect_growth`` times the faces its index was chosen at), with the size its index was chosen at.
Writes a Markdown section to ``--out``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.core.inputs import ROOT
from bench.core.reporting import fmt, machine_description, markdown_table, write_section
from bench.gallery import THRESHOLD, synthetic_faces, truth_for
from bench.gallery_measure import Row, Truth, accuracy
from gallery.engines.faiss_engine import FaissIndex
from gallery.engines.index import FaceIndex, Ids, IndexConfig, Vectors

PER_IDENTITY = 10

log = logging.getLogger(__name__)


@dataclass
class Step:
    size: int
    dimension: int
    index: str  # "grown" (never measured again) or "gallery rule"
    kind: str
    effort: int
    chosen_at: int
    row: Row
    build_s: float = 0.0  # of a measurement made at this size, 0 when none


def _label(index: FaceIndex) -> tuple[str, int]:
    return index.kind.value, index.nprobe


def _build(ids: Ids, vectors: Vectors, config: IndexConfig) -> tuple[FaissIndex, float]:
    began = time.perf_counter()
    index = FaceIndex.build(vectors.shape[1], ids, vectors, config, identities=ids // PER_IDENTITY,
                            threshold=THRESHOLD)
    identity_of = dict(zip(ids.tolist(), (ids // PER_IDENTITY).tolist(), strict=True))
    return FaissIndex(index, identity_of), time.perf_counter() - began


def _measured(index: FaissIndex, size: int, dimension: int, name: str, truth: Truth) -> Row:
    row = Row(size, dimension, name)
    accuracy(index.index.search, truth, row)
    return row


def grow(dimension: int, first: int, sizes: list[int], queries: int) -> list[Step]:
    """The index chosen at ``first`` faces, grown to each size, beside the gallery's rule."""
    total = max(sizes)
    vectors = synthetic_faces(total, dimension)
    ids = np.arange(total, dtype=np.int64)
    config = IndexConfig(exact_always=0, exact_max=first - 1)  # measured at ``first``, as above exact_max
    grown, build_s = _build(ids[:first], vectors[:first], config)
    followed = grown
    log.info("%d x %d: chose %s (effort %d) in %.1f s", first, dimension, *_label(grown.index), build_s)
    steps: list[Step] = []
    for size in sorted(sizes):
        have = len(grown)
        added = ids[have:size]
        grown.add(added, added // PER_IDENTITY, vectors[have:size])
        if followed is not grown:
            followed.add(added, added // PER_IDENTITY, vectors[have:size])
        rebuilt_s = 0.0
        if followed.outgrown:
            followed, rebuilt_s = _build(ids[:size], vectors[:size], config)
            log.info("%d x %d: the gallery's rule chose %s (effort %d) again in %.1f s", size, dimension,
                     *_label(followed.index), rebuilt_s)
        truth, _ = truth_for(vectors[:size], queries)
        for name, index, seconds in (("grown", grown, 0.0), ("gallery rule", followed, rebuilt_s)):
            row = _measured(index, size, dimension, name, truth)
            steps.append(Step(size, dimension, name, *_label(index.index), index.index.selected_at, row,
                              seconds))
            log.info("%d x %d %s: recall %.4f (%.4f), agreement %.4f / %.4f", size, dimension, name,
                     row.recall_at_10, row.recall_bound, row.genuine_agreement, row.impostor_agreement)
    return steps


def table(steps: list[Step]) -> str:
    header = ("faces", "dim", "index", "kind (effort)", "chosen at", "measured again here, s",
              "recall@10 (lower bound)", "agreement genuine / impostor")
    rows = [(f"{s.size:,}", str(s.dimension), s.index, f"{s.kind} ({s.effort})", f"{s.chosen_at:,}",
             fmt(s.build_s, 1) if s.build_s else "—",
             f"{fmt(s.row.recall_at_10, 4)} ({fmt(s.row.recall_bound, 4)})",
             f"{100 * (s.row.genuine_agreement or 0):.2f}% / {100 * (s.row.impostor_agreement or 0):.2f}%")
            for s in steps]
    return markdown_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gallery_growth", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--first", type=int, default=100_000, help="faces at the first build (default: "
                        "%(default)s)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[150_000, 200_000, 400_000, 1_000_000],
                        help="sizes grown to, by adds (default: %(default)s)")
    parser.add_argument("--dims", type=int, nargs="+", default=[128, 512], help="(default: %(default)s)")
    parser.add_argument("--queries", type=int, default=2000, help="genuine and impostor probes per size "
                        "(default: %(default)s)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "gallery.md")
    args = parser.parse_args(argv)
    if any(size <= args.first for size in args.sizes):
        parser.error("every --sizes value must be larger than --first")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("faiss").setLevel(logging.WARNING)
    steps = [step for dimension in args.dims
             for step in grow(dimension, args.first, args.sizes, args.queries)]
    command = "python -m bench.gallery_growth " + " ".join(argv if argv is not None else sys.argv[1:])
    text = "\n\n".join([
        "## An index chosen at one size, grown by enrollments (`bench/gallery_growth.py`)",
        f"Command: `{command.strip()}`  \nDate: {time.strftime('%Y-%m-%d %H:%M %Z')}  \n"
        f"Machine: {machine_description()}",
        table(steps),
        "*grown*: the index chosen at the first size, faces only added since; *gallery rule*: the same "
        "collection as the gallery keeps it (measured again in the background once it holds "
        f"`reselect_growth`, {IndexConfig().reselect_growth:g}, times the faces its index was chosen at; "
        "*chosen at* is that size).",
    ])
    print(text)
    write_section(args.out, "bench.gallery_growth", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
