"""recognition.metrics, the 1:1 statistics of ``python -m recognition evaluate``, on synthetic embeddings
whose answers are known: orthogonal identities score 0 against each other, and one impostor pair is
planted."""

from __future__ import annotations

import numpy as np
import pytest

from recognition.metrics import (
    Weighted,
    empirical_threshold,
    genuine_pairs,
    impostor_pairs,
    impostor_total,
    rate_threshold,
    roc,
    wilson,
)

DIM = 64
K = 50  # identities of the planted set
FIXED = 0.363


def planted() -> tuple[np.ndarray, np.ndarray]:
    """``K`` orthogonal identities, two identical images each (genuine score 1, impostor 0), the last with
    one; identity 0's second image leans to the last identity: 0.8 with its own face, 0.6 with the last's,
    the one impostor pair above the fixed threshold."""
    identities = np.repeat(np.arange(K), 2)[:-1]
    vectors = np.eye(DIM, dtype=np.float32)[identities]
    vectors[1] = 0.0
    vectors[1, 0], vectors[1, K - 1] = 0.8, 0.6
    return vectors, identities



# --- 1:1 ----------------------------------------------------------------------------------------------


def test_wilson_interval_known_values() -> None:
    assert wilson(0, 10) == pytest.approx((0.0, 0.27753), abs=1e-5)
    assert wilson(10, 10) == pytest.approx((0.72247, 1.0), abs=1e-5)
    assert wilson(5, 10) == pytest.approx((0.23659, 0.76341), abs=1e-5)
    assert wilson(0, 0) == (0.0, 1.0)


def test_pairs_are_every_genuine_and_impostor_pair_or_a_seeded_sample() -> None:
    vectors, identities = planted()
    genuine = genuine_pairs(vectors, identities)
    impostor, sampled = impostor_pairs(vectors, identities, 10**9, seed=0)
    images = identities.size
    assert len(genuine) == K - 1 and not sampled
    assert len(impostor) == impostor_total(identities) == images * (images - 1) // 2 - len(genuine)
    assert np.all(genuine.first == genuine.second) and np.all(impostor.first != impostor.second)
    assert sorted(genuine.scores.round(6))[:2] == [0.8, 1.0]
    assert int((impostor.scores > 0).sum()) == 1 and impostor.scores.max() == pytest.approx(0.6)
    sample, sampled = impostor_pairs(vectors, identities, 500, seed=3)
    again, _ = impostor_pairs(vectors, identities, 500, seed=3)
    assert sampled and len(sample) == 500 and np.all(sample.first != sample.second)
    assert np.array_equal(sample.left, again.left) and np.array_equal(sample.right, again.right)


def test_rate_threshold_allows_whole_pairs_only() -> None:
    scores = np.arange(100, dtype=np.float64)
    assert (scores >= empirical_threshold(scores, 0.01)).sum() == 1
    assert (scores >= empirical_threshold(scores, 0.025)).sum() == 2
    assert empirical_threshold(scores, 0.005) is None  # below 1 / 100: not measurable
    ties = np.r_[np.ones(3), np.zeros(97)]
    assert (ties >= empirical_threshold(ties, 0.02)).sum() == 0
    descending = scores[::-1].copy()
    # each pair weighs 2: 0.01 of 200 allows one pair
    weighted = rate_threshold(descending, np.cumsum(np.full(100, 2.0)), 0.01)
    assert weighted is not None and (scores >= weighted).sum() == 1


def test_roc_on_orthogonal_identities_with_one_planted_impostor() -> None:
    vectors, identities = planted()
    genuine, (impostor, _) = genuine_pairs(vectors, identities), impostor_pairs(vectors, identities, 10**9, 0)
    result = roc(genuine, impostor, K, (1e-2, 1e-3, 1e-4), FIXED, replicates=200, seed=1)
    assert (result.genuine, result.impostor) == (K - 1, 4802)
    low, mid, unmeasurable = result.points
    for point in (low, mid):  # a few impostors may reach the threshold: those at 0, so it sits just above 0
        assert point.threshold is not None and 0 < point.threshold < 1e-6
        assert point.tar == 1.0 and point.interval == (1.0, 1.0) and point.replicates > 150
    assert unmeasurable.threshold is None and unmeasurable.tar is None and unmeasurable.interval is None
    fixed = result.fixed
    assert (fixed.accepted, fixed.genuine, fixed.false_matches, fixed.impostor) == (K - 1, K - 1, 1, 4802)
    assert fixed.fmr_interval is not None and fixed.fmr_interval[0] == 0.0  # resamples without identity 0
    assert roc(genuine, impostor, K, (1e-2,), FIXED, 200, 1) .fixed == fixed  # seeded


def test_the_bootstrap_weighs_pairs_by_the_identities_drawn() -> None:
    vectors, identities = planted()
    weighted = Weighted(genuine_pairs(vectors, identities), impostor_pairs(vectors, identities, 10**9, 0)[0])
    weight = np.ones(K)
    *_, tar, fmr = weighted.measure(weight, (), FIXED)
    assert (tar, fmr) == (1.0, pytest.approx(1 / 4802))
    weight[0] = 0.0  # identity 0 not drawn: its planted pair is gone
    assert weighted.measure(weight, (), FIXED)[3] == 0.0
    weight[0] = 2.0  # drawn twice: its pairs count twice
    total = 4802 + (2 - 1) * (2 * 97)  # identity 0's two images against the 97 others' images
    assert weighted.measure(weight, (), FIXED)[3] == pytest.approx(2 / total)

