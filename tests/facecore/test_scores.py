"""facecore.scores: impostor tails, thresholds for a false-positive identification rate at a gallery size,
and the confidence, checked on synthetic scores whose true distribution is known.

A stranger's best score against ``n`` independent impostor comparisons has the distribution ``F(t)^n``; it
is drawn exactly as ``F^-1(U^(1/n))``, so the observed FPIR of a threshold can be measured at a million
comparisons without scoring a million faces per stranger."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from facecore.scores import (
    GRID,
    GenuineScores,
    ScoreTail,
    comparisons_tail,
    expected_fpir,
    match_probabilities,
    stranger_below,
    threshold_for,
)

MEAN, SD = 0.108, 0.093  # SFace impostors on held-out faces (issue 40's measurement)
STRANGERS = 40_000


def strangers_best(distribution: stats.rv_continuous, n: int, count: int, seed: int) -> np.ndarray:
    """The best score of each of ``count`` strangers against ``n`` independent impostor comparisons."""
    u = np.random.default_rng(seed).random(count)
    return distribution.ppf(np.exp(np.log(u) / n))


def binomial_interval(k: int, n: int, z: float = 3.3) -> tuple[float, float]:
    """A Wilson interval (3.3 standard errors: a test that must not flake)."""
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


@pytest.fixture(scope="module")
def normal() -> stats.rv_continuous:
    return stats.norm(MEAN, SD)


@pytest.fixture(scope="module")
def measured(normal: stats.rv_continuous) -> ScoreTail:
    """A tail measured on a million impostor pairs (a collection of ~1,400 identities' own pairs)."""
    return ScoreTail.from_scores(normal.rvs(size=1_000_000, random_state=np.random.default_rng(3)))


def test_quantiles_match_the_distribution_where_measured(normal: stats.rv_continuous,
                                                         measured: ScoreTail) -> None:
    assert measured.measured_to == pytest.approx(1e-5, rel=0.5)
    for q in (0.1, 1e-2, 1e-3, 1e-4):
        assert measured.score_at(q) == pytest.approx(normal.isf(q), abs=0.004)
    for score in (0.2, 0.35, 0.45):
        assert measured.survival(score) == pytest.approx(normal.sf(score), rel=0.06)


def test_the_tail_goes_on_along_the_measured_spread(normal: stats.rv_continuous, measured: ScoreTail) -> None:
    """Beyond the last measured point the tail is extrapolated on a normal scale with the tail's own
    slope: for a normal sample it stays within a few thousandths down to 1e-9."""
    assert measured.slope == pytest.approx(SD, rel=0.05)
    for q in (1e-6, 1e-8, 1e-9):
        assert measured.score_at(q) == pytest.approx(normal.isf(q), abs=0.01)


@pytest.mark.parametrize("n", [100, 10_000, 1_000_000])
@pytest.mark.parametrize("fpir", [0.01, 0.001])
def test_the_observed_fpir_stays_at_the_target_whatever_the_gallery_size(
        normal: stats.rv_continuous, measured: ScoreTail, n: int, fpir: float) -> None:
    threshold = threshold_for(measured, fpir, n)
    best = strangers_best(normal, n, STRANGERS, seed=n)
    matched = int((best >= threshold).sum())
    low, high = binomial_interval(matched, STRANGERS)
    # the extrapolated tail may be off by a little in score: allow the FPIR of +-0.004 around the threshold
    slack_low = -math.expm1(n * math.log1p(-normal.sf(threshold + 0.004)))
    slack_high = -math.expm1(n * math.log1p(-normal.sf(threshold - 0.004)))
    assert low <= slack_high and high >= slack_low, (n, fpir, threshold, matched)
    assert expected_fpir(measured, threshold, n) == pytest.approx(fpir, rel=1e-6)


def test_thresholds_rise_with_the_gallery(measured: ScoreTail) -> None:
    thresholds = [threshold_for(measured, 0.01, n) for n in (1, 100, 10_000, 1_000_000, 100_000_000)]
    assert thresholds == sorted(thresholds) and len(set(thresholds)) == len(thresholds)
    # a fixed 1:1 threshold lets most strangers match somebody in a large gallery
    assert expected_fpir(measured, 0.363, 1000) > 0.9
    assert comparisons_tail(0.01, 1_000_000) == pytest.approx(1e-8, rel=0.01)


def test_a_heavier_tail_is_measured_as_heavier() -> None:
    """Look-alikes make real impostor tails heavier than a normal fit of the bulk: a mixture's tail gets a
    steeper line, so its thresholds are higher than the bulk's normal would give."""
    rng = np.random.default_rng(5)
    bulk = rng.normal(MEAN, SD, 500_000)
    alike = rng.normal(0.3, 0.1, 5_000)  # 1 % of pairs between look-alikes
    tail = ScoreTail.from_scores(np.concatenate([bulk, alike]))
    bulk_only = ScoreTail.from_scores(bulk)
    assert tail.slope > 1.1 * bulk_only.slope
    assert threshold_for(tail, 0.01, 10_000) > threshold_for(bulk_only, 0.01, 10_000) + 0.03


def test_a_histogram_gives_the_tail_of_its_scores(normal: stats.rv_continuous) -> None:
    scores = normal.rvs(size=400_000, random_state=np.random.default_rng(9))
    edges = np.arange(-1.0, 1.0005, 0.001)
    counts, _ = np.histogram(scores, bins=edges)
    from_bins, exact = ScoreTail.from_histogram(counts, edges), ScoreTail.from_scores(scores)
    for q in (0.1, 1e-3, 1e-5, 1e-8):
        assert from_bins.score_at(q) == pytest.approx(exact.score_at(q), abs=0.002)
    assert from_bins.pairs == 400_000


def test_strangers_stay_below_a_threshold_as_often_as_its_fpir_says(measured: ScoreTail) -> None:
    n = 5_000
    threshold = threshold_for(measured, 0.01, n)
    assert stranger_below(measured, threshold, n) == pytest.approx(0.99, abs=1e-9)


@pytest.mark.parametrize("n", [1, 100, 10_000])
def test_the_match_probability_is_what_simulated_searches_show(normal: stats.rv_continuous,
                                                               measured: ScoreTail, n: int) -> None:
    """Probes enrolled or not, half and half: a genuine probe's own face scores from the genuine
    distribution, every other comparison from the impostor one; the best candidate is its own identity
    when that beats them all. Among best candidates in a score bin, the share that are the probe's own
    identity is what ``match_probabilities`` says there (within sampling error), and it only rises."""
    genuine = GenuineScores(0.72, 0.12, 1000)
    curve = match_probabilities(measured, genuine, n)
    assert np.all(np.diff(curve) >= 0) and curve[0] == 0.0 and curve[-1] > 0.999
    rng = np.random.default_rng(n)
    count = 200_000
    impostor = strangers_best(normal, n, count, seed=n + 1)
    own = rng.normal(genuine.mean, genuine.sd, count)
    enrolled = rng.random(count) < 0.5
    best = np.where(enrolled, np.maximum(own, impostor), impostor)
    right = enrolled & (own >= impostor)
    for low in np.arange(0.2, 0.8, 0.05):
        chosen = (best >= low) & (best < low + 0.05)
        if chosen.sum() < 2_000:
            continue
        observed = right[chosen].mean()
        predicted = np.interp(best[chosen], GRID, curve).mean()
        assert abs(observed - predicted) < 0.05, (n, low, observed, predicted)


def test_a_tail_round_trips_and_refuses_what_is_not_one(measured: ScoreTail) -> None:
    again = ScoreTail.from_dict(measured.to_dict())
    assert again.score_at(1e-7) == pytest.approx(measured.score_at(1e-7), abs=1e-4)
    with pytest.raises(ValueError):
        ScoreTail.from_dict({"points": [[0.0, 0.1]]})
    with pytest.raises(ValueError):
        ScoreTail(((1.0, 0.3), (0.5, 0.2)), 0.1, 10)  # points must rise together
    with pytest.raises(ValueError):
        ScoreTail.from_scores(np.zeros(5))
    with pytest.raises(ValueError):
        threshold_for(measured, 0.0, 10)


def test_genuine_scores_say_what_a_threshold_rejects() -> None:
    genuine = GenuineScores.from_scores(np.random.default_rng(2).normal(0.75, 0.1, 20_000))
    assert genuine.rejected(0.75) == pytest.approx(0.5, abs=0.01)
    assert genuine.rejected(0.55) == pytest.approx(stats.norm.cdf(-2), abs=0.01)
