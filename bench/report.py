"""The serving report: the Markdown section of ``<out>/README.md``, the plots and ``results.json``.

Every comparison is a ratio of two numbers measured in the same ``python -m bench`` run on the same
machine (``bench/report_targets.py``); targets are reported (measured value, pass / falls short, and
why), never asserted. The wording is in ``bench/report_text.py``; this module fills it from the results.

    python -m bench.report --rerender docs/benchmarks   # the section again from its results.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench import ceiling as ceiling_part
from bench import latency as latency_part
from bench import naive as naive_part
from bench import report_text as text
from bench import stack as stack_part
from bench.ceiling import PhotoCeiling
from bench.core.reporting import read_section, write_section
from bench.report_plots import PLOTS, plots
from bench.report_targets import Ratio, Target, ratio_table, ratios, target_table, targets
from bench.report_text import say
from bench.results import (
    NAIVE_PLAIN,
    NAIVE_SERVED,
    NAIVE_SERVED_ORT,
    ONE_FACE,
    SIX_FACES,
    TARGET_CONCURRENCY,
    Results,
    best_naive,
    ceiling_of,
    ort_ceiling,
)

__all__ = ["Ratio", "Results", "Target", "document", "ratios", "section", "targets", "write"]

SECTION = "bench"
#: The two targets' names for the naive baselines (tests and tools look them up).
BASELINE_SERVED, BASELINE_PLAIN = text.BASELINE_SERVED, text.BASELINE_PLAIN


# --- the naive baselines ------------------------------------------------------------------------------


def _at_one_thread(sweep: dict[int, dict[int, float]]) -> tuple[int, float] | None:
    """(threads, ms per item at batch 1) with the fewest threads measured: what the naive app pays."""
    if not sweep:
        return None
    threads = min(sweep)
    return (threads, sweep[threads][1]) if 1 in sweep[threads] else None


def _detector_text(results: Results) -> str:
    parts, threads = [], None
    for photo in (ONE_FACE, SIX_FACES):
        served, plain = _same_runtime_as_plain(results, photo), ceiling_of(results, photo, "plain")
        if not (served and plain):
            continue
        (w, h), (pw, ph) = served.input_size, plain.input_size
        part = say(text.DETECTOR_PIXELS, label=served.label, w=w, h=h, pw=pw, ph=ph,
                   fewer=1 - w * h / (pw * ph))
        a, b = _at_one_thread(served.detector_ms), _at_one_thread(plain.detector_ms)
        if a and b:
            part += say(text.DETECTOR_MS, served=a[1], plain=b[1])
            threads = a[0]
        parts.append(part)
    if not parts:
        return ""
    return "; ".join(parts) + (say(text.DETECTOR_THREADS, threads=threads) if threads else "")


def _same_runtime_as_plain(results: Results, photo: str) -> PhotoCeiling | None:
    """The served files and settings on ONNX Runtime (plain's runtime), so the comparison with plain shows the
    work reductions alone; the served row when no ONNX Runtime row was measured."""
    return ort_ceiling(results, photo) or ceiling_of(results, photo, "served")


def _embedder_text(results: Results) -> str:
    served = _same_runtime_as_plain(results, ONE_FACE)
    plain = next((c for c in results.ceiling if c.variant == "plain"), None)
    a = _at_one_thread(served.embedder_ms) if served else None
    b = _at_one_thread(plain.embedder_ms) if plain else None
    if not (a and b):
        return ""
    return say(text.EMBEDDER_MS, served=a[1], plain=b[1], less=1 - a[1] / b[1], threads=a[0])


def _detail(measured: str) -> str:
    return say(text.MEASURED_DETAIL, text=measured) if measured else ""


def baselines_text(results: Results) -> str:
    """What each naive baseline runs, which target uses which, and where the work reduction comes from
    (with this run's numbers where they were measured)."""
    c = TARGET_CONCURRENCY
    lines = [say(text.BASELINES, served=NAIVE_SERVED, served_ort=NAIVE_SERVED_ORT, plain=NAIVE_PLAIN,
                 check=say(text.PLAIN_CHECK, check=results.plain_check) if results.plain_check else "",
                 detector=_detail(_detector_text(results)), embedder=_detail(_embedder_text(results)))]
    served, plain = best_naive(results.naive, ONE_FACE, c), best_naive(results.naive_plain, ONE_FACE, c)
    ort = best_naive(results.naive_onnxruntime, ONE_FACE, c)
    if ort and plain:
        lines.append(say(text.REDUCTIONS_ALONE, speedup=ort.throughput / plain.throughput, c=c,
                         served=ort.throughput, plain=plain.throughput, photo=ONE_FACE))
    if served and ort:
        lines.append(say(text.RUNTIME_ALONE, speedup=served.throughput / ort.throughput, c=c,
                         served=served.throughput, ort=ort.throughput, photo=ONE_FACE))
    if served and plain:
        lines.append(say(text.TOGETHER, speedup=served.throughput / plain.throughput, c=c,
                         served=served.throughput, plain=plain.throughput, photo=ONE_FACE))
    return "\n".join(lines)


# --- the document -------------------------------------------------------------------------------------


def _header(results: Results) -> str:
    return say(text.HEADER, command=results.command, date=results.date, machine=results.machine,
               settings=", ".join(say(text.SETTING, name=k, value=v) for k, v in results.settings.items()),
               served=results.served or "unknown",
               seconds=", ".join(say(text.PART_MINUTES, name=k, minutes=v / 60)
                                 for k, v in results.seconds.items()))


def _load_sections(results: Results) -> list[str]:
    parts = []
    naive_rows = [*results.naive, *results.naive_onnxruntime, *results.naive_plain]
    if naive_rows:
        parts += [text.NAIVE_HEADING, naive_part.load_table(naive_rows)]
    if results.stack:
        parts += [text.STACK_HEADING, stack_part.load_table(results.stack),
                  text.STACK_CPU, stack_part.cpu_table(results.stack),
                  text.STACK_STATS, stack_part.stats_table(results.stack)]
    if results.hold:
        parts += [text.HOLD, stack_part.hold_table(results.hold)]
    if results.paired_latency:
        parts += [text.LATENCY_HEADING,
                  say(text.LATENCY, pause=results.paired_latency[0].pause_ms, warmup=latency_part.WARMUP),
                  latency_part.table(results.paired_latency)]
    return parts


def _memory_section(results: Results) -> list[str]:
    memory = results.memory
    if not memory:
        return []
    biggest = sorted(memory.breakdown_mib.items(), key=lambda kv: -kv[1])
    parts = [say(text.MEMORY_HEADING, c=memory.concurrency, minutes=memory.minutes),
             say(text.MEMORY, interval=memory.interval_s, warmup=memory.warmup_s, samples=len(memory.times_s),
                 requests=memory.load.requests, throughput=memory.load.throughput, errors=memory.load.errors),
             *([say(text.MEMORY_SHAPES, shapes=memory.shapes)] if memory.shapes > 1 else []),
             stack_part.memory_table(memory),
             say(text.MEMORY_BREAKDOWN, processes=", ".join(say(text.PROCESS_MIB, name=k, mib=v)
                                                           for k, v in biggest))]
    if memory.summed_rss_mib:
        parts.append(say(text.MEMORY_SUMMED_RSS, figures=", ".join(
            say(text.PROCESS_MIB, name=k, mib=v) for k, v in memory.summed_rss_mib.items())))
    return parts


def document(results: Results, written: dict[str, str]) -> str:
    parts = [text.TITLE, _header(results)]
    if results.errors:
        parts.append(say(text.FAILED_PARTS, parts="\n".join(say(text.FAILED_PART, part=part, error=error)
                                                            for part, error in results.errors.items())))
    parts += [text.TARGETS, target_table(targets(results))]
    if results.naive or results.naive_plain:
        parts += [text.BASELINES_HEADING, baselines_text(results)]
    parts += [text.RATIOS, ratio_table(ratios(results))]
    if "error" in written:
        parts.append(say(text.PLOTS_ERROR, error=written["error"]))
    pictures = [say(text.PICTURE, name=name, file=file) for name, file in written.items() if name in PLOTS]
    if pictures:
        parts.append("\n".join(pictures))
    if results.ceiling:
        parts.append(ceiling_part.document(results.ceiling))
    parts += _load_sections(results) + _memory_section(results)
    if results.gallery:
        parts += [text.GALLERY_HEADING, results.gallery]
    if results.enroll:
        parts += [text.ENROLL_HEADING, results.enroll]
    parts.append(text.HOW_TO_READ)
    return "\n\n".join(parts)


def write(results: Results, out: Path) -> Path:
    """Plots, ``results.json`` and this run's section of ``out/README.md``; returns the README path."""
    out.mkdir(parents=True, exist_ok=True)
    written = plots(results, out)
    readme = out / "README.md"
    write_section(readme, SECTION, document(results, written))
    (out / "results.json").write_text(json.dumps(results.to_json(), indent=2, default=str))
    return readme


def rerender(out: Path) -> Path:
    """The section of ``out/README.md`` again from ``out/results.json`` and the plots already there (after a
    change of wording: no benchmark runs)."""
    results = Results.from_json(json.loads((out / "results.json").read_text()))
    written = {name: file for name, file in PLOTS.items() if (out / file).exists()}
    readme = out / "README.md"
    write_section(readme, SECTION, document(results, written))
    return readme


def section(text: str, name: str = SECTION) -> str:
    """The text between this report's markers (for tests and tools)."""
    return read_section(text, name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rerender", type=Path, required=True, metavar="FOLDER",
                        help="a report folder with results.json (e.g. docs/benchmarks)")
    args = parser.parse_args(argv)
    print(f"rewrote the `{SECTION}` section of {rerender(args.rerender)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
