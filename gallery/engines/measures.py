"""Probes and measures for comparing an index with exact search (``selection.py`` and the bench).

Genuine probes are like a new photo of an enrolled face; impostor probes like someone not enrolled,
drawn from the collection's own distribution. Recall@10 and the decision agreement (the same identity
at or above the threshold, or the same *unknown*) are each given with a lower bound of two standard
errors, so that a measurement on a few hundred probes is not taken for more than it shows.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import faiss
import numpy as np
from numpy.typing import NDArray

from gallery.engines.batching import Search, SearchBatcher
from gallery.engines.threads import threads_for

Ids = NDArray[np.int64]
Vectors = NDArray[np.float32]
K = 10
#: Exact top-1 scores closer than this count as tied (float32 inner products).
TIE = 1e-6


# --- probes ------------------------------------------------------------------------------------


def genuine_probes(vectors: Vectors, count: int, similarity: float = 0.75, seed: int = 0) -> Vectors:
    """Queries like a new photo of an enrolled person: each at ~``similarity`` cosine to a stored vector."""
    rng = np.random.default_rng(seed)
    picked = vectors[rng.choice(len(vectors), size=min(count, len(vectors)), replace=False)]
    noise = rng.standard_normal(picked.shape).astype(np.float32)
    noise -= (noise * picked).sum(axis=1, keepdims=True) * picked  # orthogonal to the source
    noise /= np.linalg.norm(noise, axis=1, keepdims=True)
    probes = similarity * picked + math.sqrt(1 - similarity**2) * noise
    return np.ascontiguousarray(probes / np.linalg.norm(probes, axis=1, keepdims=True), dtype=np.float32)


def impostor_probes(vectors: Vectors, count: int, seed: int = 0) -> Vectors:
    """Queries like someone not enrolled: drawn from a Gaussian fitted to the collection (its mean and
    per-dimension spread, so real embeddings' common direction is kept), L2-normalized."""
    rng = np.random.default_rng(seed + 7919)
    sample = vectors[rng.choice(len(vectors), size=min(len(vectors), 20_000), replace=False)]
    mean, spread = sample.mean(axis=0), sample.std(axis=0) + 1e-6
    probes = mean + spread * rng.standard_normal((count, vectors.shape[1])).astype(np.float32)
    return np.ascontiguousarray(probes / np.linalg.norm(probes, axis=1, keepdims=True), dtype=np.float32)


# --- measures ----------------------------------------------------------------------------------


def recall_at_k(approximate: Ids, exact: Ids) -> float:
    """Mean fraction of the exact top-k ids that the approximate search also returned."""
    hits = sum(len(set(a[a >= 0]) & set(e[e >= 0])) for a, e in zip(approximate, exact, strict=True))
    total = sum(int((e >= 0).sum()) for e in exact)
    return hits / total if total else 1.0


def recall_lower_bound(recall: float, queries: int, k: int = K) -> float:
    """Recall measured on ``queries`` probes minus two standard errors (binomial over queries x k).

    The search effort stops at the first step that reaches the target, which flatters the figure it
    stopped on; requiring the lower bound to reach it leaves a margin for new queries (a margin, not a
    guarantee: see the held-out recall in docs/benchmarks/gallery.md).
    """
    return recall - 2 * math.sqrt(max(recall * (1 - recall), 0.0) / (queries * k))


def proportion_lower_bound(share: float, trials: int) -> float:
    """A share measured on ``trials`` probes minus two standard errors (binomial)."""
    return share - 2 * math.sqrt(max(share * (1 - share), 0.0) / max(trials, 1))


def decisions(scores: Vectors, ids: Ids, identity_of: Callable[[Ids], Ids], threshold: float) -> Ids:
    """Per query: the identity of the best face when it reaches ``threshold``, else -1 (unknown)."""
    best = identity_of(np.maximum(ids[:, 0], 0))
    return np.where((ids[:, 0] >= 0) & (scores[:, 0] >= threshold), best, -1)


def decision_agreement(approximate: tuple[Vectors, Ids], exact: tuple[Vectors, Ids],
                       identity_of: Callable[[Ids], Ids], threshold: float) -> float:
    """Fraction of queries decided alike: same identity above the threshold, or both unknown. A tie for
    the exact first place (another face at the same score) counts as agreement."""
    mine = decisions(*approximate, identity_of, threshold)
    truth = decisions(*exact, identity_of, threshold)
    tied = np.abs(approximate[0][:, 0] - exact[0][:, 0]) <= TIE
    return float(((mine == truth) | tied).mean()) if len(mine) else 1.0


def exact_search(queries: Vectors, vectors: Vectors, ids: Ids, k: int) -> tuple[Vectors, Ids]:
    """Top-k by exact inner product, on as many OpenMP threads as the exact index would search with (a lone
    query on one: the exact scan is timed as it is served)."""
    with threads_for(len(queries), len(queries) * vectors.size):
        scores, rows = faiss.knn(np.ascontiguousarray(queries), np.ascontiguousarray(vectors),
                                 min(k, len(vectors)), metric=faiss.METRIC_INNER_PRODUCT)
    return scores.astype(np.float32), np.where(rows >= 0, ids[np.maximum(rows, 0)], -1)


def latency_ms(search: Callable[[Vectors], Any], queries: Vectors) -> tuple[float, float]:
    """p50 and p99 of one query per call (after 3 warm-up calls)."""
    for query in queries[:3]:
        search(query[None])
    times = []
    for query in queries:
        began = time.perf_counter()
        search(query[None])
        times.append((time.perf_counter() - began) * 1000)
    p50, p99 = np.percentile(times, [50, 99])
    return float(p50), float(p99)


def concurrent_throughput(search: Search, queries: Vectors, concurrency: int, requests: int) -> float:
    """Queries per second of ``requests`` one-query requests (top ``K``) sent by ``concurrency`` threads
    at once through the request batcher, as a gateway under load sends them (``gallery.engines.batching``)."""
    batcher = SearchBatcher()

    def one(number: int) -> None:
        batcher.search("measure", queries[number % len(queries)][None], K, search)

    with ThreadPoolExecutor(concurrency) as pool:
        began = time.perf_counter()
        list(pool.map(one, range(requests)))
        return requests / max(time.perf_counter() - began, 1e-9)


def paired_concurrent_throughput(searches: Sequence[Search], queries: Vectors, concurrency: int,
                                 requests: int, rounds: int = 3) -> list[float]:
    """``concurrent_throughput`` of several searches measured in alternation (the order reversed every
    round, so a drifting machine slows them alike): the median of ``rounds`` runs of each, after one
    short warm-up run of each."""
    rates: list[list[float]] = [[] for _ in searches]
    for number in range(rounds + 1):
        for which in list(range(len(searches)))[:: 1 if number % 2 == 0 else -1]:
            rate = concurrent_throughput(searches[which], queries, concurrency,
                                         requests if number else concurrency)
            if number:
                rates[which].append(rate)
    return [float(np.median(r)) for r in rates]
