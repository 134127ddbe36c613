"""recognition.metrics and recognition.openset, the statistics of ``python -m recognition evaluate`` (1:1
and open-set 1:N), on synthetic embeddings whose answers are known: orthogonal identities score 0 against
each other, and one impostor pair is planted."""

from __future__ import annotations

import numpy as np
import pytest

from facecore.scores import ScoreTail
from gallery.calibration import cross_identity_tail
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
from recognition.openset import (
    BEST,
    IDENTITIES,
    TOP2,
    Calibration,
    CrossHistogram,
    Rule,
    Searches,
    decision,
    decision_changes,
    enrolled_mask,
    evaluate_size,
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


# --- 1:N ----------------------------------------------------------------------------------------------


def test_enrolled_are_the_first_images_of_each_identity() -> None:
    identities = np.array([1, 0, 1, 0, 1, 2])
    assert enrolled_mask(identities, 1).tolist() == [True, True, False, False, False, True]
    assert enrolled_mask(identities, 2).tolist() == [True, True, True, True, False, True]


def test_open_set_counts_the_planted_stranger_once_and_no_other() -> None:
    vectors, identities = planted()
    searches = Searches(vectors, identities, K, enrolled_mask(identities, 1))
    rules = [Rule("fixed", fixed=FIXED), Rule("fpir 0.01", fpir=0.01)]
    result = evaluate_size(searches, K - 1, 1, rules, (0.01, 0.02), FIXED, {}, seed=0)
    assert (result.size, result.galleries, result.faces) == (K - 1, K, (K - 1, K - 1))
    by_name = {o.rule.name: o for o in result.outcomes}
    for name in ("fixed", "fpir 0.01", "empirical 0.02"):
        outcome = by_name[name]
        # every image searched once as a stranger; identity 0's second image finds the last identity at 0.6
        assert (outcome.fpir.errors, outcome.fpir.searches, outcome.fpir.distinct) == (1, 99, 99)
        # 49 genuine probes, each in the 49 galleries that hold its identity, always found
        assert (outcome.fnir.errors, outcome.fnir.searches, outcome.fnir.distinct) == (0, 49 * 49, 49)
    assert "empirical 0.01" not in by_name  # 0.01 of 99 stranger images: not measurable
    assert 0 < by_name["empirical 0.02"].thresholds[0] < 1e-6
    product = by_name["fpir 0.01"]
    # 49 faces: 1,176 cross-identity pairs, enough for the gallery's own tail (all 0: the floor applies)
    assert product.bases == {"collection": K} and set(product.thresholds) == {FIXED}


def test_orthogonal_identities_match_no_stranger() -> None:
    identities = np.repeat(np.arange(20), 3)
    vectors = np.eye(DIM, dtype=np.float32)[identities]
    searches = Searches(vectors, identities, 20, enrolled_mask(identities, 1))
    for size in (5, 19):
        result = evaluate_size(searches, size, 4, [Rule("fixed", fixed=FIXED)], (), FIXED, {}, seed=size)
        outcome = result.outcomes[0]
        assert outcome.fpir.errors == 0 and outcome.fpir.searches > 0
        assert outcome.fnir.errors == 0 and outcome.fnir.searches > 0
    assert evaluate_size(searches, 5, 4, [], (), FIXED, {}, 5).galleries == 4


def test_a_gallerys_tail_never_holds_the_strangers_faces() -> None:
    rng = np.random.default_rng(4)
    owners = np.repeat(np.arange(30), 3)
    faces = rng.standard_normal((90, 32)).astype(np.float32)
    faces[3:6] = faces[6:9] + 0.05 * rng.standard_normal((3, 32))  # identity 1 looks like identity 2
    faces /= np.linalg.norm(faces, axis=1, keepdims=True)
    histogram = CrossHistogram(owners, faces)
    for left_out in (1, 7):
        mine = owners != left_out
        expected = cross_identity_tail(owners[mine], faces[mine])
        tail = histogram.tail(left_out)
        assert tail is not None and expected is not None and tail.pairs == expected.pairs
        assert np.allclose(tail.points, expected.points, atol=2e-3)
    everyone = histogram.tail(None)
    assert everyone is not None and everyone.points[-1][1] > histogram.tail(1).points[-1][1]


def test_the_product_threshold_counts_faces_and_falls_back_to_the_reference() -> None:
    tail = ScoreTail.from_scores(np.random.default_rng(2).normal(0.1, 0.1, 50_000))
    ref = {"impostor": tail.to_dict(), "genuine": {"mean": 0.7, "sd": 0.1, "pairs": 100}}
    faces = decision(Rule("f", fpir=0.01), Calibration(None, 2000, 1000), FIXED, ref)
    identities = decision(Rule("i", fpir=0.01, count=IDENTITIES), Calibration(None, 2000, 1000), FIXED, ref)
    assert faces.basis == "reference" and faces.threshold > identities.threshold > FIXED
    assert faces.expected_fpir == pytest.approx(0.01, rel=1e-3)
    own = decision(Rule("f", fpir=0.01), Calibration(tail, 2000, 1000), FIXED, {})
    assert own.basis == "collection" and own.threshold == pytest.approx(faces.threshold, abs=1e-3)
    assert decision(Rule("f", fpir=0.01), Calibration(None, 10, 5), FIXED, {}).basis == "fixed"


def test_top2_fusion_is_the_mean_of_an_identitys_two_best_faces() -> None:
    e = np.eye(8, dtype=np.float32)
    half = (e[0] + e[2]) / np.sqrt(2)
    # identity 0: e0 and (e0 + e2) / sqrt 2 enrolled; identity 1: e3; identity 2 (the probe): e2
    vectors = np.stack([e[0], half, e[3], e[2]])
    identities = np.array([0, 0, 1, 2])
    searches = Searches(vectors, identities, 3, enrolled_mask(identities, 2))
    assert searches.fusions == (BEST, TOP2)
    probe = 3
    assert searches.fused[BEST][probe, :2] == pytest.approx([0.70711, 0.0], abs=1e-5)
    assert searches.fused[TOP2][probe, :2] == pytest.approx([0.35355, 0.0], abs=1e-5)  # one face: its own


def test_decision_changes_list_each_probe_that_changes() -> None:
    vectors, identities = planted()
    searches = Searches(vectors, identities, K, enrolled_mask(identities, 1))
    probes, changes = decision_changes(searches, (Rule("a", fixed=FIXED), Rule("b", fixed=0.7)), FIXED, {})
    assert probes == 99 + 49
    (change,) = changes
    assert (change.row, change.stranger, change.candidate) == (1, True, K - 1)
    assert change.decisions == (K - 1, None)
    _, changes = decision_changes(searches, (Rule("a", fixed=FIXED), Rule("b", fixed=0.9)), FIXED, {})
    assert sorted((c.row, c.stranger) for c in changes) == [(1, False), (1, True)]  # 0.8 < 0.9: now unknown

