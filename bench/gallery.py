"""Gallery index benchmark: exact vs IVF ``FaceIndex`` on synthetic face-like embeddings.

    python -m bench.gallery                    # 10k, 100k and 1M faces, 128-d and 512-d
    python -m bench.gallery --quick            # 10k and 100k only (CI smoke run)
    python -m bench.gallery --sizes 100000 --dims 128 --queries 500 --json gallery.json

Data: N/10 random identity centres (unit vectors), 10 faces each = normalize(centre + noise), the
noise of norm sqrt(1/0.75 - 1) so that two faces of one identity have cosine ~0.75 (SFace genuine
pairs: 0.74-0.77) and faces of different identities ~0 (sd 1/sqrt(d)). Queries are
``genuine_probes``: a new photo of an enrolled person at cosine 0.75 to one stored face, its source.

For each size and dimension: the exact index (``FaceIndex.build`` with ``exact_max`` >= N) and the
approximate one (``exact_max=0``: IVF trained, nprobe chosen for recall >= 0.99, or refused and kept
exact). Measured: build time, sequential single-query latency (k=10), batched throughput (64 per
call), recall@10 against exact search, how often the source face is in the top 10, snapshot size,
resident-memory growth, snapshot save and load times. Writes a Markdown section to --out.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import logging
import math
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.core.inputs import ROOT
from bench.core.reporting import MIB, fmt, machine_description, markdown_table, mib, write_section
from gallery.index import FaceIndex, IndexConfig, IndexKind, Vectors, genuine_probes, recall_at_k

K = 10
BATCH = 64
PER_IDENTITY = 10
GENUINE = 0.75
PROBE_SEED = 1  # FaceIndex tunes nprobe on genuine_probes(seed=0): measure on other queries

log = logging.getLogger(__name__)


# --- data ------------------------------------------------------------------------------------------


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


@dataclass(frozen=True)
class DataStats:
    """How face-like the synthetic set is: what a real gallery's score distributions look like."""

    genuine_cos: float  # mean cosine of two faces of one identity
    impostor_cos: float  # mean cosine of two faces of different identities
    impostor_sd: float
    probe_best_impostor: float  # mean over probes of the best different-identity score
    probe_impostor_wins: float  # fraction of probes whose best impostor beats the source face


def data_stats(vectors: Vectors, sources: Any, scores: Any, ids: Any) -> DataStats:
    rng = np.random.default_rng(2)
    pairs = min(2000, len(vectors) // PER_IDENTITY)
    first = rng.choice(len(vectors) // PER_IDENTITY, size=pairs, replace=False) * PER_IDENTITY
    genuine = (vectors[first] * vectors[first + 1]).sum(axis=1)
    a, b = rng.integers(0, len(vectors), size=(2, 4000))
    different = a // PER_IDENTITY != b // PER_IDENTITY
    impostor = (vectors[a[different]] * vectors[b[different]]).sum(axis=1)
    outsider = ids // PER_IDENTITY != (sources // PER_IDENTITY)[:, None]  # k=20 > 10 faces: >= 10 impostors
    best = np.where(outsider, scores, -np.inf).max(axis=1)
    return DataStats(float(genuine.mean()), float(impostor.mean()), float(impostor.std()),
                     float(best.mean()), float((best > GENUINE).mean()))


# --- memory ----------------------------------------------------------------------------------------


def _status_kib(key: str) -> int:
    match = re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    return int(match.group(1)) if match else 0


def _release_free_memory() -> None:
    """Collect garbage and hand freed heap pages back to the kernel (glibc keeps up to ~64 MB otherwise,
    which a later allocation reuses without growing the RSS)."""
    gc.collect()
    with suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@dataclass
class MemoryProbe:
    """Resident-set growth across a block, and its peak (VmHWM, reset through clear_refs)."""

    retained: int = 0
    peak: int = 0

    @contextmanager
    def measure(self) -> Iterator[MemoryProbe]:
        _release_free_memory()
        before = _status_kib("VmRSS")
        with suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        yield self
        _release_free_memory()
        self.retained = (_status_kib("VmRSS") - before) * 1024
        self.peak = (_status_kib("VmHWM") - before) * 1024


# --- one index -------------------------------------------------------------------------------------


@dataclass
class Row:
    size: int
    dimension: int
    index: str  # "exact", "ivf", or "refused" (IVF tried, kept exact)
    nlist: int | None = None
    nprobe: int | None = None
    tuning_recall: float | None = None  # the recall@10 FaceIndex measured while choosing nprobe
    build_s: float = 0.0
    p50_ms: float | None = None
    p99_ms: float | None = None
    batch_qps: float | None = None
    recall_at_10: float | None = None
    true_match_at_10: float | None = None
    snapshot_bytes: int | None = None
    rss_delta_bytes: int | None = None
    build_peak_bytes: int | None = None
    save_s: float | None = None
    load_s: float | None = None
    on_gpu: bool = False

    @property
    def label(self) -> str:
        if self.index == "exact":
            return "exact (Flat)"
        tried = f"IVF{self.nlist or '?'}, nprobe {self.nprobe or '?'}"
        if self.index == "ivf":
            return tried
        return (f"IVF refused → exact (IVF{self.nlist or '?'} up to nprobe {self.nprobe or '?'}: "
                f"recall {fmt(self.tuning_recall, 3)})")


class _IvfLog(logging.Handler):
    """FaceIndex logs (nlist, n, recall, nprobe, %) when it tries IVF; catch the figures."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.args: tuple[Any, ...] = ()

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("IVF") and isinstance(record.args, tuple):
            self.args = record.args


def build(vectors: Vectors, config: IndexConfig, row: Row) -> FaceIndex:
    logger, handler = logging.getLogger("gallery.index"), _IvfLog()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    memory = MemoryProbe()
    try:
        with memory.measure():
            began = time.perf_counter()
            ids = np.arange(len(vectors), dtype=np.int64)
            index = FaceIndex.build(vectors.shape[1], ids, vectors, config)
            row.build_s = time.perf_counter() - began
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    row.rss_delta_bytes, row.build_peak_bytes = memory.retained, memory.peak
    row.on_gpu = index.on_gpu
    if index.kind is IndexKind.IVF:
        row.index, row.nprobe, row.tuning_recall = "ivf", index.nprobe, index.recall
    elif config.exact_max < len(vectors):
        row.index, row.tuning_recall = "refused", index.recall
    if handler.args and row.index != "exact":  # nlist, and the last nprobe tried when refused
        row.nlist, row.nprobe = int(handler.args[0]), int(handler.args[4])
    return index


def measure(index: FaceIndex, probes: Vectors, sources: Any, truth: Any | None, row: Row) -> Any:
    """Latency, throughput, recall; returns the top-k ids of every probe."""
    for query in probes[:5]:
        index.search(query[None], K)  # warm-up
    latencies = []
    for query in probes:
        began = time.perf_counter()
        index.search(query[None], K)
        latencies.append((time.perf_counter() - began) * 1000)
    row.p50_ms, row.p99_ms = (float(v) for v in np.percentile(latencies, [50, 99]))
    order = np.resize(np.arange(len(probes)), -(-len(probes) // BATCH) * BATCH)  # whole batches
    began = time.perf_counter()
    for start in range(0, len(order), BATCH):
        index.search(probes[order[start : start + BATCH]], K)
    row.batch_qps = len(order) / (time.perf_counter() - began)
    _, ids = index.search(probes, K)
    row.recall_at_10 = recall_at_k(ids, ids if truth is None else truth)
    row.true_match_at_10 = float((ids == sources[:, None]).any(axis=1).mean())
    return ids


def bench_index(vectors: Vectors, config: IndexConfig, probes: Vectors, sources: Any, truth: Any | None,
                row: Row) -> tuple[Any, Any]:
    """Build, measure, snapshot (freeing the index before loading the snapshot back).

    Returns the top-10 ids of the probes and, for the exact index (``truth`` None), their top-20
    (scores, ids); (None, None) when IVF was refused (the index is the exact one again: nothing new).
    """
    index = build(vectors, config, row)
    if row.index == "refused":
        return None, None
    ids = measure(index, probes, sources, truth, row)
    wide = index.search(probes, 2 * K) if truth is None else None
    with tempfile.TemporaryDirectory(prefix="bench-gallery-") as folder:
        path = Path(folder) / "index.faiss"  # the same bytes as faiss.serialize_index
        began = time.perf_counter()
        index.save(path, seq=0)
        row.save_s = time.perf_counter() - began
        row.snapshot_bytes = path.stat().st_size
        del index
        _release_free_memory()
        began = time.perf_counter()
        loaded, _ = FaceIndex.load(path, config)
        row.load_s = time.perf_counter() - began
    if not np.array_equal(loaded.search(probes[:16], K)[1], ids[:16]):
        raise RuntimeError(f"{row.label}: the loaded snapshot answers differently from the saved index")
    return ids, wide


def benchmark_case(size: int, dimension: int, queries: int = 200) -> tuple[DataStats, list[Row]]:
    """Both indexes over one synthetic gallery; frees everything it allocated before returning."""
    vectors = synthetic_faces(size, dimension)
    probes, sources = probe_set(vectors, queries)
    log.info("%d x %d: exact index", size, dimension)
    exact = Row(size, dimension, "exact")
    truth, (scores, wide) = bench_index(vectors, IndexConfig(exact_max=size), probes, sources, None, exact)
    stats = data_stats(vectors, sources, scores, wide)
    log.info("%d x %d: approximate index", size, dimension)
    approximate = Row(size, dimension, "ivf")
    bench_index(vectors, IndexConfig(exact_max=0), probes, sources, truth, approximate)
    del vectors
    _release_free_memory()
    return stats, [exact, approximate]


# --- report ----------------------------------------------------------------------------------------


COLUMNS = ("faces", "dim", "index", "build s", "query p50 ms", "query p99 ms", "q/s (batch 64)", "recall@10",
           "true match@10", "snapshot MiB", "MiB / 1M faces (snapshot / RSS)", "RSS Δ MiB",
           "build peak Δ MiB", "save s", "load s")


def result_table(rows: list[Row]) -> str:
    lines = []
    for r in rows:
        per_million = "—" if r.snapshot_bytes is None or r.rss_delta_bytes is None else (
            f"{r.snapshot_bytes / r.size * 1e6 / MIB:,.0f} / {r.rss_delta_bytes / r.size * 1e6 / MIB:,.0f}")
        lines.append((f"{r.size:,}", str(r.dimension), r.label, fmt(r.build_s, 2), fmt(r.p50_ms, 3),
                      fmt(r.p99_ms, 3), fmt(r.batch_qps, 0), fmt(r.recall_at_10, 4),
                      fmt(r.true_match_at_10, 4), mib(r.snapshot_bytes), per_million,
                      mib(r.rss_delta_bytes), mib(r.build_peak_bytes), fmt(r.save_s, 2),
                      fmt(r.load_s, 2)))
    return markdown_table(COLUMNS, lines)


def data_table(cases: list[tuple[int, int, DataStats]]) -> str:
    columns = ("faces", "dim", "genuine cos (mean)", "impostor cos (mean ± sd)",
               "probe: best impostor (mean)", "probes whose best impostor beats the true match")
    lines = [(f"{n:,}", str(d), f"{s.genuine_cos:.3f}", f"{s.impostor_cos:+.3f} ± {s.impostor_sd:.3f}",
              f"{s.probe_best_impostor:.3f}", f"{s.probe_impostor_wins:.1%}") for n, d, s in cases]
    return markdown_table(columns, lines)


HOW_TO_READ = """\
**How to read this.** Each gallery holds N synthetic faces (N/10 identities, 10 faces each); each query is
a new photo of an enrolled person, at cosine 0.75 to one stored face (its *true match*). *Exact* is a flat
inner-product scan (`FaceIndex.build` below `exact_max`): recall 1 by definition, cost linear in N and d.
*Approximate* is `FaceIndex.build` with `exact_max=0`: it trains IVF and keeps it only when recall@10 on
its own 500 tuning queries, less two standard errors, reaches 0.99 scanning at most half of the lists
(nprobe tried in steps of about x1.4); otherwise it says *refused*, with the recall at the largest nprobe
it tried, and stays exact (its build time then includes the wasted IVF attempt). *recall@10* compares the
top 10 with the exact top 10 on queries the index was not tuned on; *true match@10* is what a face search
needs: the source face is among the 10 results. Latency is one query per call, sequential (what one API
request costs); *q/s (batch 64)* is throughput with 64 queries per call. *Snapshot* is the index file
`FaceIndex.save` writes (the same bytes as `faiss.serialize_index`); *RSS Δ* is the resident memory the
built index keeps (vectors, FAISS ids and the Python id set); *build peak Δ* is the high-water mark during
the build (temporary copies). Save and load run against a warm page cache.
"""


def document(command: str, rows: list[Row], stats: list[tuple[int, int, DataStats]], machine: str) -> str:
    return "\n\n".join([
        "## FAISS index: exact vs IVF (`bench/gallery.py`)",
        f"Command: `{command}`  \nDate: {time.strftime('%Y-%m-%d %H:%M %Z')}  \nMachine: {machine}",
        result_table(rows),
        "Synthetic data (what the queries face):",
        data_table(stats),
        HOW_TO_READ.strip(),
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gallery", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--dims", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--queries", type=int, default=200, help="probes per measurement (default: 200)")
    parser.add_argument("--quick", action="store_true", help="10k and 100k faces only (CI smoke run)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "gallery.md")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("faiss").setLevel(logging.WARNING)  # its loader's messages about CPU variants
    sizes = [10_000, 100_000] if args.quick else args.sizes
    rows: list[Row] = []
    stats: list[tuple[int, int, DataStats]] = []
    for size in sizes:
        for dimension in args.dims:
            case_stats, case_rows = benchmark_case(size, dimension, args.queries)
            stats.append((size, dimension, case_stats))
            rows += case_rows
            print(result_table(case_rows), flush=True)
    command = "python -m bench.gallery " + " ".join(argv if argv is not None else sys.argv[1:])
    machine = machine_description()
    text = document(command.strip(), rows, stats, machine)
    print(text)
    write_section(args.out, "bench.gallery", text)
    if args.json:
        results = {"command": command, "machine": machine, "rows": [asdict(r) for r in rows],
                   "data": [{"size": n, "dimension": d, **asdict(s)} for n, d, s in stats]}
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
