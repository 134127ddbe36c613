"""1:1 statistics of a labelled face evaluation (``python -m recognition evaluate``), pure numpy over
embeddings and identity labels: the genuine and impostor pairs, the threshold that holds a false-match rate
(FMR), the true-accept rate (TAR) there with a bootstrap over identities, and Wilson intervals for shares.

Pairs of one person's images are not independent trials (a bad photo spoils every pair it is in), so the
intervals of the ROC resample *identities* with replacement: a drawn identity brings all its pairs, an
identity drawn twice counts twice. The threshold is found again in every resample, as it would be on
another set of people.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

Z95 = 1.959963984540054
#: Rows of scores computed at once (a block of pairs, or of images against all others).
BLOCK = 1 << 16

Floats = NDArray[np.float64]
Ints = NDArray[np.int64]


def wilson(successes: float, trials: float) -> tuple[float, float]:
    """The Wilson score 95 % interval of a proportion: sound at 0 of n and n of n, where the normal
    approximation gives a zero width."""
    if trials <= 0:
        return 0.0, 1.0
    p = min(max(successes / trials, 0.0), 1.0)
    z2 = Z95 * Z95
    scale = 1.0 + z2 / trials
    centre = (p + z2 / (2 * trials)) / scale
    half = Z95 * math.sqrt(p * (1 - p) / trials + z2 / (4 * trials * trials)) / scale
    # at 0 of n (n of n) the bound is 0 (1) exactly, not a rounding error away from it
    return (0.0 if p == 0 else max(0.0, centre - half)), (1.0 if p == 1 else min(1.0, centre + half))


@dataclass(frozen=True)
class Pairs:
    """Scores of image pairs (``left``, ``right`` image rows) and the identity of each side."""

    scores: Floats
    left: Ints
    right: Ints
    first: Ints
    second: Ints

    def __len__(self) -> int:
        return int(self.scores.size)


def pairs_of(vectors: NDArray[np.float32], identities: Ints, left: Ints, right: Ints) -> Pairs:
    """The cosine scores of the image pairs ``(left[i], right[i])`` of L2-normalized ``vectors``."""
    left, right = np.asarray(left, np.int64), np.asarray(right, np.int64)
    scores = np.empty(left.size, dtype=np.float64)
    for start in range(0, left.size, BLOCK):
        a, b = vectors[left[start:start + BLOCK]], vectors[right[start:start + BLOCK]]
        scores[start:start + BLOCK] = np.einsum("ij,ij->i", a, b)
    return Pairs(scores, left, right, identities[left], identities[right])


def genuine_pairs(vectors: NDArray[np.float32], identities: Ints) -> Pairs:
    """Every pair of two different images of one identity."""
    order = np.argsort(identities, kind="stable")
    bounds = np.flatnonzero(np.diff(identities[order])) + 1
    lefts, rights = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for rows in np.split(order, bounds):
        i, j = np.triu_indices(rows.size, k=1)
        lefts.append(rows[i])
        rights.append(rows[j])
    return pairs_of(vectors, identities, np.concatenate(lefts), np.concatenate(rights))


def impostor_total(identities: Ints) -> int:
    """How many pairs of images of two different identities there are."""
    sizes = np.bincount(identities).astype(np.int64)
    return int((identities.size ** 2 - int((sizes ** 2).sum())) // 2)


def impostor_pairs(vectors: NDArray[np.float32], identities: Ints, cap: int, seed: int
                   ) -> tuple[Pairs, bool]:
    """Every pair of images of two different identities, or, beyond ``cap`` of them, ``cap`` pairs drawn
    at random (with replacement: a repeat among millions changes nothing). True when sampled."""
    if impostor_total(identities) <= cap:
        left, right = np.triu_indices(identities.size, k=1)
        keep = identities[left] != identities[right]
        return pairs_of(vectors, identities, left[keep], right[keep]), False
    rng = np.random.default_rng(seed)
    lefts, rights, have = [], [], 0
    while have < cap:
        left, right = rng.integers(0, identities.size, (2, 2 * (cap - have)))
        keep = identities[left] != identities[right]
        lefts.append(left[keep])
        rights.append(right[keep])
        have += int(keep.sum())
    return pairs_of(vectors, identities, np.concatenate(lefts)[:cap], np.concatenate(rights)[:cap]), True


def rate_threshold(descending: Floats, cumulative: Floats, rate: float) -> float | None:
    """The lowest threshold that at most ``rate`` of the (weighted) scores reach: just above the highest
    score that would be one too many. ``descending`` are the scores, highest first; ``cumulative`` their
    weights' running sum. None when ``rate`` allows less than one whole pair: not measurable."""
    total = float(cumulative[-1]) if cumulative.size else 0.0
    allowed = rate * total
    if allowed < 1.0 or not descending.size:
        return None
    first_too_many = int(np.searchsorted(cumulative, allowed, side="right"))
    if first_too_many >= descending.size:
        return float(descending[-1])
    return float(np.nextafter(descending[first_too_many], np.inf))


def empirical_threshold(scores: Floats, rate: float) -> float | None:
    """The lowest threshold that at most ``rate`` of ``scores`` reach (None: fewer than 1 / ``rate``)."""
    descending = np.sort(np.asarray(scores, np.float64))[::-1]
    return rate_threshold(descending, np.arange(1, descending.size + 1, dtype=np.float64), rate)


class Weighted:
    """Genuine and impostor scores, sorted once, measured under per-identity weights (1 each for the data as
    it is; a bootstrap resample's multiplicities otherwise)."""

    def __init__(self, genuine: Pairs, impostor: Pairs) -> None:
        down = np.argsort(-impostor.scores, kind="stable")
        self.impostor, self.a, self.b = impostor.scores[down], impostor.first[down], impostor.second[down]
        up = np.argsort(genuine.scores, kind="stable")
        self.genuine, self.g = genuine.scores[up], genuine.first[up]

    def measure(self, weight: Floats, fmrs: Sequence[float], fixed: float
                ) -> tuple[list[float | None], list[float | None], float | None, float | None]:
        """Per FMR target: its threshold and the TAR there (None: not measurable); the TAR and FMR at
        ``fixed``."""
        pair_weight = np.cumsum(weight[self.a] * weight[self.b])
        genuine_weight = np.cumsum(weight[self.g])
        if not pair_weight.size or not genuine_weight.size or genuine_weight[-1] <= 0 or pair_weight[-1] <= 0:
            return [None] * len(fmrs), [None] * len(fmrs), None, None

        def accepted(threshold: float) -> float:
            below = int(np.searchsorted(self.genuine, threshold, side="left"))
            return 1.0 - (float(genuine_weight[below - 1]) if below else 0.0) / float(genuine_weight[-1])

        thresholds = [rate_threshold(self.impostor, pair_weight, fmr) for fmr in fmrs]
        tars = [None if t is None else accepted(t) for t in thresholds]
        reached = int(np.searchsorted(-self.impostor, -fixed, side="right"))
        fmr = float(pair_weight[reached - 1]) / float(pair_weight[-1]) if reached else 0.0
        return thresholds, tars, accepted(fixed), fmr


@dataclass(frozen=True)
class Operating:
    """TAR at an FMR target: the threshold on these pairs, and a 95 % interval over ``replicates``
    bootstrap resamples in which the target was measurable."""

    fmr: float
    threshold: float | None
    tar: float | None
    interval: tuple[float, float] | None
    replicates: int


@dataclass(frozen=True)
class AtThreshold:
    """TAR and FMR at a fixed threshold: counts, and bootstrap 95 % intervals."""

    threshold: float
    accepted: int
    genuine: int
    false_matches: int
    impostor: int
    tar_interval: tuple[float, float] | None
    fmr_interval: tuple[float, float] | None


@dataclass(frozen=True)
class Roc:
    genuine: int
    impostor: int
    identities: int
    points: tuple[Operating, ...]
    fixed: AtThreshold
    replicates: int


def _interval(values: list[float]) -> tuple[float, float] | None:
    if not values:
        return None
    low, high = np.percentile(values, [2.5, 97.5])
    return float(low), float(high)


def roc(genuine: Pairs, impostor: Pairs, identities: int, fmrs: Sequence[float], fixed: float,
        replicates: int, seed: int) -> Roc:
    """TAR at each FMR of ``fmrs`` and at ``fixed``, with intervals from ``replicates`` resamples of the
    ``identities`` (seeded)."""
    weighted = Weighted(genuine, impostor)
    thresholds, tars, _, _ = weighted.measure(np.ones(identities), fmrs, fixed)
    rng = np.random.default_rng(seed)
    drawn_tars: list[list[float]] = [[] for _ in fmrs]
    fixed_tar, fixed_fmr = [], []
    for _ in range(replicates):
        weight = np.bincount(rng.integers(0, identities, identities), minlength=identities).astype(np.float64)
        _, resampled, tar, fmr = weighted.measure(weight, fmrs, fixed)
        for bucket, value in zip(drawn_tars, resampled, strict=True):
            if value is not None:
                bucket.append(value)
        if tar is not None and fmr is not None:
            fixed_tar.append(tar)
            fixed_fmr.append(fmr)
    points = tuple(Operating(f, t, tar, _interval(b) if tar is not None else None, len(b))
                   for f, t, tar, b in zip(fmrs, thresholds, tars, drawn_tars, strict=True))
    at = AtThreshold(fixed, int((genuine.scores >= fixed).sum()), len(genuine),
                     int((impostor.scores >= fixed).sum()), len(impostor), _interval(fixed_tar),
                     _interval(fixed_fmr))
    return Roc(len(genuine), len(impostor), identities, points, at, replicates)
