"""Choosing a collection's index from measurements on its own vectors.

Above ``exact_max`` faces (and above ``exact_always`` when the exact scan, timed on the collection,
misses ``target_p99_ms``: ``worth_selecting``) each candidate of ``IndexConfig.candidates`` is built in
turn and its search effort (re-rank depth for the refined indexes, nprobe for IVF) raised step by step
until, on probes made from the collection itself, it reaches

- **recall@10** against exact search whose lower bound (less two standard errors) is at least
  ``target_recall``, and
- **decision agreement** with exact search: the same top-1 identity at or above the collection's
  threshold, or the same *unknown* below it, on at least ``target_genuine_agreement`` of the genuine
  probes (a new photo of an enrolled face) and ``target_impostor_agreement`` of the impostor probes
  (someone not enrolled, drawn from the collection's own distribution), both less two standard errors
  too (with the default 2000 impostor probes, 99.9 % then means that none disagrees).

Its single-query latency (the better of two passes) and its throughput under load (queries/s of
``throughput_concurrency`` concurrent one-query requests through the request batcher,
``gallery.engines.batching``, as a gateway sends them) are then measured. Once a candidate is within
``target_p99_ms``, ``rivals`` more are tried, and a rival within it replaces the candidate kept so far
when it serves at least ``rival_margin`` times its queries per second under load, the two measured side
by side: latency is the constraint, throughput under load the objective (at 1M x 128 the finer PQ codes
answered one query about as fast and served more under load, the more so the more requests at once; at
512-d they only double the scan). With none within it, the accurate candidate with the lowest p99 is kept
if it beats the exact scan, else the collection stays exact. After ``selection_budget_s`` no further
candidate is tried once one is usable, so a build stays within minutes where none reaches the p99
target. Every measurement is logged and kept on the index (``FaceIndex.selection``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import faiss
import numpy as np
from numpy.typing import NDArray

from gallery.engines.measures import (
    K,
    concurrent_throughput,
    decision_agreement,
    exact_search,
    genuine_probes,
    impostor_probes,
    latency_ms,
    paired_concurrent_throughput,
    proportion_lower_bound,
    recall_at_k,
    recall_lower_bound,
)
from gallery.engines.refine import CODES, RefinedIndex

__all__ = ["IndexConfig", "Measurement", "decision_agreement", "exact_search", "genuine_probes",
           "impostor_probes", "proportion_lower_bound", "recall_at_k", "recall_lower_bound", "select"]

log = logging.getLogger(__name__)

Ids = NDArray[np.int64]
Vectors = NDArray[np.float32]


@dataclass(frozen=True)
class IndexConfig:
    #: Above this many faces the candidates are always measured.
    exact_max: int = 200_000
    #: Up to this many the exact scan is kept without a look; between the two it is kept only when its
    #: single-query p99 is within ``target_p99_ms`` (timed at build: in this range the exact scan meets
    #: the target or not depending on the CPU and the dimension).
    exact_always: int = 20_000
    #: Tried in this order above ``exact_max`` (see the module's docstring for which is kept).
    candidates: tuple[str, ...] = ("pq4fs", "pq4fs-fine", "sq8", "ivf")
    #: Candidates tried after the first within ``target_p99_ms``, to compare their throughput under load.
    rivals: int = 1
    #: Concurrent one-query requests, and requests in all, of the throughput measurement: about what a
    #: gateway's searches reach (they run on asyncio's default thread pool, min(32, CPUs + 4) threads:
    #: 6 on 2 cores). With 32 threads the measurement also left much freed memory in their allocator
    #: arenas, kept by the process after the build.
    throughput_concurrency: int = 8
    throughput_requests: int = 160
    #: A rival replaces the candidate kept so far only when it serves this many times its queries per
    #: second under load (measured side by side): smaller differences are this machine's noise.
    rival_margin: float = 1.25
    target_recall: float = 0.99
    target_genuine_agreement: float = 1.0
    target_impostor_agreement: float = 0.999
    target_p99_ms: float = 5.0
    #: False: keep the first accurate candidate without timing it against the exact scan (tests).
    latency_check: bool = True
    #: Decision threshold for the agreement when the caller does not give the collection's own.
    match_threshold: float = 0.363
    use_gpu: bool = True  # only when faiss.get_num_gpus() > 0
    recall_queries: int = 500
    impostor_queries: int = 2000
    latency_queries: int = 100
    #: Re-rank depths tried for the refined indexes.
    rerank_steps: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048)
    #: Shards searched in parallel by one query (0: one per FAISS OpenMP thread).
    shards: int = 0
    #: IVF is kept only when it reaches the recall scanning at most this fraction of its lists.
    max_scan_fraction: float = 0.5
    #: Rebuild a tombstoned (GPU) index when this fraction of its vectors is removed.
    compact_fraction: float = 0.1
    #: Seconds of selection after which no further candidate is tried once one is usable (accurate and
    #: faster than the exact scan), within ``target_p99_ms`` or not: where no candidate reaches the p99
    #: target (a large collection, a CPU without AVX-512) every one is built in turn, for well over the
    #: 3 minutes or so a build should stay within (IVF alone more than half of that).
    selection_budget_s: float = 120.0
    #: An index chosen by measurement is measured again (in the background) once its collection holds
    #: this many times the faces it was chosen at (0: never; else more than 1): the re-rank depth or
    #: nprobe that met the targets at one size need not at a larger one (docs/benchmarks/gallery.md, "An
    #: index chosen at one size, grown by enrollments").
    reselect_growth: float = 1.5


#: Single-query latency passes per candidate (the better p50 and p99 are kept).
LATENCY_PASSES = 2
#: Queries that time the exact scan of a collection between ``exact_always`` and ``exact_max`` faces.
EXACT_QUERIES = 40


# --- candidates --------------------------------------------------------------------------------


@dataclass
class Measurement:
    """What the selection measured for one candidate at the effort it stopped on."""

    kind: str
    effort: int  # re-rank depth, or nprobe for IVF
    recall: float
    recall_bound: float
    genuine_agreement: float
    impostor_agreement: float
    accurate: bool
    p50_ms: float | None = None
    p99_ms: float | None = None
    build_s: float = 0.0
    concurrent_qps: float | None = None  # queries/s of IndexConfig.throughput_concurrency requests at once

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class IndexCandidate:
    """One kind of index over the collection, with a search-effort knob."""

    kind = ""

    def efforts(self) -> Iterator[int]:
        raise NotImplementedError

    def set_effort(self, effort: int) -> None:
        raise NotImplementedError

    def search(self, queries: Vectors, k: int) -> tuple[Vectors, Ids]:
        raise NotImplementedError

    def tune_for_this_machine(self, queries: Vectors) -> None:
        """Settings that change speed, not answers, measured here (before its latency is)."""

    index: Any = None


class Refined(IndexCandidate):
    def __init__(self, kind: str, ids: Ids, vectors: Vectors, shards: int, steps: tuple[int, ...]) -> None:
        self.kind, self.steps = kind, steps
        sample = vectors[np.random.default_rng(0).choice(len(vectors), size=min(len(vectors), 65_536),
                                                         replace=False)]
        self.index = RefinedIndex.train(kind, vectors.shape[1], sample, shards, steps[0])
        self.index.add_with_ids(vectors, ids)

    def efforts(self) -> Iterator[int]:
        yield from self.steps

    def set_effort(self, effort: int) -> None:
        self.index.rerank = effort

    def search(self, queries: Vectors, k: int) -> tuple[Vectors, Ids]:
        scores, ids = self.index.search(queries, k)
        return scores, ids

    def tune_for_this_machine(self, queries: Vectors) -> None:
        self.index.pick_lone_kernel(queries, K, label=f"{self.kind} over {self.index.ntotal} faces")


class Ivf(IndexCandidate):
    kind = "ivf"

    def __init__(self, ids: Ids, vectors: Vectors, max_scan_fraction: float) -> None:
        dimension = vectors.shape[1]
        self.nlist = int(min(65536, max(16, 4 * math.sqrt(len(ids)))))
        self.index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dimension), dimension, self.nlist,
                                        faiss.METRIC_INNER_PRODUCT)
        rng = np.random.default_rng(0)
        self.index.train(np.ascontiguousarray(vectors[rng.choice(len(vectors), size=min(len(vectors),
                                                                                        self.nlist * 64),
                                                                 replace=False)]))
        self.index.add_with_ids(np.ascontiguousarray(vectors), np.asarray(ids, np.int64))
        self.budget = max(1, int(max_scan_fraction * self.nlist))  # more lists than this: not worth it

    def efforts(self) -> Iterator[int]:
        yield from (n for n in nprobe_steps(self.nlist) if n <= self.budget)

    def set_effort(self, effort: int) -> None:
        self.index.nprobe = effort

    def search(self, queries: Vectors, k: int) -> tuple[Vectors, Ids]:
        scores, ids = self.index.search(queries, k)
        return scores, ids


def nprobe_steps(nlist: int) -> list[int]:
    """nprobe values to try, growing by about sqrt(2) (1, 2, 3, 4, 6, 8, 11, 16, ...) up to nlist."""
    steps: list[int] = []
    value = 1.0
    while round(value) < nlist:
        if not steps or round(value) > steps[-1]:
            steps.append(round(value))
        value *= math.sqrt(2)
    return [*steps, nlist]


def make_candidate(kind: str, ids: Ids, vectors: Vectors, config: IndexConfig) -> IndexCandidate:
    if kind == "ivf":
        return Ivf(ids, vectors, config.max_scan_fraction)
    if kind in CODES:
        shards = config.shards or max(1, faiss.omp_get_max_threads())
        return Refined(kind, ids, vectors, shards, config.rerank_steps)
    raise ValueError(f"unknown index candidate {kind!r} (choose from ivf, {', '.join(CODES)})")


@dataclass
class Probes:
    """Genuine and impostor probes of one collection with their exact answers."""

    genuine: Vectors
    impostor: Vectors
    genuine_exact: tuple[Vectors, Ids]
    impostor_exact: tuple[Vectors, Ids]
    identity_of: Callable[[Ids], Ids]
    threshold: float

    @classmethod
    def of(cls, ids: Ids, vectors: Vectors, identities: Ids | None, threshold: float,
           config: IndexConfig) -> Probes:
        genuine = genuine_probes(vectors, config.recall_queries)
        impostor = impostor_probes(vectors, config.impostor_queries)
        order = np.argsort(ids)
        sorted_ids, owners = ids[order], (ids if identities is None else identities)[order]

        def identity_of(face_ids: Ids) -> Ids:
            return owners[np.clip(np.searchsorted(sorted_ids, face_ids), 0, len(sorted_ids) - 1)]

        return cls(genuine, impostor, exact_search(genuine, vectors, ids, K),
                   exact_search(impostor, vectors, ids, 1), identity_of, threshold)

    def measure(self, candidate: IndexCandidate, effort: int, config: IndexConfig) -> Measurement:
        candidate.set_effort(effort)
        genuine = candidate.search(self.genuine, K)
        impostor = candidate.search(self.impostor, 1)
        recall = recall_at_k(genuine[1], self.genuine_exact[1])
        bound = recall_lower_bound(recall, len(self.genuine))
        agree_g = decision_agreement(genuine, self.genuine_exact, self.identity_of, self.threshold)
        agree_i = decision_agreement(impostor, self.impostor_exact, self.identity_of, self.threshold)
        # like recall, the agreements must reach their targets less two standard errors
        accurate = (bound >= config.target_recall
                    and proportion_lower_bound(agree_g, len(self.genuine)) >= config.target_genuine_agreement
                    and proportion_lower_bound(agree_i, len(self.impostor))
                    >= config.target_impostor_agreement)
        return Measurement(candidate.kind, effort, recall, bound, agree_g, agree_i, accurate)


def tune(candidate: IndexCandidate, probes: Probes, config: IndexConfig) -> Measurement:
    """Raise the effort until the accuracy targets are met (or the last step); latency when met."""
    measured: Measurement | None = None
    for effort in candidate.efforts():
        measured = probes.measure(candidate, effort, config)
        if measured.accurate:
            break
    if measured is None:
        raise ValueError(f"{candidate.kind}: no search effort to try")
    if measured.accurate and config.latency_check:
        candidate.tune_for_this_machine(probes.genuine[: config.latency_queries])
        # the better of LATENCY_PASSES passes for each figure: a shared machine's noise only slows a
        # pass down (one slow moment pushed a candidate's p99 past the target where its other passes were
        # well within it)
        passes = [latency_ms(lambda q: candidate.search(q, K), probes.genuine[: config.latency_queries])
                  for _ in range(LATENCY_PASSES)]
        measured.p50_ms, measured.p99_ms = min(p50 for p50, _ in passes), min(p99 for _, p99 in passes)
        measured.concurrent_qps = concurrent_throughput(
            candidate.search, probes.genuine, config.throughput_concurrency, config.throughput_requests)
    return measured


def replaces(kept: IndexCandidate, rival: IndexCandidate, probes: Probes, config: IndexConfig) -> bool:
    """Whether ``rival`` serves at least ``rival_margin`` times the queries per second of ``kept`` under
    load, the two measured in alternation (this machine's drift falls on both alike)."""
    kept_qps, rival_qps = paired_concurrent_throughput([kept.search, rival.search], probes.genuine,
                                                       config.throughput_concurrency,
                                                       config.throughput_requests)
    log.info("%s against %s, %d requests at once: %.0f against %.0f queries/s (kept when at least %.2fx)",
             rival.kind, kept.kind, config.throughput_concurrency, rival_qps, kept_qps, config.rival_margin)
    return rival_qps >= config.rival_margin * kept_qps


def exact_p99_ms(vectors: Vectors) -> float:
    """The exact scan's single-query p99 over these vectors (the better of ``LATENCY_PASSES`` passes of
    ``EXACT_QUERIES`` queries: the collection's own vectors, as the scan's time does not depend on them)."""
    rng = np.random.default_rng(0)
    queries = np.ascontiguousarray(vectors[rng.choice(len(vectors), size=min(len(vectors), EXACT_QUERIES),
                                                      replace=False)])
    rows = np.arange(len(vectors), dtype=np.int64)
    return min(latency_ms(lambda q: exact_search(q, vectors, rows, K), queries)[1]
               for _ in range(LATENCY_PASSES))


def worth_selecting(vectors: Vectors, config: IndexConfig) -> tuple[bool, float | None]:
    """(whether to measure the candidates, the exact scan's p99 when it was timed for that)."""
    if len(vectors) > config.exact_max:
        return True, None
    if len(vectors) <= config.exact_always or not len(vectors):
        return False, None
    p99 = exact_p99_ms(vectors)
    log.info("exact scan of %d vectors: p99 %.2f ms (target %.1f ms)", len(vectors), p99,
             config.target_p99_ms)
    return p99 > config.target_p99_ms, p99


def select(ids: Ids, vectors: Vectors, identities: Ids | None, threshold: float | None, config: IndexConfig
           ) -> tuple[IndexCandidate | None, list[Measurement], float]:
    """(the chosen candidate or None for exact, every measurement, the exact scan's median in ms)."""
    started = time.perf_counter()
    probes = Probes.of(ids, vectors, identities, config.match_threshold if threshold is None else threshold,
                       config)
    exact_p50 = (latency_ms(lambda q: exact_search(q, vectors, ids, K), probes.genuine[:20])[0]
                 if config.latency_check else float("inf"))
    measurements: list[Measurement] = []
    kept: IndexCandidate | None = None  # the candidate to keep among those within target_p99_ms
    fastest: tuple[float, IndexCandidate] | None = None  # (p99, candidate): accurate, beats exact, not within
    remaining: int | None = None  # candidates still to try once one is within the target
    for kind in config.candidates:
        if remaining is not None:
            if remaining == 0:
                break
            remaining -= 1
        spent = time.perf_counter() - started
        if spent >= config.selection_budget_s and (kept is not None or fastest is not None):
            log.warning("index selection: %.0f s spent (budget %.0f s), keeping the best candidate so far "
                        "without trying %s", spent, config.selection_budget_s,
                        ", ".join(config.candidates[config.candidates.index(kind):]))
            break
        began = time.perf_counter()
        candidate = make_candidate(kind, ids, vectors, config)
        measured = tune(candidate, probes, config)
        measured.build_s = time.perf_counter() - began
        measurements.append(measured)
        timing = ("-" if measured.p99_ms is None else f"{measured.p50_ms:.2f}/{measured.p99_ms:.2f} ms, "
                                                      f"{measured.concurrent_qps or 0:.0f} q/s under load")
        log.info("%s over %d vectors: recall@10 %.4f (lower bound %.4f), decision agreement %.4f genuine / "
                 "%.4f impostor at effort %d; p50/p99 %s (exact p50 %.2f ms)", kind, len(ids),
                 measured.recall, measured.recall_bound, measured.genuine_agreement,
                 measured.impostor_agreement, measured.effort, timing, exact_p50)
        if not measured.accurate:
            continue
        if not config.latency_check:
            kept = candidate
            break
        if measured.p50_ms is None or measured.p99_ms is None or measured.p50_ms >= exact_p50:
            continue  # kept only when its median beats the exact scan's (medians: robust to noise)
        if measured.p99_ms <= config.target_p99_ms:
            if kept is None or replaces(kept, candidate, probes, config):
                kept = candidate  # the one kept stays in memory, the others go now
            remaining = config.rivals if remaining is None else remaining
        elif fastest is None or measured.p99_ms < fastest[0]:
            fastest = (measured.p99_ms, candidate)
    chosen = kept if kept is not None else (None if fastest is None else fastest[1])
    if chosen is None:
        log.warning("staying exact: no candidate of %s met the targets and beat the exact scan (%.2f ms)",
                    ", ".join(config.candidates), exact_p50)
    return chosen, measurements, exact_p50
