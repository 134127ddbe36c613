"""What ``python -m recognition evaluate`` writes: report.md's tables from report.json's numbers, the score
histograms (PNG, with matplotlib: the ``bench`` extra), and the ``[model.score_reference]`` TOML block."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from recognition.openset import BEST, FACES, TOP2, Outcome, Rate, SizeResult

#: Decision changes listed in report.md (report.json has them all).
MAX_CHANGES = 100
_BASES = {"collection": "gallery's own tail", "reference": "model reference",
          "fixed": "none, at the fixed threshold"}


def _rate(rate: Rate) -> dict[str, Any]:
    return {"errors": rate.errors, "searches": rate.searches, "images": rate.distinct, "rate": rate.value,
            "interval": rate.interval}


def _outcome(outcome: Outcome) -> dict[str, Any]:
    rule, thresholds = outcome.rule, np.asarray(outcome.thresholds)
    return {"name": rule.name, "fusion": rule.fusion, "count": rule.count if rule.fpir else None,
            "target_fpir": rule.fpir,
            "threshold": {"min": float(thresholds.min()), "mean": float(thresholds.mean()),
                          "max": float(thresholds.max())},
            "basis": dict(outcome.bases) if rule.fpir else None,
            # the score model's expectation is for an identity's best face: none for the top-2 mean's
            "expected_fpir": float(np.mean(outcome.expected)) if outcome.expected and (
                rule.fusion == BEST or rule.fpir) else None,
            "fpir": _rate(outcome.fpir), "fnir": _rate(outcome.fnir)}


def identification_json(results: Sequence[SizeResult], per_identity: int, no_fusion: str | None
                        ) -> dict[str, Any]:
    return {"enrolled_per_identity": per_identity, "fusion": no_fusion or "measured",
            "sizes": [{"size": r.size, "galleries": r.galleries, "faces": list(r.faces),
                       "rules": [_outcome(o) for o in r.outcomes]} for r in results]}


def _pct(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.3g} %"


def _share(rate: dict[str, Any]) -> str:
    if not rate["searches"]:
        return "no searches"
    return f"{_pct(rate['rate'])} ({rate['errors']}/{rate['searches']}; {_span(rate['interval'])})"


def _threshold(spread: dict[str, float]) -> str:
    if spread["max"] - spread["min"] < 5e-5:
        return f"{spread['mean']:.4f}"
    return f"{spread['mean']:.4f} ({spread['min']:.4f}-{spread['max']:.4f})"


def _basis(rule: dict[str, Any]) -> str:
    if not rule["basis"]:
        return ""
    return ", ".join(f"{_BASES.get(k, k)} ({n})" for k, n in sorted(rule["basis"].items()))


def _verification(section: dict[str, Any]) -> list[str]:
    lines = ["## 1:1 verification", ""]
    lines.append(f"Pairs: {section['pairs']}: {section['genuine']} genuine (one person, two different "
                 f"images), {section['impostor']} impostor (two people).")
    if section["skipped"]:
        lines.append(f"{len(section['skipped'])} pairs of the file skipped (an image missing or without a "
                     "face).")
    if not section["points"]:
        return [*lines, "", "Not measurable: no genuine or no impostor pairs.", ""]
    lines += [f"95 % intervals: {section['bootstrap']} bootstrap resamples of the identities (the threshold "
              "found again in each).", "", "| FMR | threshold | TAR | 95 % interval |", "|---|---|---|---|"]
    for point in section["points"]:
        if point["threshold"] is None:
            needed = int(np.ceil(1 / point["fmr"]))
            lines.append(f"| {point['fmr']:g} | not measurable with {section['impostor']} impostor pairs "
                         f"(needs {needed}) | | |")
            continue
        lines.append(f"| {point['fmr']:g} | {point['threshold']:.4f} | {_pct(point['tar'])} | "
                     f"{_span(point['interval'])} |")
    at = section["fixed"]
    lines += ["", f"At the model's fixed threshold {at['threshold']:g} (intervals: the bootstrap over "
              "identities counts pairs that share a person as one unit; Wilson's counts each pair, and stays "
              "honest at 0 of n):", "", "| | share | pairs | bootstrap 95 % | Wilson 95 % |",
              "|---|---|---|---|---|"]
    for name, hits, total, boot, exact in (
            ("TAR", at["accepted"], at["genuine"], at["tar_interval"], at["tar_wilson"]),
            ("FMR", at["false_matches"], at["impostor"], at["fmr_interval"], at["fmr_wilson"])):
        lines.append(f"| {name} | {_pct(hits / total)} | {hits}/{total} | {_span(boot)} | {_span(exact)} |")
    return [*lines, ""]


def _span(interval: Sequence[float] | None) -> str:
    return "-" if interval is None else f"{_pct(interval[0])}-{_pct(interval[1])}"


def _rows(size: dict[str, Any], rules: list[dict[str, Any]], first: bool) -> list[str]:
    faces = size["faces"]
    held = f"{faces[0]}" if faces[0] == faces[1] else f"{faces[0]}-{faces[1]}"
    lines = []
    for number, rule in enumerate(rules):
        lead = f"| {size['size']} | {held} | {size['galleries']} " if number == 0 or not first else "| | | "
        lines.append(f"{lead}| {rule['name']} | {_threshold(rule['threshold'])} | {_basis(rule)} | "
                     f"{_pct(rule['expected_fpir'])} | {_share(rule['fpir'])} | {_share(rule['fnir'])} |")
    return lines


_HEADER = ["| identities | faces | galleries | decision | threshold | calibration | expected FPIR | FPIR "
           "| FNIR |", "|---|---|---|---|---|---|---|---|---|"]


def _identification(section: dict[str, Any], targets: Sequence[float]) -> list[str]:
    lines = ["## Open-set 1:N", "",
             f"A gallery enrolls the first {section['enrolled_per_identity']} image(s) of each of its "
             "identities (by file name); their other images are genuine probes. Strangers are the identities "
             "left out: all their images are searched; at the largest size each identity in turn is the "
             "stranger. FPIR: strangers' searches whose best score reaches the threshold; FNIR: genuine "
             "probes whose own identity is not the rank-1 candidate at or above it. `fpir F`: the threshold "
             "the product derives (gallery.calibration.decide) for target F at the gallery's enrolled faces; "
             "`empirical F`: the threshold these strangers would need. Counts are searches pooled over the "
             "galleries; the 95 % Wilson intervals count each image once.", "", *_HEADER]
    for size in section["sizes"]:
        shown = [r for r in size["rules"] if r["fusion"] == BEST and (r["count"] in (None, FACES))]
        lines += _rows(size, shown, True)
        strangers = size["rules"][0]["fpir"]["images"]
        for target in targets:
            if not any(r["name"] == f"empirical {target:g}" for r in size["rules"]):
                lines.append(f"| | | | empirical {target:g} | not measurable with {strangers} stranger "
                             "images | | | | |")
    lines += ["", *_fusion(section), ""]
    return lines


def _fusion(section: dict[str, Any]) -> list[str]:
    lines = ["## Score fusion", ""]
    if section["fusion"] != "measured":
        return [*lines, f"Not measured: {section['fusion']}."]
    lines += ["An identity's score is its best face's (`best`, the product) or the mean of its two best "
              "(`top2`). The product's calibration counts every enrolled face as a comparison a stranger can "
              "win; `counting identities` counts one per identity.", "", *_HEADER]
    for size in section["sizes"]:
        shown = [r for r in size["rules"] if r["target_fpir"] or r["fusion"] == TOP2
                 or r["name"].startswith("empirical")]
        lines += _rows(size, shown, True)
    return lines


def _changes(section: dict[str, Any] | None) -> list[str]:
    if section is None:
        return []
    changed = section["changed"]
    lines = [f"## Decision changes: {section['a']} → {section['b']}", "",
             f"{len(changed)} of {section['probes']} probes decided differently (each probe once at the "
             "largest gallery: a stranger's images against every other identity, a genuine probe against "
             "every identity)."]
    if changed:
        lines += ["", "| image | role | identity | rank-1 | score | A | B |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {c['image']} | {c['role']} | {c['identity']} | {c['candidate']} | {c['score']:.4f} | "
                  f"{c['a']} | {c['b']} |" for c in changed[:MAX_CHANGES]]
        if len(changed) > MAX_CHANGES:
            lines.append(f"\n{len(changed) - MAX_CHANGES} more in report.json.")
    return [*lines, ""]


def markdown(report: dict[str, Any]) -> str:
    data, model = report["data"], report["model"]
    targets = sorted({r["target_fpir"] for s in report["identification"]["sizes"] for r in s["rules"]
                      if r["target_fpir"]}, reverse=True)
    lines = [f"# Evaluation of {model['name']} on {report['folder']}", "",
             f"{report['date']}: `{report['command']}`", "",
             f"{data['images']} images of {data['identities']} identities, the largest face of each "
             f"(left out, without a face or unreadable: {len(data['failed'])}). Model threshold "
             f"{model['match_threshold']:g}; "
             f"score reference: {'yes' if model['score_reference'] else 'none'}. Histograms: "
             f"{report['histograms']}.", ""]
    lines += _verification(report["verification"])
    lines += _identification(report["identification"], targets)
    lines += _changes(report["changes"])
    if data["failed"]:
        lines += ["## Images left out", "",
                  *(f"- {f['image']}: {f['why']}" for f in data["failed"]), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def histograms(genuine: NDArray[np.float64], impostor: NDArray[np.float64], threshold: float,
               path: Path) -> str:
    """Genuine and impostor score histograms (a density, and counts on a log scale for the tail) as PNG;
    what was done, for the report."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "skipped (matplotlib is not installed: pip install '.[bench]')"
    bins = np.linspace(-0.4, 1.0, 141)
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for axis, log in zip(axes, (False, True), strict=True):
        for scores, label in ((genuine, "genuine"), (impostor, "impostor")):
            if scores.size:
                axis.hist(scores, bins=bins, density=not log, alpha=0.6, log=log,
                          label=f"{label} ({scores.size} pairs)")
        axis.axvline(threshold, color="black", linestyle="--", linewidth=1, label=f"threshold {threshold:g}")
        axis.set_xlabel("cosine score")
        axis.set_ylabel("pairs (log)" if log else "density")
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path.name


def reference_toml(block: dict[str, Any]) -> str:
    """``block`` as a score reference file: ``<description>.scores.toml`` beside a model description,
    which facecore.spec.load_spec reads into its ``score_reference``."""
    impostor, genuine = block["impostor"], block["genuine"]
    points = ",\n".join(f"  [{z!r}, {s!r}]" for z, s in impostor["points"])
    return "\n".join([
        "# Measured by `python -m recognition evaluate`: save beside the embedder's description as",
        "# export/specs/<name>.scores.toml (docs/calibration.md says how).",
        f"measured = {json.dumps(block['measured'])}",
        "",
        "[impostor]",
        f"points = [\n{points},\n]",
        f"slope = {impostor['slope']!r}",
        f"pairs = {impostor['pairs']}",
        "",
        "[genuine]",
        f"mean = {genuine['mean']!r}",
        f"sd = {genuine['sd']!r}",
        f"pairs = {genuine['pairs']}",
        "",
    ])
