"""Search: the top identities for each query, each by its best face, and the match decision.

An engine returns faces; an identity with many enrolled faces may fill the first answer alone, so the
face search is widened until ``k`` identities are certain. Concurrent searches of one collection that
found the same index share one engine call (``engines/batching.py``); a small search of a FAISS index in
this process is answered on the calling thread instead (``Searcher.inline``: the event loop), when that
costs less than the hop to a worker thread.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from gallery.embeddings import validate_embeddings
from gallery.engines.batching import SearchBatcher
from gallery.replica import CollectionEntry, Replica
from gallery.store.store import CollectionInfo, check_model

#: A search of at most this many multiply-adds (queries x faces x dimension, the exact scan's) is answered
#: by ``Searcher.inline`` on the calling thread: less than the hop to a worker thread costs.
INLINE_WORK = 1 << 20

#: (identity id, score, face id) of one identity's best face
Ranked = tuple[int, float, int]


@dataclass(frozen=True)
class Candidate:
    identity_id: int
    external_id: str
    name: str
    score: float  # cosine similarity of the identity's best face
    face_id: int


@dataclass(frozen=True)
class SearchResult:
    """Top identities for one query; ``match`` is the best one if it reaches the threshold, else None
    (the person is *unknown*)."""

    candidates: list[Candidate]
    threshold: float

    @property
    def match(self) -> Candidate | None:
        best = self.candidates[0] if self.candidates else None
        return best if best is not None and best.score >= self.threshold else None


def depth(k: int) -> int:
    """Faces a first search fetches for ``k`` identities (widened later when too few identities)."""
    return max(4 * k, 32)


class Searcher:
    """Searches over a replica's indexes, labelled from its remembered labels."""

    def __init__(self, replica: Replica, batcher: SearchBatcher) -> None:
        self.replica, self.batcher = replica, batcher

    def search(self, collection: str, queries: ArrayLike, k: int = 5, threshold: float | None = None,
               embedding_model: str | None = None, exclude: AbstractSet[int] = frozenset()
               ) -> list[SearchResult]:
        """Top-k identities (best face each) per query, with the match decision at ``threshold``
        (default: the collection's). With ``embedding_model``, queries of another model are refused.
        Faces whose ids are in ``exclude`` are left out (search by a stored face). Concurrent calls on
        one collection that found the same index are searched together (``batcher``)."""
        if k < 1:
            raise ValueError("k must be >= 1")
        entry = self.replica.entry(collection)
        info = entry.info
        if embedding_model is not None:
            check_model(info, embedding_model)
        matrix = validate_embeddings(queries, info.dimension)
        fetch = depth(k) + len(exclude)
        # batched only with requests that found this entry: the collection's index may have been replaced
        first = self.batcher.search(info.id, matrix, fetch, entry.search)
        best = _ranked(entry, matrix, k, exclude, first)
        return _results(best, self.replica.labels.of(_identities(best)), info, threshold)

    def inline(self, collection: str, queries: ArrayLike, k: int = 5, threshold: float | None = None
               ) -> list[SearchResult] | None:
        """``search`` on the calling thread (the event loop), or None when it cannot answer at once: the
        engine is not in this process, the collection is not loaded here, the search is larger than
        ``INLINE_WORK``, the index is being searched or changed in another thread, or a label is not
        remembered. Then ``search`` (in a worker thread) answers, and remembers the labels."""
        replica = self.replica
        if replica.engine.shared or k < 1:
            return None
        entry = replica.loaded_entry(collection)
        if entry is None:
            return None
        info = entry.info
        matrix = validate_embeddings(queries, info.dimension)
        fetch = depth(k)
        if matrix.shape[0] * max(len(entry.index), fetch) * info.dimension > INLINE_WORK:
            return None
        if not entry.lock.acquire(blocking=False):
            return None
        try:
            if replica.collections.get(info.id) is not entry:
                return None  # replaced while this call looked
            best = _ranked(entry, matrix, k, frozenset(), entry.index.search(matrix, fetch))
        finally:
            entry.lock.release()
        labels = replica.labels.remembered(_identities(best))
        return None if labels is None else _results(best, labels, info, threshold)


def _identities(best: list[list[Ranked]]) -> set[int]:
    return {identity for row in best for identity, _, _ in row}


def _ranked(entry: CollectionEntry, matrix: NDArray[np.float32], k: int, exclude: AbstractSet[int],
            first: tuple[NDArray[Any], ...]) -> list[list[Ranked]]:
    """(identity, score, face) of the best ``k`` identities per query, from a first search's rows."""
    return [_best_identities(entry, query, k, exclude, [a[row:row + 1] for a in first])
            for row, query in enumerate(matrix)]


def _results(best: list[list[Ranked]], labels: dict[int, tuple[str, str]], info: CollectionInfo,
             threshold: float | None) -> list[SearchResult]:
    limit = info.match_threshold if threshold is None else float(threshold)
    return [SearchResult([Candidate(i, *labels[i], score=s, face_id=f) for i, s, f in row if i in labels],
                         limit) for row in best]


def _best_identities(entry: CollectionEntry, query: NDArray[np.float32], k: int, exclude: AbstractSet[int],
                     first: list[NDArray[Any]]) -> list[Ranked]:
    """Exact per-identity aggregation: widen the face search until k identities are certain. The index's
    size is asked only when a search came back full without k identities: on Milvus it is a query of its
    own (``count(*)``), which every identify used to make. Each widening fetches more than the last, at
    least a first search's depth (a first search of an index empty then, filled since, came back with no
    column), so the loop ends by the index's size at the latest."""
    fetch = first[1].shape[1]
    scores, ids, owners = first
    total: int | None = None
    while True:
        best: dict[int, tuple[float, int]] = {}
        for score, face_id, identity in zip(scores[0].tolist(), ids[0].tolist(), owners[0].tolist(),
                                            strict=True):
            if face_id >= 0 and identity >= 0 and identity not in best and face_id not in exclude:
                best[identity] = (score, face_id)
        # fewer than k identities in a full answer (fewer faces than asked for: the index holds no more)
        if len(best) < k and int((ids[0] >= 0).sum()) >= fetch:
            total = len(entry.index) if total is None else total
            if fetch < total:
                fetch = min(total, max(fetch * 4, depth(k) + len(exclude)))
                with entry.lock:
                    scores, ids, owners = entry.index.search(query[None], fetch)
                continue
        ranked = sorted(best.items(), key=lambda item: (-item[1][0], item[0]))[:k]
        return [(identity, score, face) for identity, (score, face) in ranked]
