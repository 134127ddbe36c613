"""Embedding vectors at the edge: validation, normalization and byte encoding."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike, NDArray

from gallery.errors import InvalidEmbedding


def validate_embeddings(vectors: Sequence[ArrayLike] | ArrayLike, dimension: int) -> NDArray[np.float32]:
    """[N, D] float32, finite, non-zero, L2-normalized; InvalidEmbedding names the problem."""
    try:
        matrix = np.asarray(vectors, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        # A ragged batch (one vector of another length) fails here: name the offending row.
        for row, vector in enumerate(vectors if isinstance(vectors, Sequence) else ()):
            shape = list(np.shape(vector))
            if shape != [dimension]:
                raise InvalidEmbedding(f"embedding {row} must have dimension {dimension}, got shape {shape}",
                                       expected=dimension, row=row, shape=shape) from exc
        raise InvalidEmbedding(f"embeddings are not numeric vectors: {exc}") from exc
    if matrix.ndim == 1:
        matrix = matrix[None, :]
    if matrix.ndim != 2 or matrix.shape[1] != dimension:
        raise InvalidEmbedding(f"embeddings must have dimension {dimension}, got shape {list(matrix.shape)}",
                               expected=dimension, shape=list(matrix.shape))
    if not np.isfinite(matrix).all():
        raise InvalidEmbedding("embeddings contain NaN or infinite values")
    norms = np.linalg.norm(matrix, axis=1)
    if (norms < 1e-6).any():
        raise InvalidEmbedding("an embedding is the zero vector", rows=np.flatnonzero(norms < 1e-6).tolist())
    return np.ascontiguousarray(matrix / norms[:, None], dtype=np.float32)


def row_scores(rows: NDArray[np.float32], vector: NDArray[np.float32]) -> NDArray[np.float32]:
    """The inner product of every row of ``rows`` [n, d] with ``vector`` [d] (cosine similarities for
    L2-normalized embeddings), by numpy's own loops: ``rows @ vector`` hands a product of about 9,000
    numbers or more (18 faces at 512-d) to numpy's OpenBLAS threads, which then spin long after it, a core
    taken from the gallery's searches and the pipeline on the same machine."""
    scores: NDArray[np.float32] = np.einsum("fd,d->f", rows, vector)
    return scores


def encode_vector(vector: NDArray[np.float32]) -> bytes:
    return np.asarray(vector, dtype="<f4").tobytes()


def decode_vector(blob: bytes, dimension: int) -> NDArray[np.float32]:
    vector = np.frombuffer(blob, dtype="<f4")
    if vector.size != dimension:
        raise InvalidEmbedding(f"stored embedding has {vector.size} values, expected {dimension}")
    return vector.astype(np.float32)
