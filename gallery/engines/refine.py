"""Compressed codes scanned fast, the best candidates re-scored exactly from the stored float32 vectors.

``RefinedIndex`` holds every vector twice: as short codes in a FAISS index (4-bit PQ fast-scan or 8-bit
scalar quantization) that ranks the whole collection cheaply, and as float32 rows that re-score the
``rerank`` best candidates by their exact inner product. Scores returned are therefore exact; only a
true neighbour that the codes rank below ``rerank`` can be missed (what the recall measurement at build
time bounds). FAISS's own ``IndexRefineFlat`` does the same but can neither remove ids nor be shared
across threads, so this class keeps the float32 rows itself: removal zeroes a row at once (an erased
vector does not linger in memory) and removes its codes. The codes are split into ``shards`` FAISS
indexes searched in parallel threads, so one query uses every core (FAISS parallelizes over queries
only).

4-bit fast-scan has several search kernels (FAISS's ``implem``); by default it picks one per index, made
for blocks of queries. ``fast_scan_kernel`` picks per call: for batches, FAISS's choice; for a lone query
with a short re-rank, the index's ``lone_kernel``, FAISS's choice or the kernel that reads the codes once
per query (14), whichever ``pick_lone_kernel`` measured faster on this machine. Which one wins depends on
the CPU: at 128-d the per-query kernel halved a lone query's scan on some CPUs and was slower than FAISS's
choice on others (those FAISS runs with its AVX512_SPR build); at 512-d the two were close. Both rank by
the same codes. With a deep top-k (k > 20) FAISS's choice is faster everywhere measured.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import faiss
import numpy as np
from numpy.typing import NDArray

log = logging.getLogger(__name__)

Ids = NDArray[np.int64]
Vectors = NDArray[np.float32]


def _pq4(dimension: int, subquantizers: int) -> Any:
    subquantizers = max(1, min(subquantizers, dimension))
    while dimension % subquantizers:
        subquantizers -= 1
    return faiss.IndexPQFastScan(dimension, subquantizers, 4, faiss.METRIC_INNER_PRODUCT)


def pq4_fast_scan(dimension: int) -> Any:
    """4-bit PQ fast-scan codes, 64 sub-quantizers (32 bytes per face) from 128-d up: one per 2
    dimensions at 128-d, per 8 at 512-d. Measured at 1M x 128 (face-like data, SFace's threshold): with
    one per 4 dimensions, even a re-rank deeper than the selection tries fell short of the impostor
    agreement target; with one per 2, a moderate re-rank reaches it."""
    return _pq4(dimension, min(64, dimension // 2))


def pq4_fast_scan_fine(dimension: int) -> Any:
    """Twice the sub-quantizers of ``pq4_fast_scan`` (one per dimension at 128-d: 64 bytes per face): a
    scan twice as long, codes accurate enough for a short re-rank. Measured at 1M x 128 (face-like data,
    SFace's threshold): tens of candidates agree with exact search on every genuine and impostor probe
    where ``pq4_fast_scan`` needs thousands, and under load (many one-query requests at once through the
    request batcher) it served more queries per second in side-by-side runs (the coarse codes' deep
    re-rank does not batch). At 512-d both need the shallowest re-rank and the coarse codes are simply
    cheaper."""
    return _pq4(dimension, min(128, dimension))


def sq8(dimension: int) -> Any:
    return faiss.IndexScalarQuantizer(dimension, faiss.ScalarQuantizer.QT_8bit, faiss.METRIC_INNER_PRODUCT)


#: Floats of candidate vectors gathered at once by a re-rank (16 MiB).
RERANK_FLOATS = 1 << 22


#: FAISS's per-query fast-scan kernel (codes read once per query, a heap per query) and FAISS's own choice.
PER_QUERY_KERNEL, FAISS_CHOICE = 14, 0
#: The deepest per-shard top-k for which a lone query may use ``PER_QUERY_KERNEL``.
PER_QUERY_MAX_K = 20


def fast_scan_kernel(index: Any, batched: bool, k: int, lone: int = PER_QUERY_KERNEL) -> None:
    """Set a 4-bit fast-scan index's search kernel for one call: ``lone`` for a lone query with
    k <= ``PER_QUERY_MAX_K``, else FAISS's own choice (for these indexes 12, or 13 above k = 20: codes read
    once per block of queries). Nothing for other indexes."""
    if getattr(index, "bbs", None) != 32 or not hasattr(index, "implem"):
        return
    # a call racing another on the same shard may run with the other's kernel: slower, same codes ranked
    index.implem = lone if not batched and k <= PER_QUERY_MAX_K else FAISS_CHOICE


CODES: dict[str, Callable[[int], Any]] = {"pq4fs": pq4_fast_scan, "pq4fs-fine": pq4_fast_scan_fine,
                                          "sq8": sq8}


class RefinedIndex:
    """FAISS-like ``add_with_ids`` / ``remove_ids`` / ``search`` over (codes, exact re-rank)."""

    def __init__(self, dimension: int, shards: list[Any], rerank: int) -> None:
        self.d = dimension
        self.rerank = rerank
        self._shards = shards  # trained FAISS indexes; labels are positions within each shard
        self._shard_rows = [np.zeros(0, np.int64) for _ in shards]  # position -> row of the store
        self._vectors = np.zeros((0, dimension), np.float32)  # rows; erased rows are zeroed
        self._row_ids = np.zeros(0, np.int64)  # row -> face id (-1: erased)
        self._used = 0
        self.lone_kernel = PER_QUERY_KERNEL  # a lone query's fast-scan kernel (``pick_lone_kernel``)
        # one OpenMP thread per pool thread: the shards are the parallelism there
        self._pool = (ThreadPoolExecutor(len(shards), initializer=faiss.omp_set_num_threads, initargs=(1,))
                      if len(shards) > 1 else None)

    @classmethod
    def train(cls, codes: str, dimension: int, sample: Vectors, shards: int, rerank: int) -> RefinedIndex:
        first = CODES[codes](dimension)
        first.train(np.ascontiguousarray(sample, dtype=np.float32))
        return cls(dimension, [first] + [faiss.clone_index(first) for _ in range(shards - 1)], rerank)

    @property
    def ntotal(self) -> int:
        return sum(len(rows) for rows in self._shard_rows)

    # --- changes -----------------------------------------------------------------------------

    def _grow(self, extra: int) -> None:
        """Room for ``extra`` more rows: the arrays are enlarged in place where numpy can (``realloc``, which
        moves a large block's pages without copying them), else copied. Copied, the old vectors and a 1.25x
        larger copy were held at once: a large index took about its own size again in memory, and a pause
        under the collection's lock, to take one face; in place, a small fraction of both: the new rows
        alone, resident at once as numpy zeroes them (hence steps of an eighth, not a quarter)."""
        needed = self._used + extra
        if needed <= len(self._vectors):
            return
        capacity = max(needed, len(self._vectors) + len(self._vectors) // 8 + 1024)
        # resize refuses (ValueError) while anything else refers to the array, e.g. a view a snapshot writes:
        # so called on the attribute itself (any other reference held here would make it refuse)
        try:
            self._vectors.resize((capacity, self.d))  # the new rows zero
        except ValueError:
            vectors = np.zeros((capacity, self.d), np.float32)
            vectors[: self._used] = self._vectors[: self._used]
            self._vectors = vectors
        try:
            self._row_ids.resize(capacity)
        except ValueError:
            self._row_ids = np.concatenate([self._row_ids, np.zeros(capacity - len(self._row_ids), np.int64)])
        self._row_ids[self._used :] = -1

    def add_with_ids(self, vectors: Vectors, ids: Ids) -> None:
        matrix = np.ascontiguousarray(vectors, dtype=np.float32)
        ids = np.asarray(ids, dtype=np.int64)
        self._grow(len(matrix))
        rows = np.arange(self._used, self._used + len(matrix), dtype=np.int64)
        self._vectors[rows] = matrix
        self._row_ids[rows] = ids
        self._used += len(matrix)
        # spread over the shards: each takes an equal slice (the smallest takes the remainder)
        order = np.argsort([len(r) for r in self._shard_rows], kind="stable")
        for number, part in zip(order.tolist(), np.array_split(np.arange(len(matrix)), len(self._shards)),
                                strict=True):
            if len(part):
                self._shards[number].add(matrix[part])
                self._shard_rows[number] = np.concatenate([self._shard_rows[number], rows[part]])

    def remove_ids(self, ids: Ids) -> int:
        rows = np.flatnonzero(np.isin(self._row_ids[: self._used], np.asarray(ids, dtype=np.int64)))
        if not len(rows):
            return 0
        self._vectors[rows] = 0.0  # the erased vector leaves memory now, not at the next rebuild
        self._row_ids[rows] = -1
        for number, shard_rows in enumerate(self._shard_rows):
            dead = np.isin(shard_rows, rows)
            if dead.any():  # removal keeps the order of the remaining positions (checked by the tests)
                self._shards[number].remove_ids(faiss.IDSelectorBatch(np.flatnonzero(dead).astype(np.int64)))
                self._shard_rows[number] = shard_rows[~dead]
        return len(rows)

    # --- search ------------------------------------------------------------------------------

    def _candidates(self, queries: Vectors, depth: int) -> NDArray[np.int64]:
        """Rows of the ``depth`` best codes of every shard, [nq, shards * depth] (-1 where none)."""

        # one query (or a few): the shards in parallel threads, each scanning per query; a batch: one
        # shard after the other, each spread over the cores by FAISS itself (OpenMP over blocks of
        # queries), so the two never oversubscribe them
        pool = self._pool if len(queries) < 2 * len(self._shards) else None

        def one(number: int) -> NDArray[np.int64]:
            rows = self._shard_rows[number]
            if not len(rows):
                return np.full((len(queries), 0), -1, np.int64)
            shard, k = self._shards[number], min(depth, len(rows))
            fast_scan_kernel(shard, batched=pool is None, k=k, lone=self.lone_kernel)
            _, positions = shard.search(queries, k)
            return np.where(positions >= 0, rows[np.maximum(positions, 0)], -1)

        numbers = range(len(self._shards))
        parts = list(pool.map(one, numbers)) if pool is not None else [one(n) for n in numbers]
        return np.concatenate(parts, axis=1)

    def _depth(self, k: int) -> int:
        """Candidates taken from each shard for a top-``k`` search: ``rerank`` in all, split over the
        shards; each still gives k (the true top-k may all be in one shard)."""
        return max(k, -(-self.rerank // len(self._shards)))

    def pick_lone_kernel(self, queries: Vectors, k: int = 10, rounds: int = 5, calls: int = 8,
                         label: str = "index") -> dict[int, float]:
        """Time a lone top-``k`` query's scan with FAISS's choice and with the per-query kernel, ``rounds``
        alternating rounds of ``calls`` lone queries each (a drifting machine slows both alike), and keep
        the one with the lower median as ``lone_kernel``. Returns {kernel: median ms}; empty (nothing
        measured, the kernel unchanged) where the choice cannot matter: codes that are not 4-bit
        fast-scan, a per-shard depth above ``PER_QUERY_MAX_K``, an empty index or no queries. Any
        queries do: a fast-scan costs the same whatever the query. The outcome is logged under
        ``label``."""
        queries = np.ascontiguousarray(queries, dtype=np.float32).reshape(-1, self.d)
        depth = self._depth(k)
        if (not len(queries) or not self.ntotal or depth > PER_QUERY_MAX_K
                or getattr(self._shards[0], "bbs", None) != 32):
            return {}
        kept = self.lone_kernel
        times: dict[int, list[float]] = {PER_QUERY_KERNEL: [], FAISS_CHOICE: []}
        try:
            for number in range(rounds + 1):  # the first round warms both kernels up, not counted
                for kernel in (list(times) if number % 2 else list(times)[::-1]):
                    self.lone_kernel = kernel
                    for call in range(calls):
                        query = queries[(number * calls + call) % len(queries)][None]
                        began = time.perf_counter()
                        self._candidates(query, depth)
                        if number:
                            times[kernel].append(time.perf_counter() - began)
        finally:
            self.lone_kernel = kept
        medians = {kernel: statistics.median(spent) * 1000 for kernel, spent in times.items()}
        self.lone_kernel = min(medians, key=lambda kernel: (medians[kernel], kernel != kept))
        timings = " against ".join(f"{ms:.2f} (kernel {kernel})" for kernel, ms in medians.items())
        log.info("%s: a lone query's scan over %d codes took %s ms at the median; kernel %d kept", label,
                 self.ntotal, timings, self.lone_kernel)
        return medians

    def sample_vectors(self, count: int) -> Vectors:
        """Up to ``count`` stored vectors, spread over the index (erased rows left out)."""
        rows = np.flatnonzero(self._row_ids[: self._used] >= 0)
        picked = rows[np.linspace(0, len(rows) - 1, num=min(count, len(rows))).astype(np.int64)]
        sample: Vectors = self._vectors[picked]
        return sample

    def search(self, queries: Vectors, k: int) -> tuple[Vectors, Ids]:
        queries = np.ascontiguousarray(queries, dtype=np.float32).reshape(-1, self.d)
        rows = self._candidates(queries, self._depth(k))
        scores = np.empty(rows.shape, np.float32)
        # the candidates' vectors gathered for a few queries at a time: [queries, candidates, d] floats
        # for all 2500 probes of a build at a 2048-deep re-rank were 2.6 GB
        step = max(1, RERANK_FLOATS // max(1, rows.shape[1] * self.d))
        for start in range(0, len(queries), step):
            part = slice(start, start + step)
            gathered = self._vectors[np.maximum(rows[part], 0)]  # [step, candidates, d]
            # numpy's own loops, not BLAS: numpy's OpenBLAS splits a product of about 9,000 numbers per query
            # or more (20 candidates at 512-d) over its threads, which then spin long after it, taking the
            # cores from the next scans (lone queries right after a batch took about twice as long)
            scores[part] = np.einsum("qcd,qd->qc", gathered, queries[part])
        scores = np.where(rows >= 0, scores, -np.inf).astype(np.float32)
        if scores.shape[1] > k:  # the k best (ties at the k-th place: any of them), then ordered
            keep = np.argpartition(-scores, k - 1, axis=1)[:, :k]
            scores, rows = np.take_along_axis(scores, keep, 1), np.take_along_axis(rows, keep, 1)
        ids = np.where(rows >= 0, self._row_ids[np.maximum(rows, 0)], -1)
        order = np.lexsort((ids, -scores), axis=1)  # best score first; equal scores by id
        return np.take_along_axis(scores, order, 1), np.take_along_axis(ids, order, 1)

    # --- persistence -------------------------------------------------------------------------

    def write(self, handle: Any) -> None:
        """Write the index to an open binary file (an ``.npz``), streamed: numpy writes each array in
        chunks of 16 MiB, so a snapshot needs no second copy of the index in memory (written through bytes,
        the peak resident memory grew by more than the snapshot's size; streamed, by a small fraction)."""
        arrays: dict[str, Any] = {"vectors": self._vectors[: self._used],
                                  "row_ids": self._row_ids[: self._used], "rerank": np.array([self.rerank])}
        for number, shard in enumerate(self._shards):
            arrays[f"codes{number}"] = faiss.serialize_index(shard)
            arrays[f"rows{number}"] = self._shard_rows[number]
        np.savez(handle, **arrays)

    @classmethod
    def from_file(cls, handle: Any) -> RefinedIndex:
        """The index ``write`` wrote. Each array is read once and kept as read (``np.load`` reads a member
        again at every access; reading the vectors twice and copying them, a load peaked at about twice
        what the index keeps)."""
        with np.load(handle, allow_pickle=False) as data:
            count = sum(1 for name in data.files if name.startswith("codes"))
            shards = [faiss.deserialize_index(data[f"codes{n}"]) for n in range(count)]
            vectors = np.asarray(data["vectors"], np.float32)
            index = cls(int(vectors.shape[1]), shards, int(data["rerank"][0]))
            index._vectors = vectors
            index._row_ids = np.asarray(data["row_ids"], np.int64)
            index._shard_rows = [np.asarray(data[f"rows{n}"], np.int64) for n in range(count)]
        index._used = len(index._vectors)
        return index

    def live_ids(self) -> Ids:
        ids = self._row_ids[: self._used]
        return ids[ids >= 0]
