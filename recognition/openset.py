"""Open-set 1:N on labelled embeddings, NIST's protocol (``python -m recognition evaluate``).

Every identity is in turn a stranger, never enrolled; the gallery holds others (their first images in
file-name order), the rest of their images are genuine probes. The false-positive identification rate
(FPIR) is the share of a stranger's searches whose best score reaches the threshold; the false-negative
identification rate (FNIR) the share of genuine probes whose true identity is not the rank-1 candidate at or
above it. The threshold is the model's fixed one, or the one the product derives for a target FPIR
(``gallery.calibration.decide``) from the gallery's own cross-identity scores: the gallery only, so a
stranger's images never calibrate the threshold it is tested against.

An identity's score is its best enrolled face's (``best``, what the product does), or the mean of its two
best (``top2``, one face: that face's), to measure how much several enrolled faces inflate the stranger's
chances against each way of counting comparisons.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np
from numpy.typing import NDArray

from facecore.scores import ScoreTail
from gallery.calibration import BIN, FIXED, FPIR, MIN_PAIRS, Decision, cross_identity_tail, decide
from gallery.store.store import CollectionInfo
from recognition.metrics import Ints, empirical_threshold, wilson

BEST, TOP2 = "best", "top2"
FACES, IDENTITIES = "faces", "identities"
#: Scores held at once while scoring every image against every identity's faces (float32: ~100 MB).
SCORE_BLOCK = 25_000_000
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def enrolled_mask(identities: Ints, per_identity: int) -> NDArray[np.bool_]:
    """The first ``per_identity`` images of each identity (in the order given: file names)."""
    return _positions(identities) < per_identity


def _positions(owners: Ints) -> Ints:
    """Each element's place among its owner's, in the order given."""
    order = np.argsort(owners, kind="stable")
    grouped = owners[order]
    positions = np.empty(owners.size, np.int64)
    positions[order] = np.arange(owners.size) - np.searchsorted(grouped, grouped)
    return positions


class Searches:
    """Every image scored against every identity's enrolled faces, fused per identity, and each image's two
    best identities (a gallery without one identity ranks the second where the first is left out)."""

    def __init__(self, vectors: NDArray[np.float32], identities: Ints, count: int,
                 enrolled: NDArray[np.bool_]) -> None:
        self.identities, self.count, self.enrolled = identities, count, enrolled
        self.faces = np.bincount(identities[enrolled], minlength=count)
        self.vectors = vectors
        self.fused = self._score(vectors, identities[enrolled], vectors[enrolled])
        self.ranked = {fusion: _two_best(scores) for fusion, scores in self.fused.items()}
        self.histogram = CrossHistogram(identities[enrolled], vectors[enrolled])

    @property
    def fusions(self) -> tuple[str, ...]:
        return tuple(self.fused)

    def _score(self, vectors: NDArray[np.float32], owners: Ints, faces: NDArray[np.float32]
               ) -> dict[str, NDArray[np.float32]]:
        width = int(self.faces.max())
        slots = np.full((self.count, width), -1, dtype=np.int64)  # each identity's faces, padded
        slots[owners, _positions(owners)] = np.arange(owners.size)
        padded = np.where((slots >= 0)[..., None], faces[np.maximum(slots, 0)], np.float32(0))
        padded = padded.reshape(-1, faces.shape[1])
        best = np.empty((vectors.shape[0], self.count), np.float32)
        second = np.empty_like(best) if width > 1 else None
        rows = max(1, SCORE_BLOCK // max(padded.shape[0], 1))
        for start in range(0, vectors.shape[0], rows):
            scores = (vectors[start:start + rows] @ padded.T).reshape(-1, self.count, width)
            scores[:, slots < 0] = -np.inf
            if second is None:
                best[start:start + rows] = scores[..., 0]
                continue
            top = -np.partition(-scores, 1, axis=2)[..., :2]
            best[start:start + rows] = top[..., 0]
            # one enrolled face: the identity's score is that face's
            second[start:start + rows] = np.where(np.isfinite(top[..., 1]), top[..., 1], top[..., 0])
        if second is None:
            return {BEST: best}
        return {BEST: best, TOP2: (best + second) / 2}


def _two_best(scores: NDArray[np.float32]) -> tuple[Ints, NDArray[np.float32], Ints, NDArray[np.float32]]:
    """Each row's best and second-best column, and their scores."""
    two = np.argpartition(-scores, 1, axis=1)[:, :2]
    values = np.take_along_axis(scores, two, axis=1)
    order = np.argsort(-values, axis=1, kind="stable")
    two, values = np.take_along_axis(two, order, axis=1), np.take_along_axis(values, order, axis=1)
    return two[:, 0], values[:, 0], two[:, 1], values[:, 1]


def _bins(scores: NDArray[np.float32], bins: int) -> Ints:
    # gallery.calibration.cross_identity_tail's bins, so that both measure the same histogram
    return np.clip(((scores + 1.0) / BIN).astype(np.int64), 0, bins - 1)


class CrossHistogram:
    """The histogram of cross-identity scores of every enrolled face, from which one identity's pairs are
    taken away: the tail of every leave-one-out gallery without scoring it again (``cross_identity_tail``
    would score each of them: hours for thousands of identities)."""

    def __init__(self, owners: Ints, faces: NDArray[np.float32]) -> None:
        self.owners, self.faces = owners, faces
        self.edges = np.arange(-1.0, 1.0 + BIN / 2, BIN)
        self.total = np.zeros(self.edges.size - 1, dtype=np.int64)
        rows = max(1, SCORE_BLOCK // max(len(owners), 1))
        for start in range(0, len(owners), rows):
            block = np.arange(start, min(start + rows, len(owners)))
            other = owners[block][:, None] != owners[None, :]
            other &= np.arange(len(owners))[None, :] > block[:, None]  # each pair once
            self.total += np.bincount(_bins(faces[block] @ faces.T, self.total.size)[other],
                                      minlength=self.total.size)

    def without(self, identity: int | None) -> Ints:
        if identity is None:
            return self.total
        mine = self.owners == identity
        scores = self.faces[mine] @ self.faces[~mine].T
        return self.total - np.bincount(_bins(scores, self.total.size).ravel(), minlength=self.total.size)

    def tail(self, identity: int | None) -> ScoreTail | None:
        """The tail of every face but ``identity``'s (None: fewer than ``MIN_PAIRS`` pairs)."""
        counts = self.without(identity)
        return ScoreTail.from_histogram(counts, self.edges) if counts.sum() >= MIN_PAIRS else None


@dataclass(frozen=True)
class Gallery:
    """Identities enrolled (``members``); ``left_out``: every identity but this one."""

    members: NDArray[np.bool_]
    left_out: int | None = None


def galleries(count: int, size: int, draws: int, rng: np.random.Generator) -> list[Gallery]:
    """Every leave-one-out gallery at the full size (``count - 1``), else ``draws`` random ones."""
    if size >= count - 1:
        return [Gallery(np.arange(count) != s, s) for s in range(count)]
    drawn = []
    for _ in range(draws):
        members = np.zeros(count, dtype=bool)
        members[rng.choice(count, size, replace=False)] = True
        drawn.append(Gallery(members))
    return drawn


@dataclass(frozen=True)
class View:
    """One gallery's searches: strangers' best scores; genuine probes' rank-1 identity and score."""

    stranger_rows: Ints
    stranger_ranked: Ints
    stranger_scores: NDArray[np.float64]  # float64: a threshold just above a float32 score stays above it
    genuine_rows: Ints
    genuine_ranked: Ints
    genuine_scores: NDArray[np.float64]

    def errors(self, identities: Ints, threshold: float) -> tuple[int, int]:
        """Strangers matched to somebody; genuine probes not matched to themselves."""
        found = (self.genuine_ranked == identities[self.genuine_rows]) & (self.genuine_scores >= threshold)
        return int((self.stranger_scores >= threshold).sum()), int((~found).sum())


def view(searches: Searches, gallery: Gallery, fusion: str) -> View:
    """The searches of ``gallery``: every image of an identity left out, and every image of a member that is
    not enrolled, ranked by the ``fusion``'s identity scores."""
    identities = searches.identities
    strangers = np.flatnonzero(~gallery.members[identities])
    genuine = np.flatnonzero(gallery.members[identities] & ~searches.enrolled)
    ranked, scores = [], []
    for rows in (strangers, genuine):
        if gallery.left_out is not None:
            first, best, second, runner_up = (part[rows] for part in searches.ranked[fusion])
            out = first == gallery.left_out
            ranked.append(np.where(out, second, first))
            scores.append(np.where(out, runner_up, best).astype(np.float64))
        else:
            columns = np.flatnonzero(gallery.members)
            sub = searches.fused[fusion][np.ix_(rows, columns)]
            chosen = np.argmax(sub, axis=1) if columns.size else np.zeros(rows.size, np.int64)
            ranked.append(columns[chosen])
            scores.append(sub[np.arange(rows.size), chosen].astype(np.float64))
    return View(strangers, ranked[0], scores[0], genuine, ranked[1], scores[1])


@dataclass(frozen=True)
class Calibration:
    """A gallery's own cross-identity tail (None: fewer than ``MIN_PAIRS`` pairs) and what it holds."""

    tail: ScoreTail | None
    faces: int
    identities: int


def calibrate(searches: Searches, gallery: Gallery) -> Calibration:
    faces, identities = int(searches.faces[gallery.members].sum()), int(gallery.members.sum())
    if gallery.left_out is not None:
        return Calibration(searches.histogram.tail(gallery.left_out), faces, identities)
    mine = gallery.members[searches.identities] & searches.enrolled
    tail = cross_identity_tail(searches.identities[mine], searches.vectors[mine])
    return Calibration(tail, faces, identities)


@dataclass(frozen=True)
class Rule:
    """How a gallery decides: the identity score and the threshold: ``fixed``, or the product's for a
    target ``fpir`` counting ``count`` (faces or identities) as the comparisons a stranger gets."""

    name: str
    fusion: str = BEST
    fixed: float | None = None
    fpir: float | None = None
    count: str = FACES


def decision(rule: Rule, calibration: Calibration, match_threshold: float, reference: dict[str, Any]
             ) -> Decision:
    """``gallery.calibration.decide`` for a collection holding this gallery's faces."""
    own = None if calibration.tail is None else {"impostor": calibration.tail.to_dict()}
    threshold = match_threshold if rule.fixed is None else rule.fixed
    info = CollectionInfo(0, "evaluation", "", 0, threshold, False, _EPOCH, FPIR if rule.fpir else FIXED,
                          rule.fpir, own)
    return decide(info, calibration.faces if rule.count == FACES else calibration.identities, reference)


@dataclass(frozen=True)
class Rate:
    """``errors`` of ``searches`` pooled over galleries; ``distinct`` images searched. Random draws search
    the same images again, so the Wilson interval counts each image once."""

    errors: int
    searches: int
    distinct: int

    @property
    def value(self) -> float | None:
        return self.errors / self.searches if self.searches else None

    @property
    def interval(self) -> tuple[float, float] | None:
        return wilson(self.errors / self.searches * self.distinct, self.distinct) if self.searches else None


@dataclass
class Outcome:
    """One rule at one gallery size, over every gallery of that size."""

    rule: Rule
    thresholds: list[float] = field(default_factory=list)
    expected: list[float] = field(default_factory=list)
    bases: Counter[str] = field(default_factory=Counter)
    counts: list[int] = field(default_factory=lambda: [0, 0, 0, 0])  # stranger errors, searches; genuine
    distinct: tuple[int, int] = (0, 0)  # stranger, genuine images searched

    def add(self, made: Decision, current: View, identities: Ints) -> None:
        self.thresholds.append(made.threshold)
        if made.expected_fpir is not None:
            self.expected.append(made.expected_fpir)
        self.bases[made.basis] += 1
        strangers, genuine = current.errors(identities, made.threshold)
        searched = (strangers, current.stranger_rows.size, genuine, current.genuine_rows.size)
        self.counts = [have + more for have, more in zip(self.counts, searched, strict=True)]

    @property
    def fpir(self) -> Rate:
        return Rate(self.counts[0], self.counts[1], self.distinct[0])

    @property
    def fnir(self) -> Rate:
        return Rate(self.counts[2], self.counts[3], self.distinct[1])


@dataclass(frozen=True)
class SizeResult:
    size: int
    galleries: int
    faces: tuple[int, int]  # enrolled faces, least and most
    outcomes: tuple[Outcome, ...]


def empirical_rules(searches: Searches, chosen: Sequence[Gallery], targets: Sequence[float]) -> list[Rule]:
    """(c) Per fusion and target, the fixed threshold that these very strangers' best scores need (none
    where the target allows less than one of the distinct stranger images)."""
    strangers = int((~np.all([g.members for g in chosen], axis=0))[searches.identities].sum())
    rules = []
    for fusion in searches.fusions:
        pooled = np.concatenate([view(searches, g, fusion).stranger_scores for g in chosen])
        for target in targets:
            threshold = empirical_threshold(pooled, target) if target * strangers >= 1 else None
            if threshold is not None:
                suffix = "" if fusion == BEST else f", {fusion}"
                rules.append(Rule(f"empirical {target:g}{suffix}", fusion, fixed=threshold))
    return rules


def evaluate_size(searches: Searches, size: int, draws: int, rules: Sequence[Rule], targets: Sequence[float],
                  match_threshold: float, reference: dict[str, Any], seed: int) -> SizeResult:
    """Every rule, and the empirical threshold of each target on these strangers, at one gallery size."""
    chosen = galleries(searches.count, size, draws, np.random.default_rng(seed))
    outcomes = [Outcome(rule) for rule in [*rules, *empirical_rules(searches, chosen, targets)]]
    seen = np.zeros((2, searches.identities.size), dtype=bool)
    faces = []
    for gallery in chosen:
        calibration = calibrate(searches, gallery)
        faces.append(calibration.faces)
        views = {fusion: view(searches, gallery, fusion) for fusion in searches.fusions}
        seen[0, views[BEST].stranger_rows] = seen[1, views[BEST].genuine_rows] = True
        for outcome in outcomes:
            made = decision(outcome.rule, calibration, match_threshold, reference)
            outcome.add(made, views[outcome.rule.fusion], searches.identities)
    for outcome in outcomes:
        outcome.distinct = (int(seen[0].sum()), int(seen[1].sum()))
    return SizeResult(min(size, searches.count - 1), len(chosen), (min(faces), max(faces)), tuple(outcomes))


@dataclass(frozen=True)
class Change:
    """A probe decided differently by two rules: the identity it is matched to, or None (unknown)."""

    row: int
    stranger: bool
    candidate: int
    score: float
    decisions: tuple[int | None, int | None]
    thresholds: tuple[float, float]


def decision_changes(searches: Searches, rules: tuple[Rule, Rule], match_threshold: float,
                     reference: dict[str, Any]) -> tuple[int, list[Change]]:
    """Each probe once at the full size: a stranger's images against every other identity, a genuine probe
    against every identity. The number of probes, and those whose decision differs between ``rules``."""
    plans = [(Gallery(np.arange(searches.count) != s, s), True) for s in range(searches.count)]
    plans.append((Gallery(np.ones(searches.count, dtype=bool)), False))
    probes, changes = 0, []
    for gallery, strangers in plans:
        calibration = calibrate(searches, gallery)
        thresholds = [decision(rule, calibration, match_threshold, reference).threshold for rule in rules]
        seen = view(searches, gallery, BEST)
        rows, ranked, scores = ((seen.stranger_rows, seen.stranger_ranked, seen.stranger_scores) if strangers
                                else (seen.genuine_rows, seen.genuine_ranked, seen.genuine_scores))
        probes += rows.size
        for row, candidate, score in zip(rows.tolist(), ranked.tolist(), scores.tolist(), strict=True):
            made = tuple(candidate if score >= t else None for t in thresholds)
            if made[0] != made[1]:
                changes.append(Change(row, strangers, candidate, score, (made[0], made[1]),
                                      (thresholds[0], thresholds[1])))
    return probes, changes

