"""Gallery index benchmark: exact FAISS, the approximate candidates and Milvus-lite, on the same data.

    python -m bench.gallery                    # 10k, 100k and 1M faces, 128-d and 512-d
    python -m bench.gallery --quick            # 10k and 100k only (CI smoke run)
    python -m bench.gallery --sizes 100000 --dims 128 --queries 500 --json gallery.json

Synthetic faces: N/10 random identity centres, 10 faces each at cosine ~0.75 to one another (SFace's
genuine pairs) and ~0 to other identities. Each index is built as ``FaceIndex.build`` builds it and
measured on held-out genuine and impostor probes (``bench/gallery_engines.py``); Milvus-lite (the
`milvus` extra) up to ``--milvus-max`` faces. docs/benchmarks/gallery.md says how to read the section.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from bench.core import reporting
from bench.core.inputs import ROOT
from bench.core.reporting import MIB, fmt, table
from bench.gallery_engines import (
    CONCURRENCY,
    Row,
    Truth,
    bench_exact,
    bench_faiss,
    bench_milvus,
    milvus_missing,
)
from gallery.engines.index import Vectors, genuine_probes
from gallery.engines.measures import exact_search

K = 10
PER_IDENTITY = 10
#: SFace's match threshold (export/specs/sface_2021dec.toml): the decision the agreement is about.
THRESHOLD = 0.363
GENUINE = 0.75
PROBE_SEED = 1  # FaceIndex tunes nprobe on genuine_probes(seed=0): measure on other queries

log = logging.getLogger(__name__)


def synthetic_faces(count: int, dimension: int, seed: int = 0) -> Vectors:
    """[count, dimension] unit vectors; rows i and j are the same identity when i // 10 == j // 10."""
    rng = np.random.default_rng(seed)
    sigma = math.sqrt(1 / GENUINE - 1) / math.sqrt(dimension)  # per coordinate: noise norm ~ sqrt(1/3)
    out = np.empty((count, dimension), np.float32)
    step = 8192  # identities per chunk: bounds the temporaries at 1M x 512
    for first in range(0, -(-count // PER_IDENTITY), step):
        centres = rng.standard_normal((step, dimension), dtype=np.float32)
        centres /= np.linalg.norm(centres, axis=1, keepdims=True)
        faces = np.repeat(centres, PER_IDENTITY, axis=0)
        faces += sigma * rng.standard_normal(faces.shape, dtype=np.float32)
        faces /= np.linalg.norm(faces, axis=1, keepdims=True)
        rows = out[first * PER_IDENTITY : (first + step) * PER_IDENTITY]
        rows[:] = faces[: len(rows)]
    return out


def probe_set(vectors: Vectors, count: int) -> tuple[Vectors, Any]:
    """``genuine_probes`` and the row each probe was made from (same generator, checked)."""
    probes = genuine_probes(vectors, count, GENUINE, seed=PROBE_SEED)
    sources = np.random.default_rng(PROBE_SEED).choice(len(vectors), size=len(probes), replace=False)
    if not np.allclose((probes * vectors[sources]).sum(axis=1), GENUINE, atol=1e-3):
        raise RuntimeError("genuine_probes no longer picks its sources as this benchmark assumes")
    return probes, sources


def truth_for(vectors: Vectors, queries: int) -> Truth:
    """Held-out genuine probes (seed 1: the build tunes on seed 0) and impostors: faces of new people."""
    probes, sources = probe_set(vectors, queries)
    impostors = synthetic_faces(queries * PER_IDENTITY, vectors.shape[1], seed=99)[::PER_IDENTITY]
    ids = np.arange(len(vectors), dtype=np.int64)
    return Truth(probes, sources.astype(np.int64), np.ascontiguousarray(impostors),
                 exact_search(probes, vectors, ids, K), exact_search(impostors, vectors, ids, K),
                 lambda faces: faces // PER_IDENTITY, THRESHOLD)


def benchmark_case(size: int, dimension: int, queries: int = 200,
                   candidates: tuple[str, ...] = ("pq4fs", "sq8"), milvus_max: int = 0) -> list[Row]:
    """Every index over one synthetic gallery; frees everything it allocated before returning."""
    vectors = synthetic_faces(size, dimension)
    truth = truth_for(vectors, queries)
    log.info("%d x %d: exact index", size, dimension)
    rows = [bench_exact(vectors, truth)]
    for kind in candidates:
        log.info("%d x %d: %s", size, dimension, kind)
        rows.append(bench_faiss(vectors, kind, truth, THRESHOLD))
    if size <= milvus_max:
        missing = milvus_missing()
        if missing:
            log.warning("%d x %d: Milvus-lite rows skipped: %s", size, dimension, missing)
        else:
            log.info("%d x %d: milvus-lite", size, dimension)
            rows.append(bench_milvus(vectors, truth, THRESHOLD))
    del vectors
    return rows


def _agreement(r: Row) -> str:
    if r.genuine_agreement is None:
        return "—"
    return f"{r.genuine_agreement:.2%} / {fmt(100 * (r.impostor_agreement or 0), 2)}%"


COLUMNS: tuple[tuple[str, Any], ...] = (
    ("faces", "{0.size:,}"), ("dim", "{0.dimension}"), ("index", "{0.label}"),
    ("build s", lambda r: fmt(r.build_s, 1)), ("p50 ms", lambda r: fmt(r.p50_ms, 2)),
    ("p99 ms", lambda r: fmt(r.p99_ms, 2)),
    *((f"q/s @{c}", lambda r, c=c: fmt(r.qps.get(str(c)), 0)) for c in CONCURRENCY),
    ("recall@10 (lower bound)", lambda r: "—" if r.recall_at_10 is None
     else f"{r.recall_at_10:.4f} ({fmt(r.recall_bound, 4)})"),
    ("agreement genuine / impostor", _agreement), ("true match@10", lambda r: fmt(r.true_match_at_10, 4)),
    ("MiB / 1M faces", lambda r: fmt(r.memory_bytes and r.memory_bytes / r.size * 1e6 / MIB, 0)),
    ("load s", lambda r: fmt(r.load_s, 2)))


def result_table(rows: list[Row]) -> str:
    return table(rows, COLUMNS)


def document(command: str, rows: list[Row], machine: str) -> str:
    title = "## Gallery search: exact, approximate candidates and Milvus-lite (`bench/gallery.py`)"
    return "\n\n".join([title, reporting.run_header(command, machine), result_table(rows)])


def main(argv: list[str] | None = None) -> int:
    parser = reporting.cli("bench.gallery", __doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--dims", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--queries", type=int, default=200,
                        help="genuine and impostor probes for accuracy (default: %(default)s; latency and "
                             "throughput use the first 200)")
    parser.add_argument("--quick", action="store_true", help="10k and 100k faces only (CI smoke run)")
    parser.add_argument("--candidates", nargs="*", default=["pq4fs", "sq8"],
                        help="approximate kinds to build, each alone (pq4fs, pq4fs-fine, sq8, ivf), or auto: "
                             "the index the default selection chooses (default: %(default)s)")
    parser.add_argument("--milvus-max", type=int, default=100_000,
                        help="Milvus-lite rows up to this many faces (they need the `milvus` extra; 0: none; "
                        "default: %(default)s)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "gallery.md")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    reporting.log_progress("faiss")  # its loader's messages about CPU variants
    sizes = [10_000, 100_000] if args.quick else args.sizes
    rows: list[Row] = []
    for size in sizes:
        for dimension in args.dims:
            case = benchmark_case(size, dimension, args.queries, tuple(args.candidates), args.milvus_max)
            rows += case
            print(result_table(case), flush=True)
    command, machine = reporting.command_line("bench.gallery", argv), reporting.machine_description()
    text = document(command, rows, machine)
    print(text)
    reporting.write_section(args.out, "bench.gallery", text)
    if args.json:
        results = {"command": command, "machine": machine, "rows": [asdict(r) for r in rows]}
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
