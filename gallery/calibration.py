"""A collection's match decision: a fixed threshold, or one derived for a false-positive identification
rate (FPIR) at the collection's current size.

Policy ``fpir``: the threshold is the score that at most ``target_fpir`` of strangers reach against *some*
enrolled face (``facecore.scores``). An identity's score is its best face's, so every enrolled face is a
comparison a stranger can win: the calibration counts faces, not identities, and an identity with twenty
faces does not get twenty chances for free. The impostor tail comes from the collection's own
cross-identity scores (each sampled face against every face of the other identities) once it holds
``MIN_PAIRS`` of them, else from the embedding model's reference (measured on labelled faces and shipped
with its description). As the collection grows its threshold rises: at most ``target_fpir`` of strangers
are matched whatever its size, and the share of genuine probes a threshold rejects (from the reference's
genuine scores) says what that costs.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from facecore.scores import (
    GRID,
    GenuineScores,
    ScoreTail,
    expected_fpir,
    match_probabilities,
    reference_genuine,
    reference_tail,
    threshold_for,
)
from gallery.store.store import CollectionInfo

log = logging.getLogger(__name__)

FIXED, FPIR = "fixed", "fpir"
#: A collection's own cross-identity scores replace the model's reference from this many pairs.
MIN_PAIRS = 1_000
#: Pairs sampled at most for a collection's own tail: enough to measure it to 1e-7 and beyond, in seconds.
MAX_PAIRS = 200_000_000
#: Bins of the sampled scores' histogram (cosine from -1 to 1).
BIN = 1e-3
#: A collection's tail is measured again once it holds this many times the faces it was measured at.
REFIT_GROWTH = 1.5
#: Genuine probes rejected beyond this share make a collection's target one it cannot keep usefully.
WEAK = 0.5
#: A target a model keeps usefully only below this many faces is worth a warning from the start.
SMALL = 1_000
#: A fixed threshold that lets more than this share of strangers match somebody is worth a warning.
LOOSE = 0.05
#: The highest confidence given: a probability from a model fitted to measured scores is never a certainty.
MOST_SURE = 0.9999
#: Width of the logistic that stands in for a confidence where there is no score model.
LOGISTIC_WIDTH = 0.05


@dataclass(frozen=True)
class Decision:
    """How a collection decides now: ``threshold`` for ``faces`` enrolled faces; the FPIR expected there
    and the share of genuine probes (one face against one face) the reference says it rejects."""

    policy: str
    threshold: float
    faces: int
    target_fpir: float | None
    expected_fpir: float | None
    genuine_rejected: float | None
    basis: str  # "collection", "reference", or "fixed"
    tail: ScoreTail | None
    genuine: GenuineScores | None
    #: the confidence on ``facecore.scores.GRID`` (None: no score model, the stand-in logistic)
    curve: NDArray[np.float64] | None = field(default=None, compare=False, repr=False)

    @property
    def useful_up_to(self) -> int | None:
        """The most faces at which the target still lets at least half the genuine probes through (the
        threshold rises with the faces; beyond this size it rejects most): None for a fixed threshold or
        without a score model."""
        if self.policy != FPIR or self.tail is None or self.genuine is None or self.target_fpir is None:
            return None
        q = self.tail.survival(self.genuine.mean)  # the genuine median: where half are rejected
        if q <= 0.0:
            return None
        return max(0, int(math.log1p(-self.target_fpir) / math.log1p(-min(q, 1 - 1e-15))))

    @property
    def warning(self) -> str | None:
        """Why the collection cannot keep its promise usefully, when it cannot."""
        if self.policy == FPIR and self.tail is None:
            return ("no impostor score model: the embedding model has no score reference and the "
                    "collection holds too few identities to measure its own; deciding at the model's fixed "
                    "threshold")
        useful = self.useful_up_to
        if useful is not None and self.faces < useful < SMALL:  # said before it happens
            return (f"this model keeps strangers' matches at {_percent(self.target_fpir)} while letting most "
                    f"genuine probes through only up to {useful} faces: beyond, its threshold rejects most")
        if self.policy == FPIR and self.genuine_rejected is not None and self.genuine_rejected > WEAK:
            return (f"at {self.faces} faces the threshold that keeps strangers' matches at "
                    f"{_percent(self.target_fpir)} rejects about {_percent(self.genuine_rejected)} of "
                    "genuine probes: use a stronger embedding model, a smaller collection, or a higher "
                    "target FPIR")
        if self.policy == FIXED and self.expected_fpir is not None and self.expected_fpir > LOOSE:
            return (f"at {self.faces} faces the fixed threshold {self.threshold:g} lets about "
                    f"{_percent(self.expected_fpir)} of strangers match somebody: decide by a target FPIR "
                    "instead (match_policy)")
        return None

    def confidence(self, score: float) -> float:
        """The probability that a best candidate with this score is the probe's own identity and not a
        stranger's best impostor among the collection's faces, for a probe as likely enrolled as not
        (``facecore.scores.match_probabilities``). Monotone in the score, whatever threshold decides.
        Without a score model (an embedding model with no reference, or no genuine scores), a logistic of
        the score around the threshold (0.5 there) that says nothing about error rates."""
        if self.curve is None:
            return 1.0 / (1.0 + math.exp(-(score - self.threshold) / LOGISTIC_WIDTH))
        return min(float(np.interp(score, GRID, self.curve)), MOST_SURE)


def _percent(value: float | None) -> str:
    return "?" if value is None else f"{100 * value:.3g} %"


def own_tail(info: CollectionInfo) -> ScoreTail | None:
    """The collection's own measured tail, when it has one with enough pairs."""
    data = info.calibration or {}
    if "impostor" not in data:
        return None
    tail = ScoreTail.from_dict(data["impostor"])
    return tail if tail.pairs >= MIN_PAIRS else None


def decide(info: CollectionInfo, faces: int, reference: dict[str, Any]) -> Decision:
    """The collection's decision at ``faces`` enrolled faces. ``reference`` is the embedding model's
    ``score_reference`` (``facecore.spec.ModelSpec``); it may be empty."""
    genuine = reference_genuine(reference)
    tail = own_tail(info)
    basis = "collection"
    if tail is None:
        tail, basis = reference_tail(reference), "reference"
    curve = _curve(tail, genuine, faces)
    if info.match_policy != FPIR or info.target_fpir is None:
        fpir = None if tail is None else expected_fpir(tail, info.match_threshold, faces)
        return Decision(FIXED, info.match_threshold, faces, None, fpir,
                        _rejected(genuine, info.match_threshold), "fixed", tail, genuine, curve)
    if tail is None:
        return Decision(FPIR, info.match_threshold, faces, info.target_fpir, None,
                        _rejected(genuine, info.match_threshold), "fixed", None, genuine)
    threshold = max(threshold_for(tail, info.target_fpir, faces), info.match_threshold)
    return Decision(FPIR, threshold, faces, info.target_fpir, expected_fpir(tail, threshold, faces),
                    _rejected(genuine, threshold), basis, tail, genuine, curve)


def _curve(tail: ScoreTail | None, genuine: GenuineScores | None, faces: int) -> NDArray[np.float64] | None:
    return None if tail is None or genuine is None else match_probabilities(tail, genuine, faces)


def one_to_one(threshold: float, reference: dict[str, Any], comparisons: int = 1) -> Decision:
    """A 1:1 decision (verify, compare) at ``threshold``: one comparison, or one per enrolled face of the
    identity verified against."""
    tail = reference_tail(reference)
    fpir = None if tail is None else expected_fpir(tail, threshold, comparisons)
    genuine = reference_genuine(reference)
    return Decision(FIXED, threshold, comparisons, None, fpir, _rejected(genuine, threshold), "fixed", tail,
                    genuine, _curve(tail, genuine, comparisons))


def _rejected(genuine: GenuineScores | None, threshold: float) -> float | None:
    return None if genuine is None else genuine.rejected(threshold)


def cross_identity_tail(identities: NDArray[np.int64], vectors: NDArray[np.float32],
                        max_pairs: int = MAX_PAIRS, seed: int = 0) -> ScoreTail | None:
    """The impostor tail of a collection's own faces: every cross-identity pair when there are at most
    ``max_pairs``, else a sample of faces against a sample of faces, as many of each (about
    sqrt(max_pairs)). Pairs that share a face are alike, so a few faces against every other face would
    measure the far tail from a few hundred faces' look-alikes: a square sample spreads the same pairs
    over a hundred times more faces. None when there are too few pairs."""
    count = len(identities)
    if count < 2:
        return None
    rng = np.random.default_rng(seed)
    every = count * (count - 1) // 2 <= max_pairs
    side = count if every else min(count, math.isqrt(max_pairs))
    rows = np.sort(rng.choice(count, side, replace=False)) if side < count else np.arange(count)
    columns = rows if every else np.sort(rng.choice(count, min(count, max_pairs // side), replace=False))
    edges = np.arange(-1.0, 1.0 + BIN / 2, BIN)
    counts = np.zeros(len(edges) - 1, dtype=np.int64)
    against, owners = vectors[columns], identities[columns]
    block = max(1, 4_000_000 // len(columns))  # rows of scores held at once: tens of MB
    for start in range(0, len(rows), block):
        chosen = rows[start:start + block]
        scores = vectors[chosen] @ against.T
        other = identities[chosen][:, None] != owners[None, :]
        if every:  # every pair twice otherwise: keep each once
            other &= columns[None, :] > chosen[:, None]
        bins = np.clip(((scores[other] + 1.0) / BIN).astype(np.int64), 0, len(counts) - 1)
        counts += np.bincount(bins, minlength=len(counts))
    if counts.sum() < MIN_PAIRS:
        return None
    return ScoreTail.from_histogram(counts, edges)


def measured_calibration(identities: NDArray[np.int64], vectors: NDArray[np.float32],
                         max_pairs: int = MAX_PAIRS) -> dict[str, Any] | None:
    """What a collection stores of its own measurement (``CollectionInfo.calibration``), or None."""
    tail = cross_identity_tail(identities, vectors, max_pairs)
    if tail is None:
        return None
    return {"impostor": tail.to_dict(), "faces": len(identities),
            "identities": int(np.unique(identities).size)}


def refit_due(info: CollectionInfo, faces: int) -> bool:
    """An ``fpir`` collection whose own tail was never measured, or measured at fewer than
    ``faces / REFIT_GROWTH`` faces, and that may now hold enough pairs to measure it."""
    if info.match_policy != FPIR or faces < 2 or faces * (faces - 1) / 2 < MIN_PAIRS:
        return False
    measured = int((info.calibration or {}).get("faces", 0))
    return measured == 0 or faces >= REFIT_GROWTH * measured or faces * REFIT_GROWTH <= measured


def fpir_from_rate(value: float) -> float:
    """A target FPIR as given by a user, checked: in (0, 0.5]."""
    if not (0.0 < value <= 0.5) or math.isnan(value):
        raise ValueError(f"a target false-positive identification rate is in (0, 0.5], got {value}")
    return float(value)
