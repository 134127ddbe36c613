"""The serving report's judgements: ratios between two numbers of the same run, and the targets (measured
value, pass / falls short, and why). Reported, never asserted; the wording is in ``bench/report_text.py``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bench import ceiling as ceiling_part
from bench import report_text as text
from bench.ceiling import PhotoCeiling
from bench.core.load import LoadRow
from bench.core.reporting import markdown_table, usable_cores
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
    peak,
    served_ceiling,
)
from bench.stack import GRPC, REST

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
        ceiling = served_ceiling(results, photo)
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
    for result in results.perf_analyzer:
        for pa in result.rows:
            ours = find(results.stack, GRPC, result.photo, pa.concurrency)
            if ours:
                add(say(text.RATIO_PERF_ANALYZER, photo=result.photo, c=pa.concurrency), pa.throughput,
                    say(text.IMAGES_PER_S, value=pa.throughput), ours.throughput,
                    say(text.IMAGES_PER_S, value=ours.throughput))
    return out


def ratio_table(items: Sequence[Ratio]) -> str:
    return markdown_table(("ratio", "value", "numerator", "denominator"),
                          [(r.name, f"{r.value:.2f}", r.numerator, r.denominator) for r in items])


# --- targets ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    name: str
    measured: str
    status: str  # text.PASS, text.SHORT, text.NOT_MEASURED
    why: str = ""


def _status(ok: bool) -> str:
    return text.PASS if ok else text.SHORT


def _sentence(why: str) -> str:
    return why + ("." if why else "")


def _cpu_line(row: LoadRow) -> str:
    parts = [say(text.CPU_PART, name=text.LOAD_CLIENT, ms=row.client_cpu_ms)]
    parts += [say(text.CPU_PART, name=k, ms=v) for k, v in row.cpu_ms.items()]
    return say(text.CPU_LINE, total=row.cpu_ms_total, parts=", ".join(parts))


def _throughput_why(row: LoadRow, reference: float, reference_cpu: float, reference_name: str) -> str:
    cores = usable_cores()
    why = say(text.WHY_THROUGHPUT, target=row.target, cpu_line=_cpu_line(row), reference_name=reference_name,
              reference_cpu=reference_cpu, reference=reference, cores=cores,
              bound=cores * 1000 / max(row.cpu_ms_total, 1e-9))
    biggest = sorted(row.cpu_detail_ms.items(), key=lambda kv: -kv[1])[:3]
    if biggest:
        consumers = ", ".join(say(text.CONSUMER, name=k.split(": ")[-1], ms=v) for k, v in biggest)
        why += say(text.WHY_CONSUMERS, consumers=consumers)
    share = row.client_cpu_ms / max(row.cpu_ms_total, 1e-9)
    if share > 0.1:
        why += say(text.WHY_LOAD_CLIENT, share=share)
    return why + "."


def _split_why(split: ceiling_part.StageSplit) -> str:
    stages = sorted(((ms, name) for name, ms in split.stages_ms.items()
                     if name not in ceiling_part.MODEL_STAGES), reverse=True)
    return ", ".join(say(text.STEP, name=name, ms=ms) for ms, name in stages[:3])


def _missing(results: Results, parts: Sequence[str]) -> str:
    failed = [f"{name}: {error}" for name, error in results.errors.items() if any(p in name for p in parts)]
    return "; ".join(failed) if failed else text.NOT_IN_RUN


def _not_measured(name: str, results: Results, parts: Sequence[str]) -> Target:
    return Target(name, "—", text.NOT_MEASURED, _missing(results, parts))


def _vs_ceiling(results: Results) -> Target:
    c = TARGET_CONCURRENCY
    ceiling, rest = served_ceiling(results, ONE_FACE), find(results.stack, REST, ONE_FACE, c)
    name = say(text.TARGET_VS_CEILING, c=c)
    if not (rest and ceiling and ceiling.best_layout):
        return _not_measured(name, results, ("stack", "ceiling"))
    share = rest.throughput / ceiling.images_per_s
    why = "" if share >= 0.85 else _throughput_why(rest, ceiling.images_per_s,
                                                   ceiling.best_layout.cpu_ms_per_image,
                                                   f"the ceiling ({ceiling.best_layout.label})")
    measured = say(text.MEASURED_VS_CEILING, rest=rest.throughput, ceiling=ceiling.images_per_s, share=share)
    return Target(name, measured, _status(share >= 0.85), why)


def _vs_baselines(results: Results) -> list[Target]:
    """0.95x the served-settings baseline (the same work, so this is the serving overhead), 1.5x the plain
    one (the obvious deployment: less work counts)."""
    c = TARGET_CONCURRENCY
    ceiling, rest = served_ceiling(results, ONE_FACE), find(results.stack, REST, ONE_FACE, c)
    served_naive = best_naive(results.naive, ONE_FACE, c)
    plain_naive = best_naive(results.naive_plain, ONE_FACE, c)
    out = []
    for factor, naive, baseline in ((0.95, served_naive, text.BASELINE_SERVED),
                                    (1.5, plain_naive, text.BASELINE_PLAIN)):
        name = say(text.TARGET_VS_BASELINE, c=c, factor=factor, baseline=baseline)
        if not (rest and naive):
            out.append(_not_measured(name, results, ("stack", "naive")))
            continue
        ratio = rest.throughput / naive.throughput
        why = ""
        if ratio < factor:
            why = _throughput_why(rest, naive.throughput, naive.cpu_ms_total, naive.target)
            if ceiling and ceiling.layouts and naive.throughput * factor > ceiling.images_per_s:
                why += say(text.WHY_ABOVE_CEILING, factor=factor, needed=naive.throughput * factor,
                           ceiling=ceiling.images_per_s)
            if naive is plain_naive and served_naive:
                why += say(text.WHY_REDUCTIONS_ALONE, speedup=served_naive.throughput / naive.throughput,
                           served_name=NAIVE_SERVED, served=served_naive.throughput)
        measured = say(text.MEASURED_VS_BASELINE, rest=rest.throughput, naive=naive.throughput, ratio=ratio,
                       target=naive.target)
        out.append(Target(name, measured, _status(ratio >= factor), why))
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
        if "outside_models_ms_per_image" not in stats:
            out.append(_not_measured(name, results, ("stack",)))
            continue
        value = stats["outside_models_ms_per_image"]
        why = ""
        if value > 3:
            why = say(text.WHY_OUTSIDE_TRITON, compute=stats["compute_ms_per_item"],
                      models=stats["models_ms_per_image"])
            if split:
                why += say(text.WHY_TRITON_OWN, inprocess=split.outside_models_ms, steps=_split_why(split),
                           own=value - split.outside_models_ms)
        out.append(Target(name, say(text.MS, value=value), _status(value <= 3), _sentence(why)))
    if split:
        value = split.outside_models_ms
        why = "" if value <= 3 else say(text.WHY_LARGEST_STEPS, steps=_split_why(split))
        measured = say(text.MEASURED_SPLIT, value=value, threads=split.threads)
        out.append(Target(text.TARGET_OUTSIDE_SPLIT, measured, _status(value <= 3), why))
    else:
        out.append(_not_measured(text.TARGET_OUTSIDE_SPLIT, results, ("ceiling",)))
    return out


def _latency(results: Results) -> list[Target]:
    ceiling = served_ceiling(results, ONE_FACE)
    out = []
    for target in (REST, GRPC):
        row = find(results.stack, target, ONE_FACE, 1)
        name = say(text.TARGET_LATENCY, target=target)
        if not (row and ceiling):
            out.append(_not_measured(name, results, ("stack", "ceiling")))
            continue
        ratio = row.p50_ms / ceiling.single_image_ms
        why = _latency_why(results, row, ceiling) if ratio > 1.3 else ""
        measured = say(text.MEASURED_LATENCY, p50=row.p50_ms, single=ceiling.single_image_ms, ratio=ratio)
        out.append(Target(name, measured, _status(ratio <= 1.3), why))
    return out


def _latency_why(results: Results, row: LoadRow, ceiling: PhotoCeiling) -> str:
    parts = [say(text.WHY_CEILING_SINGLE, single=ceiling.single_image_ms)]
    stats = row.triton or {}
    if stats:
        queue = sum(s.get("queue_ms_per_request", 0.0) for s in stats.values())
        parts.append(say(text.WHY_QUEUES, queue=queue))
        outside = stats.get("face_pipeline", {}).get("outside_models_ms_per_image")
        if outside is not None:
            parts.append(say(text.WHY_PIPELINE_OUTSIDE, outside=outside,
                             inprocess=ceiling.best_split.outside_models_ms))
        compute = sum(stats[m].get("compute_ms_per_item", 0.0) for m in ("face_detector", "face_embedder")
                      if m in stats)
        inprocess = sum(ceiling.best_split.stages_ms[s] for s in ceiling_part.MODEL_STAGES)
        parts.append(say(text.WHY_NETWORKS, stubs=compute, inprocess=inprocess))
    if row.target == REST:
        grpc = find(results.stack, GRPC, row.photo, 1)
        if grpc:
            parts.append(say(text.WHY_GATEWAY, extra=row.p50_ms - grpc.p50_ms))
    return "; ".join(parts) + "."


def _memory(results: Results) -> list[Target]:
    memory, out = results.memory, []
    for process, label in text.MEMORY_LABELS.items():
        name = say(text.TARGET_MEMORY, label=label, c=memory.concurrency if memory else TARGET_CONCURRENCY,
                   minutes=memory.minutes if memory else "?")
        flat = memory.flatness(process) if memory and process in memory.rss_mib else {}
        if not flat:
            out.append(_not_measured(name, results, ("memory", "stack")))
            continue
        ok = flat["max_deviation_pct"] <= 10
        why = "" if ok else say(text.WHY_MEMORY, start=flat["start"], max=flat["max"],
                                slope=flat["slope_mib_per_min"])
        if not ok and process == "triton" and memory and memory.breakdown_mib:
            biggest = sorted(memory.breakdown_mib.items(), key=lambda kv: -kv[1])[:3]
            why += say(text.WHY_MEMORY_LARGEST,
                       processes=", ".join(say(text.PROCESS_MIB, name=k, mib=v) for k, v in biggest))
        measured = say(text.MEASURED_MEMORY, start=flat["start"], end=flat["end"],
                       deviation=flat["max_deviation_pct"])
        out.append(Target(name, measured, _status(ok), _sentence(why)))
    return out


def targets(results: Results) -> list[Target]:
    return [_vs_ceiling(results), *_vs_baselines(results), *_outside_models(results), *_latency(results),
            *_memory(results)]


def target_table(items: Sequence[Target]) -> str:
    return markdown_table(("target", "measured", "result", "why, when short"),
                          [(t.name, t.measured, f"**{t.status}**", t.why or "—") for t in items])
