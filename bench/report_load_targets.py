"""The serving report's targets for behaviour under load: latency at concurrency 1, throughput holding at
concurrency 16, the latency tail, Triton's and the gateway's resident memory, the gateway's CPU per
request. Reported, never asserted; the wording is in ``bench/report_text.py``."""

from __future__ import annotations

from math import isnan, nan

from bench import ceiling as ceiling_part
from bench import report_text as text
from bench.ceiling import PhotoCeiling
from bench.core.load import LoadRow
from bench.report_checks import Target, not_measured, sentence, status
from bench.report_text import say
from bench.results import (
    HIGH_CONCURRENCY,
    ONE_FACE,
    SIX_FACES,
    TARGET_CONCURRENCY,
    Results,
    find,
    peak,
    served_ceiling,
)
from bench.stack import GRPC, REST

#: The limits of issue 10's load targets.
LATENCY_FACTOR = 1.3  # p50 at concurrency 1 / the ceiling's single image
HOLD_SHARE = 0.95  # throughput at concurrency 16 / at the best concurrency
TAIL_FACTOR = 3.0  # p99 / p50 at concurrency 8
TRITON_RSS_MIB = 1.5 * 1024  # the Triton tree at concurrency 16
FLAT_PCT = 10.0  # largest deviation from the start of the memory run
GATEWAY_CPU_MS = 3.0  # gateway CPU per identify at concurrency 8


def latency(results: Results) -> list[Target]:
    """p50 at concurrency 1 over the ceiling's single image: from the paired rounds (``bench/latency.py``:
    both measured in turn, so the machine's drift falls on both) when the run has them, else from the
    closed-loop run at concurrency 1 and the ceiling part, measured minutes apart."""
    ceiling = served_ceiling(results, ONE_FACE)
    paired = next((r for r in results.paired_latency if r.photo == ONE_FACE), None)
    out = []
    for target in (REST, GRPC):
        row = find(results.stack, target, ONE_FACE, 1)
        name = say(text.TARGET_LATENCY, target=target)
        if paired:
            p50, single = paired.p50_ms(target), paired.ceiling_ms
            measured = say(text.MEASURED_LATENCY_PAIRED, p50=p50, single=single, ratio=paired.ratio(target),
                           rounds=paired.rounds, paired=paired.paired(target))
            grpc_p50 = paired.p50_ms(GRPC)
        elif row and ceiling:
            p50, single = row.p50_ms, ceiling.single_image_ms
            measured = say(text.MEASURED_LATENCY, p50=p50, single=single, ratio=p50 / single)
            grpc = find(results.stack, GRPC, ONE_FACE, 1)
            grpc_p50 = grpc.p50_ms if grpc else nan
        else:
            out.append(not_measured(name, results, ("latency", "stack", "ceiling")))
            continue
        ratio = p50 / single
        why = _latency_why(target, p50, single, grpc_p50, row, ceiling) if ratio > LATENCY_FACTOR else ""
        out.append(Target(name, measured, status(ratio <= LATENCY_FACTOR), why))
    return out


def _latency_why(target: str, p50: float, single: float, grpc_p50: float, row: LoadRow | None,
                 ceiling: PhotoCeiling | None) -> str:
    """Where a short latency goes: Triton's queues and the networks from the closed-loop row's statistics
    (when the run has them), the gateway as REST's p50 over gRPC's."""
    parts = [say(text.WHY_CEILING_SINGLE, single=single)]
    stats = (row.triton or {}) if row else {}
    if stats:
        queue = sum(s.get("queue_ms_per_request", 0.0) for s in stats.values())
        parts.append(say(text.WHY_QUEUES, queue=queue))
        outside = stats.get("face_pipeline", {}).get("outside_models_ms_per_image")
        if outside is not None and ceiling:
            parts.append(say(text.WHY_PIPELINE_OUTSIDE, outside=outside,
                             inprocess=ceiling.best_split.outside_models_ms))
        compute = sum(stats[m].get("compute_ms_per_item", 0.0) for m in ("face_detector", "face_embedder")
                      if m in stats and stats[m].get("items", 0.0) > 0)
        if compute > 0 and ceiling:  # the networks were called as models (the BLS layout)
            inprocess = sum(ceiling.best_split.stages_ms[s] for s in ceiling_part.MODEL_STAGES)
            parts.append(say(text.WHY_NETWORKS, stubs=compute, inprocess=inprocess))
    if target == REST and not isnan(grpc_p50):
        if p50 >= grpc_p50:
            parts.append(say(text.WHY_GATEWAY, extra=p50 - grpc_p50))
        else:  # a negative "adds" would be noise reported as a measurement
            parts.append(say(text.WHY_GATEWAY_NOISE, rest=p50, grpc=grpc_p50))
    return "; ".join(parts) + "."


def under_load(results: Results) -> list[Target]:
    """REST identify per photo: throughput at concurrency 16 against its best concurrency, and p99 against
    p50 at concurrency 8."""
    out = []
    for photo in (ONE_FACE, SIX_FACES):
        high, top = find(results.stack, REST, photo, HIGH_CONCURRENCY), peak(results.stack, REST, photo)
        name = say(text.TARGET_HOLDS, c=HIGH_CONCURRENCY, share=HOLD_SHARE, photo=photo)
        check = next((h for h in results.hold if h.photo == photo and h.high_concurrency == HIGH_CONCURRENCY),
                     None)
        if not (high and top):
            out.append(not_measured(name, results, ("stack",)))
        else:
            sweep = say(text.MEASURED_HOLDS, high=high.throughput, top=top.throughput, c=top.concurrency,
                        share=high.throughput / top.throughput)
            share = check.share if check else high.throughput / top.throughput
            measured = sweep if not check else say(
                text.MEASURED_HOLDS_ALTERNATING, share=share, high=HIGH_CONCURRENCY, c=check.best_concurrency,
                rounds=len(check.shares), seconds=check.seconds,
                shares=" / ".join(f"{s:.0%}" for s in check.shares), sweep=sweep)
            why = "" if share >= HOLD_SHARE else say(text.WHY_HOLDS, p50=high.p50_ms, p99=high.p99_ms,
                                                      errors=high.errors, rss=high.rss_mib.get("triton", 0.0))
            out.append(Target(name, measured, status(share >= HOLD_SHARE), why))
        row = find(results.stack, REST, photo, TARGET_CONCURRENCY)
        name = say(text.TARGET_TAIL, factor=TAIL_FACTOR, c=TARGET_CONCURRENCY, photo=photo)
        if not row:
            out.append(not_measured(name, results, ("stack",)))
            continue
        ratio = row.p99_ms / row.p50_ms
        why = "" if ratio <= TAIL_FACTOR else say(text.WHY_TAIL, p90=row.p90_ms, requests=row.requests,
                                                   seconds=row.seconds)
        out.append(Target(name, say(text.MEASURED_TAIL, p99=row.p99_ms, p50=row.p50_ms, ratio=ratio),
                          status(ratio <= TAIL_FACTOR), why))
    return out


def memory(results: Results) -> list[Target]:
    memory, out = results.memory, []
    for process, label in text.MEMORY_LABELS.items():
        name = say(text.TARGET_MEMORY, label=label, c=memory.concurrency if memory else HIGH_CONCURRENCY,
                   minutes=memory.minutes if memory else "?", pct=FLAT_PCT)
        flat = memory.flatness(process) if memory and process in memory.rss_mib else {}
        if not flat:
            out.append(not_measured(name, results, ("memory", "stack")))
            continue
        ok = flat["max_deviation_pct"] <= FLAT_PCT
        why = "" if ok else say(text.WHY_MEMORY, start=flat["start"], max=flat["max"],
                                slope=flat["slope_mib_per_min"])
        if not ok and process == "triton" and memory and memory.breakdown_mib:
            why += say(text.WHY_MEMORY_LARGEST, processes=_largest(memory.breakdown_mib))
        measured = say(text.MEASURED_MEMORY, start=flat["start"], end=flat["end"],
                       deviation=flat["max_deviation_pct"])
        out.append(Target(name, measured, status(ok), sentence(why)))
    return [*out, _triton_rss(results)]


def _largest(breakdown: dict[str, float]) -> str:
    biggest = sorted(breakdown.items(), key=lambda kv: -kv[1])[:3]
    return ", ".join(say(text.PROCESS_MIB, name=k, mib=v) for k, v in biggest)


def _triton_rss(results: Results) -> Target:
    """The Triton tree's resident memory at concurrency 16: the largest of the memory run's samples (when
    it ran at 16) and of the ends of the concurrency-16 load runs."""
    name = say(text.TARGET_TRITON_RSS, c=HIGH_CONCURRENCY, limit=TRITON_RSS_MIB / 1024)
    seen = {f"{r.target}, {r.photo}": r.rss_mib["triton"] for r in results.stack
            if r.concurrency == HIGH_CONCURRENCY and "triton" in r.rss_mib}
    memory = results.memory
    if memory and memory.concurrency == HIGH_CONCURRENCY and memory.rss_mib.get("triton"):
        run = say(text.MEMORY_RUN_SHAPES if memory.shapes > 1 else text.MEMORY_RUN, minutes=memory.minutes,
                  shapes=memory.shapes)
        seen[run] = max(memory.rss_mib["triton"])
    if not seen:
        return not_measured(name, results, ("stack", "memory"))
    where, value = max(seen.items(), key=lambda kv: kv[1])
    ok = value <= TRITON_RSS_MIB
    why = ""
    if not ok and memory and memory.breakdown_mib:
        why = sentence(say(text.WHY_TRITON_RSS, processes=_largest(memory.breakdown_mib)))
    return Target(name, say(text.MEASURED_TRITON_RSS, mib=value, where=where), status(ok), why)


def gateway_cpu(results: Results) -> list[Target]:
    """The gateway process's CPU seconds over a REST identify run / its requests, at concurrency 8."""
    out = []
    for photo in (ONE_FACE, SIX_FACES):
        row = find(results.stack, REST, photo, TARGET_CONCURRENCY)
        name = say(text.TARGET_GATEWAY_CPU, c=TARGET_CONCURRENCY, limit=GATEWAY_CPU_MS, photo=photo)
        if not (row and "gateway" in row.cpu_ms):
            out.append(not_measured(name, results, ("stack",)))
            continue
        value = row.cpu_ms["gateway"]
        grpc = find(results.stack, GRPC, photo, TARGET_CONCURRENCY)
        single = find(results.stack, REST, photo, 1)
        why = ""
        if value > GATEWAY_CPU_MS:
            why = say(text.WHY_GATEWAY_CPU, single=single.cpu_ms.get("gateway", nan) if single else nan,
                      grpc_client=grpc.client_cpu_ms if grpc else nan)
        out.append(Target(name, say(text.MEASURED_GATEWAY_CPU, ms=value, requests=row.requests),
                          status(value <= GATEWAY_CPU_MS), why))
    return out
