"""The serving report's judgements: ratios between two numbers of the same run, and the targets (measured
value, pass / falls short, and why). Reported, never asserted; the wording is in ``bench/report_text.py``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bench import ceiling as ceiling_part
from bench import report_load_targets as load_targets
from bench import report_text as text
from bench.core.load import LoadRow
from bench.core.reporting import markdown_table
from bench.report_checks import Target, not_measured, sentence, status, throughput_why
from bench.report_text import say
from bench.results import (
    NAIVE_PLAIN,
    NAIVE_SERVED,
    ONE_FACE,
    SIX_FACES,
    TARGET_CONCURRENCY,
    Results,
    baselines,
    best_naive,
    find,
    ort_ceiling,
    peak,
    served_ceiling,
)
from bench.stack import GRPC, REST

__all__ = ["Ratio", "Target", "ratio_table", "ratios", "target_table", "targets"]

# --- ratios -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ratio:
    name: str
    value: float
    numerator: str
    denominator: str


def _per_s(row: LoadRow) -> str:
    return say(text.IMAGES_PER_S_OF, value=row.throughput, target=row.target)


def ratios(results: Results) -> list[Ratio]:
    out: list[Ratio] = []
    c = TARGET_CONCURRENCY

    def add(name: str, num: float | None, num_text: str, den: float | None, den_text: str) -> None:
        if num is not None and den:
            out.append(Ratio(name, num / den, num_text, den_text))

    for photo in (ONE_FACE, SIX_FACES):
        ceiling, ort = served_ceiling(results, photo), ort_ceiling(results, photo)
        if ceiling and ort and ceiling is not ort and ceiling.layouts and ort.layouts:
            add(say(text.RATIO_RUNTIMES, photo=photo), ceiling.images_per_s,
                say(text.IMAGES_PER_S_OF, value=ceiling.images_per_s, target=ceiling.runtime),
                ort.images_per_s, say(text.IMAGES_PER_S_OF, value=ort.images_per_s, target=ort.runtime))
        limit = ceiling.images_per_s if ceiling else None
        limit_text = say(text.CEILING_IMAGES_PER_S, value=limit) if limit else ""
        for target in (REST, GRPC):
            row = find(results.stack, target, photo, c)
            if row:
                add(say(text.RATIO_VS_CEILING, target=target, photo=photo, c=c), row.throughput,
                    say(text.IMAGES_PER_S, value=row.throughput), limit, limit_text)
        for baseline, naive_rows in baselines(results):
            naive = best_naive(naive_rows, photo, c)
            if naive:
                add(say(text.RATIO_VS_CEILING, target=baseline, photo=photo, c=c), naive.throughput,
                    _per_s(naive), limit, limit_text)
                for target in (REST, GRPC):
                    row = find(results.stack, target, photo, c)
                    if row:
                        add(say(text.RATIO_VS, target=target, baseline=baseline, photo=photo, c=c),
                            row.throughput, say(text.IMAGES_PER_S, value=row.throughput), naive.throughput,
                            _per_s(naive))
            top_naive = best_naive(naive_rows, photo, None)
            for target in (REST, GRPC):
                top = peak(results.stack, target, photo)
                if top and top_naive:
                    add(say(text.RATIO_BEST_OF_EACH, target=target, baseline=baseline, photo=photo),
                        top.throughput, say(text.IMAGES_PER_S_AT, value=top.throughput,
                                            concurrency=top.concurrency),
                        top_naive.throughput, say(text.IMAGES_PER_S_AT_OF, value=top_naive.throughput,
                                                  concurrency=top_naive.concurrency, target=top_naive.target))
        served, plain = best_naive(results.naive, photo, c), best_naive(results.naive_plain, photo, c)
        if served and plain:
            add(say(text.RATIO_WORK_REDUCTIONS, served=NAIVE_SERVED, plain=NAIVE_PLAIN, photo=photo, c=c),
                served.throughput, _per_s(served), plain.throughput, _per_s(plain))
        rest, grpc = find(results.stack, REST, photo, c), find(results.stack, GRPC, photo, c)
        if rest and grpc:
            add(say(text.RATIO_GATEWAY, rest=REST, grpc=GRPC, photo=photo, c=c), rest.throughput,
                say(text.IMAGES_PER_S, value=rest.throughput), grpc.throughput,
                say(text.IMAGES_PER_S, value=grpc.throughput))
        if ceiling:
            for target in (REST, GRPC):
                row = find(results.stack, target, photo, 1)
                if row:
                    add(say(text.RATIO_LATENCY, target=target, photo=photo), row.p50_ms,
                        say(text.MS, value=row.p50_ms), ceiling.single_image_ms,
                        say(text.MS, value=ceiling.single_image_ms))
        paired = next((r for r in results.paired_latency if r.photo == photo), None)
        if paired:
            for target in (REST, GRPC):
                add(say(text.RATIO_LATENCY_PAIRED, target=target, photo=photo), paired.p50_ms(target),
                    say(text.MS, value=paired.p50_ms(target)), paired.ceiling_ms,
                    say(text.MS, value=paired.ceiling_ms))
    return out


def ratio_table(items: Sequence[Ratio]) -> str:
    return markdown_table(("ratio", "value", "numerator", "denominator"),
                          [(r.name, f"{r.value:.2f}", r.numerator, r.denominator) for r in items])


# --- targets ------------------------------------------------------------------------------------------


def _split_why(split: ceiling_part.StageSplit) -> str:
    stages = sorted(((ms, name) for name, ms in split.stages_ms.items()
                     if name not in ceiling_part.MODEL_STAGES), reverse=True)
    return ", ".join(say(text.STEP, name=name, ms=ms) for ms, name in stages[:3])


#: Issue 10's factors: the served runtime's ceiling over ONNX Runtime's, REST identify over the plain naive
#: baseline (per photo), over naive served on the same runtime, and over the same runtime's ceiling.
RUNTIME_FACTORS = {ONE_FACE: 1.3, SIX_FACES: 1.7}
PLAIN_FACTORS = {ONE_FACE: 1.6, SIX_FACES: 2.0}
SERVED_FACTOR = 0.9
CEILING_SHARE = 0.8


def _models_ms(split: ceiling_part.StageSplit) -> float:
    return sum(split.stages_ms[s] for s in ceiling_part.MODEL_STAGES)


def _runtimes(results: Results) -> list[Target]:
    """The served runtime's in-process ceiling against ONNX Runtime's on the same files and settings."""
    out = []
    for photo, factor in RUNTIME_FACTORS.items():
        served, ort = served_ceiling(results, photo), ort_ceiling(results, photo)
        name = say(text.TARGET_RUNTIME, factor=factor, photo=photo)
        if not (served and ort and served.layouts and ort.layouts and served is not ort):
            out.append(not_measured(name, results, ("ceiling",)))
            continue
        ratio = served.images_per_s / ort.images_per_s
        why = ""
        if ratio < factor and served.splits and ort.splits:
            a, b = served.best_split, ort.best_split
            why = say(text.WHY_RUNTIME, single=a.total_ms, ort_single=b.total_ms, models=_models_ms(a),
                      ort_models=_models_ms(b), outside=a.outside_models_ms, ort_outside=b.outside_models_ms)
        measured = say(text.MEASURED_RUNTIME, served=served.images_per_s, runtime=served.runtime,
                       ort=ort.images_per_s, ratio=ratio)
        out.append(Target(name, measured, status(ratio >= factor), why))
    return out


def _vs_ceiling(results: Results) -> list[Target]:
    """REST identify against the in-process ceiling of the runtime the stack serves, per photo."""
    c, out = TARGET_CONCURRENCY, []
    for photo in (ONE_FACE, SIX_FACES):
        ceiling, rest = served_ceiling(results, photo), find(results.stack, REST, photo, c)
        name = say(text.TARGET_VS_CEILING, c=c, share=CEILING_SHARE, photo=photo)
        if not (rest and ceiling and ceiling.best_layout):
            out.append(not_measured(name, results, ("stack", "ceiling")))
            continue
        share = rest.throughput / ceiling.images_per_s
        why = "" if share >= CEILING_SHARE else throughput_why(
            rest, ceiling.images_per_s, ceiling.best_layout.cpu_ms_per_image,
            f"the ceiling ({ceiling.runtime}, {ceiling.best_layout.label})")
        measured = say(text.MEASURED_VS_CEILING, rest=rest.throughput, ceiling=ceiling.images_per_s,
                       share=share, runtime=ceiling.runtime)
        out.append(Target(name, measured, status(share >= CEILING_SHARE), why))
    return out


def _vs_baseline(results: Results, photo: str, factor: float, naive: LoadRow | None, baseline: str
                 ) -> Target:
    c = TARGET_CONCURRENCY
    rest, ceiling = find(results.stack, REST, photo, c), served_ceiling(results, photo)
    name = say(text.TARGET_VS_BASELINE, c=c, factor=factor, baseline=baseline, photo=photo)
    if not (rest and naive):
        return not_measured(name, results, ("stack", "naive"))
    ratio = rest.throughput / naive.throughput
    why = ""
    if ratio < factor:
        why = throughput_why(rest, naive.throughput, naive.cpu_ms_total, naive.target)
        if ceiling and ceiling.layouts and naive.throughput * factor > ceiling.images_per_s:
            why += say(text.WHY_ABOVE_CEILING, factor=factor, needed=naive.throughput * factor,
                       ceiling=ceiling.images_per_s)
        served = best_naive(results.naive, photo, c)
        if baseline == text.BASELINE_PLAIN and served:
            why += say(text.WHY_REDUCTIONS_ALONE, speedup=served.throughput / naive.throughput,
                       served_name=NAIVE_SERVED, served=served.throughput)
    measured = say(text.MEASURED_VS_BASELINE, rest=rest.throughput, naive=naive.throughput, ratio=ratio,
                   target=naive.target, photo=photo)
    return Target(name, measured, status(ratio >= factor), why)


def _vs_baselines(results: Results) -> list[Target]:
    """1.6x / 2.0x the plain baseline (the obvious deployment: less work and a faster runtime count), 0.9x
    the served baseline on the same runtime (the same work: this is the serving overhead)."""
    c = TARGET_CONCURRENCY
    out = [_vs_baseline(results, photo, factor, best_naive(results.naive_plain, photo, c),
                        text.BASELINE_PLAIN) for photo, factor in PLAIN_FACTORS.items()]
    out += [_vs_baseline(results, photo, SERVED_FACTOR, best_naive(results.naive, photo, c),
                         text.BASELINE_SERVED) for photo in (ONE_FACE, SIX_FACES)]
    return out


def _outside_models(results: Results) -> list[Target]:
    """face_pipeline's time outside the two networks: Triton's statistics, and the in-process split."""
    ceiling = served_ceiling(results, ONE_FACE)
    split = ceiling.best_split if ceiling and ceiling.splits else None
    out = []
    for concurrency in (1, TARGET_CONCURRENCY):
        grpc = find(results.stack, GRPC, ONE_FACE, concurrency)
        stats = (grpc.triton or {}).get("face_pipeline", {}) if grpc else {}
        name = say(text.TARGET_OUTSIDE_TRITON, c=concurrency)
        if stats and "outside_models_ms_per_image" not in stats:  # the networks ran inside face_pipeline
            out.append(Target(name, "—", text.NOT_MEASURED, text.WHY_IN_PROCESS_LAYOUT))
            continue
        if "outside_models_ms_per_image" not in stats:
            out.append(not_measured(name, results, ("stack",)))
            continue
        value = stats["outside_models_ms_per_image"]
        why = ""
        if value > 3:
            why = say(text.WHY_OUTSIDE_TRITON, compute=stats["compute_ms_per_item"],
                      models=stats["models_ms_per_image"])
            if split:
                why += say(text.WHY_TRITON_OWN, inprocess=split.outside_models_ms, steps=_split_why(split),
                           own=value - split.outside_models_ms)
        out.append(Target(name, say(text.MS, value=value), status(value <= 3), sentence(why)))
    if split:
        value = split.outside_models_ms
        why = "" if value <= 3 else say(text.WHY_LARGEST_STEPS, steps=_split_why(split))
        measured = say(text.MEASURED_SPLIT, value=value, threads=split.threads)
        out.append(Target(text.TARGET_OUTSIDE_SPLIT, measured, status(value <= 3), why))
    else:
        out.append(not_measured(text.TARGET_OUTSIDE_SPLIT, results, ("ceiling",)))
    return out


def targets(results: Results) -> list[Target]:
    return [*_runtimes(results), *_vs_ceiling(results), *_vs_baselines(results), *_outside_models(results),
            *load_targets.latency(results), *load_targets.under_load(results), *load_targets.memory(results),
            *load_targets.gateway_cpu(results)]


def target_table(items: Sequence[Target]) -> str:
    return markdown_table(("target", "measured", "result", "why, when short"),
                          [(t.name, t.measured, f"**{t.status}**", t.why or "—") for t in items])
