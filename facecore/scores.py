"""Score distributions: what a cosine score means for strangers (impostors) and for the same person.

A 1:N search compares a stranger with every enrolled face and keeps the best, so the chance that some
impostor score reaches a threshold ``t`` grows with the gallery: with ``n`` comparisons whose impostor
scores exceed ``t`` with probability ``q = S(t)`` each, the false-positive identification rate is

    FPIR(t, n) = 1 - (1 - q)^n

(NIST's FRVT 1:N reports FNIR at a fixed FPIR for a gallery size for this reason). Holding FPIR at a
target ``f`` needs ``q = 1 - (1 - f)^(1/n)``: about ``f / n``, far out in the tail.

``ScoreTail`` is that tail, ``S(t) = P(impostor score >= t)``, stored as points on a normal
quantile scale: ``(z, score)`` with ``S = P(Z >= z)`` for a standard normal ``Z``. Between points it
is linear in ``z``; beyond the last point measured with enough scores behind it, it goes on along the
straight line fitted to the measured upper tail (a normal tail whose spread is the measured tail's,
not the bulk's: a heavier tail gives a steeper line). Points come from a sample of impostor scores:
the model's reference, measured at export, or a collection's own cross-identity scores.

``GenuineScores`` is the same person's score distribution (a normal fit), for the share of genuine
probes a threshold rejects.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.special import ndtr, ndtri

#: A quantile of a sample is trusted when at least this many scores lie beyond it.
TAIL_SUPPORT = 10
#: Tail probabilities at which a sample's quantiles are kept: 10^(-k/8), from 0.5 down.
STEPS_PER_DECADE = 8
#: The measured points whose ``S`` is at most this fit the line the tail goes on along.
TAIL_FIT_FROM = 0.05
#: Fewer tail points than this: the line is fitted to every point from the median.
MIN_TAIL_POINTS = 3


def _z(q: float) -> float:
    """The standard normal quantile with ``P(Z >= z) = q``."""
    return float(-ndtri(q))


def _survival(z: float) -> float:
    return float(ndtr(-z))


@dataclass(frozen=True)
class ScoreTail:
    """``S(t) = P(impostor score >= t)``: ``points`` are ``(z, score)``, ``z`` ascending, measured;
    ``slope`` is score per unit of ``z`` beyond the last point; ``pairs`` the scores measured."""

    points: tuple[tuple[float, float], ...]
    slope: float
    pairs: int

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("a score tail needs at least one point")
        zs = [z for z, _ in self.points]
        scores = [s for _, s in self.points]
        if zs != sorted(zs) or scores != sorted(scores) or self.slope <= 0:
            raise ValueError("score tail points must rise together and the slope must be positive")

    @classmethod
    def from_scores(cls, scores: ArrayLike, weight: float = 1.0) -> ScoreTail:
        """The tail of a sample of impostor scores (each counting ``weight`` pairs)."""
        values = np.sort(np.asarray(scores, dtype=np.float64).ravel())
        if values.size < 2 * TAIL_SUPPORT:
            raise ValueError(f"a score tail needs at least {2 * TAIL_SUPPORT} scores, got {values.size}")
        qs = _grid(TAIL_SUPPORT / values.size)
        quantiles = np.quantile(values, 1.0 - qs, method="linear")
        return cls._fitted(qs, quantiles, round(values.size * weight))

    @classmethod
    def from_histogram(cls, counts: NDArray[np.int64], edges: NDArray[np.float64]) -> ScoreTail:
        """The tail of scores counted in bins (``counts[i]`` scores in ``[edges[i], edges[i + 1])``)."""
        total = int(counts.sum())
        if total < 2 * TAIL_SUPPORT:
            raise ValueError(f"a score tail needs at least {2 * TAIL_SUPPORT} scores, got {total}")
        # P(score >= edges[i]) at every edge, falling; the quantile of q interpolates between two edges
        above = np.concatenate([np.cumsum(counts[::-1])[::-1], [0]]) / total
        qs = _grid(TAIL_SUPPORT / total)
        quantiles = np.interp(-qs, -above, edges)
        return cls._fitted(qs, quantiles, total)

    @classmethod
    def _fitted(cls, qs: NDArray[np.float64], quantiles: NDArray[np.float64], pairs: int) -> ScoreTail:
        zs = -ndtri(qs)
        scores = np.maximum.accumulate(quantiles)  # ties in a small sample: never falling
        tail = qs <= TAIL_FIT_FROM
        if tail.sum() < MIN_TAIL_POINTS:
            tail = np.ones_like(tail)
        slope = float(np.polyfit(zs[tail], scores[tail], 1)[0]) if tail.sum() >= 2 else 0.0
        # a line fitted to few points can come out flat or falling: never thinner than the whole sample's
        whole = float(np.polyfit(zs, scores, 1)[0]) if zs.size >= 2 else 0.0
        slope = max(slope, whole, 1e-3)
        return cls(tuple((float(z), float(s)) for z, s in zip(zs, scores, strict=True)), slope, pairs)

    def score_at(self, q: float) -> float:
        """The score that impostors reach with probability ``q``."""
        if not 0.0 < q < 1.0:
            raise ValueError(f"a tail probability is in (0, 1), got {q}")
        z = _z(q)
        zs, scores = self._arrays()
        if z <= zs[-1]:
            if z < zs[0]:
                return float(scores[0] + self._head_slope() * (z - zs[0]))
            return float(np.interp(z, zs, scores))
        return float(scores[-1] + self.slope * (z - zs[-1]))

    def survival(self, score: float) -> float:
        """``P(impostor score >= score)``."""
        zs, scores = self._arrays()
        if score > scores[-1]:
            z = zs[-1] + (score - scores[-1]) / self.slope
        elif score < scores[0]:
            z = zs[0] + (score - scores[0]) / self._head_slope()
        else:
            z = float(np.interp(score, scores, zs)) if scores[-1] > scores[0] else zs[-1]
        return _survival(z)

    def survivals(self, scores: NDArray[np.float64]) -> NDArray[np.float64]:
        """``survival`` of many scores at once."""
        zs, points = self._arrays()
        z = np.interp(scores, points, zs) if points[-1] > points[0] else np.full(scores.shape, zs[-1])
        z = np.where(scores > points[-1], zs[-1] + (scores - points[-1]) / self.slope, z)
        z = np.where(scores < points[0], zs[0] + (scores - points[0]) / self._head_slope(), z)
        survived: NDArray[np.float64] = ndtr(-z)
        return survived

    def _head_slope(self) -> float:
        zs, scores = self._arrays()
        if zs.size >= 2 and zs[1] > zs[0] and scores[1] > scores[0]:
            return float((scores[1] - scores[0]) / (zs[1] - zs[0]))
        return self.slope

    def _arrays(self) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        points = np.asarray(self.points, dtype=np.float64).reshape(-1, 2)
        return points[:, 0], points[:, 1]

    @property
    def measured_to(self) -> float:
        """The smallest tail probability measured (beyond it the tail is extrapolated)."""
        return _survival(self.points[-1][0])

    def to_dict(self) -> dict[str, Any]:
        return {"points": [[round(z, 4), round(s, 5)] for z, s in self.points], "slope": round(self.slope, 5),
                "pairs": self.pairs}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ScoreTail:
        try:
            points = tuple((float(z), float(s)) for z, s in data["points"])
            return cls(points, float(data["slope"]), int(data["pairs"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a score tail: {exc}") from exc


def _grid(smallest: float) -> NDArray[np.float64]:
    """Tail probabilities 10^(-k/8) from 0.5 down to ``smallest``: the points kept of a sample."""
    steps = math.floor(-math.log10(smallest) * STEPS_PER_DECADE)
    qs = 10.0 ** (-np.arange(0, steps + 1) / STEPS_PER_DECADE)
    qs = qs[(qs <= 0.5) & (qs >= smallest)]
    return np.asarray(qs if qs.size else [0.5], dtype=np.float64)


@dataclass(frozen=True)
class GenuineScores:
    """The same person's scores as a normal distribution (mean, sd) fitted to ``pairs`` genuine pairs."""

    mean: float
    sd: float
    pairs: int

    @classmethod
    def from_scores(cls, scores: Sequence[float] | NDArray[np.floating[Any]]) -> GenuineScores:
        values = np.asarray(scores, dtype=np.float64)
        if values.size < 2:
            raise ValueError("genuine scores need at least two pairs")
        return cls(float(values.mean()), float(values.std(ddof=1)), int(values.size))

    def rejected(self, threshold: float) -> float:
        """The share of genuine pairs scoring below ``threshold`` (one face against one face)."""
        return float(ndtr((threshold - self.mean) / self.sd))


#: Scores at which a match probability is tabulated (``match_probabilities``).
GRID = np.linspace(-1.0, 1.0, 801)


def match_probabilities(tail: ScoreTail, genuine: GenuineScores, comparisons: int,
                        prior: float = 0.5) -> NDArray[np.float64]:
    """On ``GRID``: the probability that a best candidate scoring there is the probe's own identity, for a
    probe enrolled with probability ``prior``, among ``comparisons`` impostor faces. With ``g`` and ``G``
    the genuine score density and distribution, ``F = 1 - S`` the impostor's, ``h = d/ds F^n`` the best
    impostor's density:

        P = prior g F^n / (prior g F^n + prior h G + (1 - prior) h)

    (the own identity is the best candidate when it beats every impostor; else an impostor is, for an
    enrolled probe as for a stranger). Made non-decreasing in the score, so it never reorders candidates."""
    below = np.clip(1.0 - tail.survivals(GRID), 0.0, 1.0)
    best = np.exp(max(comparisons, 1) * np.log(np.maximum(below, 1e-300)))  # F^n: P(best impostor < s)
    impostor = np.maximum(np.gradient(best, GRID), 0.0)
    z = (GRID - genuine.mean) / genuine.sd
    own = np.exp(-0.5 * z * z) / (genuine.sd * np.sqrt(2 * np.pi))
    right = prior * own * best
    total = right + prior * impostor * ndtr(z) + (1 - prior) * impostor
    posterior = np.divide(right, total, out=np.zeros_like(total), where=total > 1e-300)
    monotone: NDArray[np.float64] = np.minimum.accumulate(posterior[::-1])[::-1]
    return monotone


def comparisons_tail(fpir: float, comparisons: int) -> float:
    """The impostor tail probability per comparison that gives ``fpir`` over ``comparisons``."""
    if not 0.0 < fpir < 1.0:
        raise ValueError(f"a false-positive identification rate is in (0, 1), got {fpir}")
    return -math.expm1(math.log1p(-fpir) / max(comparisons, 1))


def threshold_for(tail: ScoreTail, fpir: float, comparisons: int) -> float:
    """The score a stranger's best match must reach so that at most ``fpir`` of strangers are matched
    to somebody among ``comparisons`` enrolled faces."""
    return tail.score_at(comparisons_tail(fpir, comparisons))


def expected_fpir(tail: ScoreTail, threshold: float, comparisons: int) -> float:
    """The share of strangers whose best score among ``comparisons`` faces reaches ``threshold``."""
    return -math.expm1(max(comparisons, 1) * math.log1p(-min(tail.survival(threshold), 1.0 - 1e-15)))


def stranger_below(tail: ScoreTail, score: float, comparisons: int) -> float:
    """The chance that a stranger's best score among ``comparisons`` faces stays below ``score``:
    ``1 - expected_fpir`` at that score."""
    return 1.0 - expected_fpir(tail, score, comparisons)


def reference_tail(reference: dict[str, Any]) -> ScoreTail | None:
    """The impostor tail of a model description's ``score_reference`` (None when it has none)."""
    return ScoreTail.from_dict(reference["impostor"]) if "impostor" in reference else None


def reference_genuine(reference: dict[str, Any]) -> GenuineScores | None:
    """The genuine score distribution of a model description's ``score_reference`` (None when none)."""
    genuine = reference.get("genuine")
    if genuine is None:
        return None
    try:
        return GenuineScores(float(genuine["mean"]), float(genuine["sd"]), int(genuine["pairs"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a genuine score distribution: {exc}") from exc
