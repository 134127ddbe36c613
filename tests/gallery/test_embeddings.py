"""``gallery.embeddings.row_scores``: the scores of many faces against one, without waking numpy's BLAS
threads (which spin for about 0.1 s after a product they share)."""

from __future__ import annotations

import time

import numpy as np

from gallery.embeddings import row_scores
from tests.gallery.helpers import unit_vectors


def test_row_scores_are_the_inner_products() -> None:
    rng = np.random.default_rng(4)
    rows, vector = unit_vectors(rng, 64, 512), unit_vectors(rng, 1, 512)[0]
    scores = row_scores(rows, vector)
    assert scores.dtype == np.float32 and scores.shape == (64,)
    np.testing.assert_allclose(scores, rows.astype(np.float64) @ vector.astype(np.float64), atol=1e-5)
    assert row_scores(rows[:0], vector).shape == (0,)


def test_row_scores_leave_no_thread_spinning_after_them() -> None:
    """64 faces x 512-d through ``rows @ vector``: numpy's OpenBLAS split it over its threads, which then
    used a core's worth of CPU (about 0.1 s) while the process slept."""
    rng = np.random.default_rng(5)
    rows, vector = unit_vectors(rng, 64, 512), unit_vectors(rng, 1, 512)[0]
    spent = []
    for _ in range(3):
        row_scores(rows, vector)
        began = time.process_time()
        time.sleep(0.1)
        spent.append(time.process_time() - began)
    assert min(spent) < 0.05, spent
