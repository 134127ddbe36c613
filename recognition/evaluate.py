"""``python -m recognition evaluate``: how the served model decides on a labelled folder (one subfolder per
person, the layout of LFW): 1:1 verification (TAR at FMR), open-set 1:N by gallery size (FPIR and FNIR at
the fixed threshold and at the threshold the product derives for a target FPIR), identity score fusion,
score histograms, decision changes between two configurations, and the model's score reference.

The largest face of every image is embedded through ``face_pipeline`` on Triton (no quality gate: the
evaluation measures the model, not the enrollment rules); the embeddings are kept (``embeddings.npz``) to
evaluate again without Triton. The statistics are ``recognition.metrics`` (1:1) and ``recognition.openset``
(1:N); the report's tables are ``recognition.evaluation_report``'s. docs/calibration.md explains them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray
from tqdm import tqdm

from facecore.client import AsyncPipelineClient, PipelineError
from facecore.scores import GenuineScores, ScoreTail
from facecore.settings import Settings
from gallery.cli import triton_argument
from recognition.enrollment import largest
from recognition.evaluation_report import histograms, identification_json, markdown, reference_toml
from recognition.importer import scan_folder
from recognition.metrics import (
    Ints,
    Pairs,
    genuine_pairs,
    impostor_pairs,
    impostor_total,
    pairs_of,
    roc,
    wilson,
)
from recognition.openset import (
    IDENTITIES,
    TOP2,
    Rule,
    Searches,
    decision_changes,
    enrolled_mask,
    evaluate_size,
)

log = logging.getLogger(__name__)

FMRS = (1e-2, 1e-3, 1e-4)


@dataclass(frozen=True)
class Embedded:
    """The largest face of every image of a labelled folder as the served pipeline embeds it. ``paths`` are
    ``identity/file`` (file-name order within an identity); ``identities`` index ``names``."""

    folder: str
    paths: tuple[str, ...]
    names: tuple[str, ...]
    identities: Ints
    vectors: NDArray[np.float32]
    failed: tuple[tuple[str, str], ...]  # images without a face: path, why
    model: str
    match_threshold: float
    reference: dict[str, Any]

    def save(self, path: Path) -> None:
        model = {"name": self.model, "match_threshold": self.match_threshold,
                 "score_reference": self.reference, "folder": self.folder, "failed": self.failed}
        np.savez_compressed(path, paths=np.array(self.paths, dtype=str),
                            names=np.array(self.names, dtype=str), identities=self.identities,
                            vectors=self.vectors, model=np.array(json.dumps(model)))

    @classmethod
    def load(cls, path: Path) -> Embedded:
        try:
            with np.load(path, allow_pickle=False) as data:
                model = json.loads(str(data["model"]))
                return cls(model["folder"], tuple(data["paths"].tolist()), tuple(data["names"].tolist()),
                           data["identities"].astype(np.int64), data["vectors"].astype(np.float32),
                           tuple((p, w) for p, w in model["failed"]), model["name"],
                           float(model["match_threshold"]), model["score_reference"])
        except (KeyError, ValueError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not the embeddings of `python -m recognition evaluate` ({exc})"
                             ) from exc


async def embed_folder(folder: Path, url: str, timeout_s: float, concurrency: int, quiet: bool) -> Embedded:
    """The largest face of every image under ``folder`` (one subfolder per identity), through Triton."""
    items = scan_folder(folder)
    if len({item.external_id for item in items}) < 2:
        raise ValueError(f"{folder}: fewer than 2 identities (subfolders with images): nothing to tell apart")
    client = AsyncPipelineClient(url, timeout_s)
    slots = asyncio.Semaphore(concurrency)
    try:
        try:
            spec = await client.embedder()
        except PipelineError as exc:
            raise ValueError(f"Triton at {url}: {exc}") from exc
        log.info("embedding %d images through %s at %s", len(items), spec.name, url)

        async def one(path: Path) -> NDArray[np.float32] | str:
            try:
                data = await asyncio.to_thread(path.read_bytes)
                async with slots:
                    faces = await client.infer(data)
            except OSError as exc:
                return f"unreadable: {exc.strerror}"
            except PipelineError as exc:
                if not exc.invalid_input:
                    raise ValueError(f"Triton at {url}: {exc}") from exc
                return f"unreadable: {exc}"
            finally:
                progress.update(1)
            return faces.embeddings[largest(faces)] if len(faces) else "no face"

        with tqdm(total=len(items), unit="image", disable=quiet) as progress:
            results = await asyncio.gather(*(one(item.path) for item in items))
    finally:
        await client.close()
    kept = [(item, r) for item, r in zip(items, results, strict=True) if not isinstance(r, str)]
    names = sorted({item.external_id for item, _ in kept})
    if len(names) < 2:
        raise ValueError(f"{folder}: fewer than 2 identities have an image with a face")
    number = {name: i for i, name in enumerate(names)}
    return Embedded(
        str(folder), tuple(item.path.relative_to(folder).as_posix() for item, _ in kept), tuple(names),
        np.array([number[item.external_id] for item, _ in kept], dtype=np.int64),
        np.array([r for _, r in kept], dtype=np.float32).reshape(len(kept), -1),
        tuple((item.path.relative_to(folder).as_posix(), r) for item, r in zip(items, results, strict=True)
              if isinstance(r, str)),
        spec.name, spec.match_threshold, spec.score_reference)


def read_pairs(path: Path, data: Embedded) -> tuple[Pairs, Pairs, list[str]]:
    """LFW's pairs.txt: ``name n1 n2`` (genuine), ``name1 n1 name2 n2`` (impostor), images
    ``name/name_%04d.jpg``; a first line of counts is skipped. Pairs with an image not embedded are
    skipped (returned)."""
    index = {p: i for i, p in enumerate(data.paths)}
    chosen: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
    skipped = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        fields = line.split()
        if not fields or (number == 1 and len(fields) <= 2 and all(f.isdigit() for f in fields)):
            continue
        if len(fields) not in (3, 4) or not fields[1].isdigit() or not fields[-1].isdigit():
            raise ValueError(f"{path}:{number}: expected 'name n1 n2' or 'name1 n1 name2 n2'")
        second = (fields[0], fields[2]) if len(fields) == 3 else (fields[2], fields[3])
        images = [f"{name}/{name}_{int(n):04d}.jpg" for name, n in ((fields[0], fields[1]), second)]
        if all(image in index for image in images):
            chosen[len(fields) == 3].append((index[images[0]], index[images[1]]))
        else:
            skipped.append(" ".join(fields))
    genuine, impostor = (np.array(chosen[g], dtype=np.int64).reshape(-1, 2) for g in (True, False))
    return (pairs_of(data.vectors, data.identities, genuine[:, 0], genuine[:, 1]),
            pairs_of(data.vectors, data.identities, impostor[:, 0], impostor[:, 1]), skipped)


def verification(data: Embedded, args: argparse.Namespace, genuine: Pairs, impostor: Pairs,
                 sampled: bool) -> dict[str, Any]:
    """Section 1: the ROC on all pairs (or a sample, or the pairs file)."""
    skipped: list[str] = []
    total = impostor_total(data.identities)
    source = f"sampled {len(impostor)} of {total} impostor pairs" if sampled else "all"
    if args.pairs:
        genuine, impostor, skipped = read_pairs(args.pairs, data)
        source = f"pairs file {args.pairs}"
    if not len(genuine) or not len(impostor):
        return {"pairs": source, "genuine": len(genuine), "impostor": len(impostor), "skipped": skipped,
                "points": [], "fixed": None}
    log.info("1:1: %d genuine and %d impostor pairs, %d bootstrap resamples", len(genuine), len(impostor),
             args.bootstrap)
    result = roc(genuine, impostor, len(data.names), FMRS, data.match_threshold, args.bootstrap, args.seed)
    fixed = result.fixed
    return {"pairs": source, "genuine": result.genuine, "impostor": result.impostor, "skipped": skipped,
            "bootstrap": result.replicates,
            "points": [{"fmr": p.fmr, "threshold": p.threshold, "tar": p.tar, "interval": p.interval,
                        "replicates": p.replicates} for p in result.points],
            "fixed": {**vars(fixed), "tar_wilson": wilson(fixed.accepted, fixed.genuine),
                      "fmr_wilson": wilson(fixed.false_matches, fixed.impostor)}}


def _rules(threshold: float, targets: Sequence[float], fusion: bool) -> list[Rule]:
    rules = [Rule(f"fixed {threshold:g}", fixed=threshold)]
    for target in targets:
        rules.append(Rule(f"fpir {target:g}", fpir=target))
        if fusion:
            rules.append(Rule(f"fpir {target:g}, counting identities", fpir=target, count=IDENTITIES))
            rules.append(Rule(f"fpir {target:g}, top2, counting identities", TOP2, fpir=target,
                              count=IDENTITIES))
    return rules


def default_sizes(identities: int) -> list[int]:
    """A few gallery sizes from 10 up, and every other identity (the largest gallery)."""
    return [n for n in (10, 100, 1_000, 10_000, 100_000) if n < identities - 1] + [identities - 1]


def identification(data: Embedded, args: argparse.Namespace, searches: Searches) -> dict[str, Any]:
    """Section 2 and 3: open-set 1:N by gallery size, and the fusions where identities have several faces."""
    fusion = TOP2 in searches.fusions
    full = len(data.names) - 1
    sizes = sorted({min(n, full) for n in args.sizes} if args.sizes else set(default_sizes(len(data.names))))
    results = []
    for size in sizes:
        log.info("1:N at %d identities: %s", size, "each identity in turn a stranger" if size == full
                 else f"{args.draws} random galleries")
        rules = _rules(data.match_threshold, args.fpir, fusion)
        results.append(evaluate_size(searches, size, args.draws, rules, args.fpir, data.match_threshold,
                                     data.reference, args.seed + size))
    why = None if fusion else ("every identity has one enrolled face (use --enroll-per-identity 2 or more "
                               "with identities of 3+ images)")
    return identification_json(results, args.enroll_per_identity, why)


def _config(text: str) -> Rule:
    """``fixed:T`` or ``fpir:F`` for ``--compare``."""
    kind, _, value = text.partition(":")
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected fixed:THRESHOLD or fpir:RATE") from None
    if kind == "fixed" and -1.0 <= number <= 1.0:
        return Rule(text, fixed=number)
    if kind == "fpir" and 0.0 < number <= 0.5:
        return Rule(text, fpir=number)
    raise argparse.ArgumentTypeError(f"{text!r}: expected fixed:T (T in [-1, 1]) or fpir:F (F in (0, 0.5])")


def changes(data: Embedded, args: argparse.Namespace, searches: Searches) -> dict[str, Any] | None:
    """Section 5: probes decided differently by the two ``--compare`` configurations."""
    if not args.compare:
        return None
    probes, found = decision_changes(searches, tuple(args.compare), data.match_threshold, data.reference)

    def name(identity: int | None) -> str:
        return "unknown" if identity is None else data.names[identity]

    return {"a": args.compare[0].name, "b": args.compare[1].name, "probes": probes, "changed": [
        {"image": data.paths[c.row], "role": "stranger" if c.stranger else "genuine",
         "identity": data.names[data.identities[c.row]], "candidate": data.names[c.candidate],
         "score": round(c.score, 4), "a": name(c.decisions[0]), "b": name(c.decisions[1]),
         "thresholds": [round(t, 4) for t in c.thresholds]} for c in found]}


def command(args: argparse.Namespace, folder: str) -> str:
    """The command that measures the same numbers again (the options that change them, not the outputs)."""
    parts = ["python -m recognition evaluate", shlex.quote(folder),
             f"--enroll-per-identity {args.enroll_per_identity}",
             f"--max-impostor-pairs {args.max_impostor_pairs}", f"--bootstrap {args.bootstrap}",
             f"--draws {args.draws}", f"--fpir {','.join(f'{f:g}' for f in args.fpir)}",
             f"--seed {args.seed}"]
    if args.sizes:
        parts.append(f"--sizes {','.join(str(n) for n in args.sizes)}")
    if args.pairs:
        parts.append(f"--pairs {shlex.quote(str(args.pairs))}")
    if args.compare:
        parts.append(f"--compare {args.compare[0].name} {args.compare[1].name}")
    return " ".join(parts)


def reference(data: Embedded, genuine: Pairs, impostor: Pairs, sampled: bool, cmd: str) -> dict[str, Any]:
    """The score reference: the impostor tail and the genuine scores of every pair (or the sample)."""
    if len(impostor) < 20 or len(genuine) < 2:
        raise ValueError(f"--reference-out needs at least 20 impostor and 2 genuine pairs, got "
                         f"{len(impostor)} and {len(genuine)}")
    kind = "sampled" if sampled else "all"
    measured = (f"{datetime.now(UTC):%Y-%m-%d}: {Path(data.folder).name}, {len(data.names)} identities, "
                f"{len(data.paths)} images, {len(genuine)} genuine and {len(impostor)} impostor pairs "
                f"({kind}); {cmd}")
    spread = GenuineScores.from_scores(genuine.scores)
    return {"measured": measured, "impostor": ScoreTail.from_scores(impostor.scores).to_dict(),
            "genuine": {"mean": round(spread.mean, 5), "sd": round(spread.sd, 5), "pairs": spread.pairs}}


def _embedded(args: argparse.Namespace) -> Embedded:
    """The embeddings of an earlier run, or of the folder through Triton (kept in ``--out``)."""
    if args.embeddings:
        return Embedded.load(args.embeddings)
    data = asyncio.run(embed_folder(args.folder, args.url, args.settings.triton.timeout_s, args.concurrency,
                                    args.quiet))
    data.save(args.out / "embeddings.npz")
    return data


def evaluate(args: argparse.Namespace) -> int:
    """Run the evaluation and write its outputs in ``args.out``."""
    if not args.embeddings and not args.folder:
        raise ValueError("give a labelled folder, or --embeddings FILE from an earlier run")
    args.out.mkdir(parents=True, exist_ok=True)
    data = _embedded(args)
    if data.failed:
        log.warning("%d images left out: no face, or unreadable (listed in the report)", len(data.failed))
    cmd = command(args, data.folder)
    genuine = genuine_pairs(data.vectors, data.identities)
    impostor, sampled = impostor_pairs(data.vectors, data.identities, args.max_impostor_pairs, args.seed)
    searches = Searches(data.vectors, data.identities, len(data.names),
                        enrolled_mask(data.identities, args.enroll_per_identity))
    report = {
        "command": cmd, "date": f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC", "folder": data.folder,
        "model": {"name": data.model, "match_threshold": data.match_threshold,
                  "score_reference": bool(data.reference)},
        "data": {"identities": len(data.names), "images": len(data.paths),
                 "failed": [{"image": p, "why": w} for p, w in data.failed]},
        "verification": verification(data, args, genuine, impostor, sampled),
        "identification": identification(data, args, searches),
        "changes": changes(data, args, searches),
        "histograms": histograms(genuine.scores, impostor.scores, data.match_threshold,
                                 args.out / "scores.png"),
    }
    return _write(args, report, lambda: reference(data, genuine, impostor, sampled, cmd))


def _write(args: argparse.Namespace, report: dict[str, Any], block: Callable[[], dict[str, Any]]) -> int:
    """report.json, report.md and, with ``--reference-out``, the reference (when the pairs allow one: the
    report is written either way, then the refusal is raised)."""
    refused = None
    if args.reference_out:
        try:
            measured = block()
            args.reference_out.write_text(reference_toml(measured))
            report["reference"] = {"file": str(args.reference_out), **measured}
        except ValueError as exc:
            refused, report["reference"] = exc, {"error": str(exc)}
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    (args.out / "report.md").write_text(markdown(report))
    print(f"report: {args.out / 'report.md'}")
    if refused is not None:
        raise refused
    return 0


def _numbers(kind: type[float] | type[int], low: float, high: float) -> Callable[[str], list[Any]]:
    """A comma-separated list of numbers in [low, high], for argparse."""
    def parse(text: str) -> list[Any]:
        try:
            values = [kind(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text!r}") from None
        if not values or any(not low <= v <= high for v in values):
            raise argparse.ArgumentTypeError(f"{text!r}: each value must be from {low:g} to {high:g}")
        return values
    return parse


def _whole(low: int) -> Callable[[str], int]:
    """A whole number of at least ``low``, for argparse."""
    def parse(text: str) -> int:
        try:
            number = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if number < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, not {number}")
        return number
    return parse


HELP = """Measure the served model on a labelled folder (one subfolder per person, the layout of LFW): the
largest face of each image goes through face_pipeline on Triton, then

  1:1   TAR at FMR 1e-2, 1e-3, 1e-4 (95 % intervals: bootstrap over identities), TAR and FMR at the
        model's fixed threshold; all pairs, a sample beyond --max-impostor-pairs, or --pairs;
  1:N   open set: each identity in turn a stranger, galleries of --sizes identities; FPIR and FNIR
        at the fixed threshold, at the threshold the product derives for each --fpir target, and at
        the threshold these strangers would need; with --enroll-per-identity 2+, identity score fusion;
  and   score histograms (PNG), --compare, --reference-out.

Writes report.md, report.json, scores.png and embeddings.npz (reuse: --embeddings) to --out.
docs/calibration.md ("Evaluate on labelled faces") explains every table."""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser], settings: Settings,
               concurrency: Callable[[str], int]) -> None:
    """``evaluate``'s command line; ``concurrency`` checks ``--concurrency`` as ``import`` does."""
    p = sub.add_parser("evaluate", help="measure the served model on a labelled folder (1:1 ROC, "
                       "open-set 1:N)", description=HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path, nargs="?", help="one subfolder per person (LFW's layout); the "
                   "largest face of each image is taken")
    p.add_argument("--out", type=Path, default=Path("evaluation"), help="report.json, report.md, scores.png "
                   "and embeddings.npz go here (default: %(default)s)")
    p.add_argument("--embeddings", type=Path, metavar="FILE", help="an earlier run's embeddings.npz: "
                   "evaluate again without Triton")
    triton_argument(p, settings)
    p.add_argument("--concurrency", type=concurrency, default=8, help="requests in flight to Triton "
                   "(default: 8)")
    p.add_argument("--pairs", type=Path, metavar="FILE", help="1:1 on these pairs only, in LFW's pairs.txt "
                   "format ('name n1 n2' genuine, 'name1 n1 name2 n2' impostor; images name/name_%%04d.jpg)")
    p.add_argument("--max-impostor-pairs", type=_whole(1), default=2_000_000, metavar="N",
                   help="beyond N impostor pairs, a seeded sample of N (default: %(default)s)")
    p.add_argument("--bootstrap", type=_whole(0), default=500, metavar="N",
                   help="resamples of the identities for the 1:1 intervals (default: %(default)s)")
    p.add_argument("--enroll-per-identity", type=_whole(1), default=1, metavar="M",
                   help="1:N: the first M images of each gallery identity (by file name) are enrolled, the "
                   "rest are genuine probes (default: %(default)s)")
    p.add_argument("--sizes", type=_numbers(int, 1, 10**9), metavar="N,N,...", help="1:N gallery sizes in "
                   "identities (default: 10, 100, ... below the number of other identities, and all of them)")
    p.add_argument("--draws", type=_whole(1), default=10, metavar="N", help="random galleries per size "
                   "below the largest (default: %(default)s; the largest: each identity in turn is the "
                   "stranger)")
    p.add_argument("--fpir", type=_numbers(float, 1e-9, 0.5), default=[0.01, 0.001], metavar="F,F,...",
                   help="target FPIRs for the product's calibrated threshold (default: 0.01,0.001)")
    p.add_argument("--compare", type=_config, nargs=2, metavar=("A", "B"), help="list the 1:N probes whose "
                   "decision differs between two configurations at the largest gallery: fixed:T or fpir:F "
                   "(e.g. fixed:0.363 fpir:0.01)")
    p.add_argument("--reference-out", type=Path, metavar="FILE", help="write the model's score reference "
                   "(impostor tail and genuine scores of every pair) to FILE: save it beside the embedder's "
                   "description as export/specs/<name>.scores.toml")
    p.add_argument("--seed", type=int, default=0, help="seed of every sample and resample (default: 0)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=evaluate)
