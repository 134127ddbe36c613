"""The serving report: ratios between the parts of one run, the targets, the plots, the Markdown.

Every comparison is a ratio of two numbers measured in the same ``python -m bench`` run on the same
machine. Targets are reported (measured value, pass / falls short, and why), never asserted.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import ceiling as ceiling_part
from bench import naive as naive_part
from bench import perf_analyzer as pa_part
from bench import stack as stack_part
from bench.ceiling import PhotoCeiling
from bench.core.load import LoadRow
from bench.core.reporting import markdown_table, read_section, usable_cores, write_section
from bench.perf_analyzer import PaResult
from bench.stack import GRPC, REST, MemoryRun

ONE_FACE, SIX_FACES = "obama.jpg", "t1.jpg"
TARGET_CONCURRENCY = 8
SECTION = "bench"
PLOTS = {"throughput": "throughput.png", "latency": "latency.png", "memory": "memory.png"}


@dataclass
class Results:
    """Everything one ``python -m bench`` run measured (JSON-ready through ``to_json``)."""

    command: str
    date: str
    machine: str
    settings: dict[str, Any]
    served: str = ""  # the model repository's configuration (instances, batching, threads)
    ceiling: list[PhotoCeiling] = field(default_factory=list)
    naive: list[LoadRow] = field(default_factory=list)  # the naive baseline with the served settings
    naive_plain: list[LoadRow] = field(default_factory=list)  # ... fixed 640x640, PReLU embedder
    plain_check: str = ""  # bench.plain: the plain embedder equals the served one (PlainModels.describe)
    naive_agreement: str = ""  # faces and embeddings of the two naive variants (naive.agreement)
    stack: list[LoadRow] = field(default_factory=list)
    perf_analyzer: list[PaResult] = field(default_factory=list)
    memory: MemoryRun | None = None
    gallery: str = ""  # the gallery benchmark's Markdown tables
    enroll: str = ""
    errors: dict[str, str] = field(default_factory=dict)  # part -> why it failed
    seconds: dict[str, float] = field(default_factory=dict)  # wall time per part

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["ceiling"] = ceiling_part.to_json(self.ceiling)
        return out


# --- lookups ------------------------------------------------------------------------------------------


def find(rows: Sequence[LoadRow], target: str, photo: str, concurrency: int) -> LoadRow | None:
    return next((r for r in rows if r.target == target and r.photo == photo and r.concurrency == concurrency),
                None)


def best_naive(rows: Sequence[LoadRow], photo: str, concurrency: int | None) -> LoadRow | None:
    """The naive run with the highest throughput (at ``concurrency``, or at any)."""
    candidates = [r for r in rows
                  if r.photo == photo and (concurrency is None or r.concurrency == concurrency)]
    return max(candidates, key=lambda r: r.throughput, default=None)


def peak(rows: Sequence[LoadRow], target: str, photo: str) -> LoadRow | None:
    return max((r for r in rows if r.target == target and r.photo == photo), key=lambda r: r.throughput,
               default=None)


def served_ceiling(results: Results, photo: str) -> PhotoCeiling | None:
    return ceiling_of(results, photo, "served")


def ceiling_of(results: Results, photo: str, variant: str) -> PhotoCeiling | None:
    return next((c for c in results.ceiling if c.photo == photo and c.variant == variant), None)


#: The two naive baselines (bench/plain.py): the served settings (the same work as the stack) and the plain
#: deployment of the same networks (fixed 640x640 detector input, SFace with PReLU).
NAIVE_SERVED, NAIVE_PLAIN = "naive served", "naive plain"


def baselines(results: Results) -> tuple[tuple[str, list[LoadRow]], ...]:
    return (NAIVE_SERVED, results.naive), (NAIVE_PLAIN, results.naive_plain)


# --- ratios -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ratio:
    name: str
    value: float
    numerator: str
    denominator: str


def ratios(results: Results) -> list[Ratio]:
    out: list[Ratio] = []
    c = TARGET_CONCURRENCY

    def add(name: str, num: float | None, num_text: str, den: float | None, den_text: str) -> None:
        if num is not None and den:
            out.append(Ratio(name, num / den, num_text, den_text))

    for photo in (ONE_FACE, SIX_FACES):
        ceiling = served_ceiling(results, photo)
        limit = ceiling.images_per_s if ceiling else None
        limit_text = f"ceiling {limit:.1f} images/s" if limit else ""
        for target in (REST, GRPC):
            row = find(results.stack, target, photo, c)
            if row:
                add(f"{target} / ceiling, {photo}, concurrency {c}", row.throughput,
                    f"{row.throughput:.1f} images/s", limit, limit_text)
        for baseline, naive_rows in baselines(results):
            naive = best_naive(naive_rows, photo, c)
            if naive:
                add(f"{baseline} / ceiling, {photo}, concurrency {c}", naive.throughput,
                    f"{naive.throughput:.1f} images/s ({naive.target})", limit, limit_text)
                for target in (REST, GRPC):
                    row = find(results.stack, target, photo, c)
                    if row:
                        add(f"{target} / {baseline}, {photo}, concurrency {c}", row.throughput,
                            f"{row.throughput:.1f} images/s", naive.throughput,
                            f"{naive.throughput:.1f} images/s ({naive.target})")
            top_naive = best_naive(naive_rows, photo, None)
            for target in (REST, GRPC):
                top = peak(results.stack, target, photo)
                if top and top_naive:
                    add(f"{target} / {baseline}, {photo}, best concurrency of each", top.throughput,
                        f"{top.throughput:.1f} images/s at {top.concurrency}", top_naive.throughput,
                        f"{top_naive.throughput:.1f} images/s at {top_naive.concurrency} "
                        f"({top_naive.target})")
        served, plain = best_naive(results.naive, photo, c), best_naive(results.naive_plain, photo, c)
        if served and plain:
            add(f"{NAIVE_SERVED} / {NAIVE_PLAIN}, {photo}, concurrency {c} (the work reductions alone)",
                served.throughput, f"{served.throughput:.1f} images/s ({served.target})", plain.throughput,
                f"{plain.throughput:.1f} images/s ({plain.target})")
        rest, grpc = find(results.stack, REST, photo, c), find(results.stack, GRPC, photo, c)
        if rest and grpc:
            add(f"{REST} / {GRPC}, {photo}, concurrency {c} (the gateway's cost)", rest.throughput,
                f"{rest.throughput:.1f} images/s", grpc.throughput, f"{grpc.throughput:.1f} images/s")
        if ceiling:
            for target in (REST, GRPC):
                row = find(results.stack, target, photo, 1)
                if row:
                    add(f"{target} p50 at concurrency 1 / ceiling single image, {photo}", row.p50_ms,
                        f"{row.p50_ms:.1f} ms", ceiling.single_image_ms,
                        f"{ceiling.single_image_ms:.1f} ms")
    for result in results.perf_analyzer:
        for pa in result.rows:
            ours = find(results.stack, GRPC, result.photo, pa.concurrency)
            if ours:
                add(f"perf_analyzer / this benchmark's gRPC client, {result.photo}, "
                    f"concurrency {pa.concurrency}", pa.throughput, f"{pa.throughput:.1f} images/s",
                    ours.throughput, f"{ours.throughput:.1f} images/s")
    return out


def ratio_table(items: Sequence[Ratio]) -> str:
    return markdown_table(("ratio", "value", "numerator", "denominator"),
                          [(r.name, f"{r.value:.2f}", r.numerator, r.denominator) for r in items])


# --- targets ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    name: str
    measured: str
    status: str  # "pass", "falls short", "not measured"
    why: str = ""


def _status(ok: bool) -> str:
    return "pass" if ok else "falls short"


def _cpu_line(row: LoadRow) -> str:
    parts = [f"load client {row.client_cpu_ms:.0f}"] + [f"{k} {v:.0f}" for k, v in row.cpu_ms.items()]
    return f"{row.cpu_ms_total:.0f} ms CPU per image ({', '.join(parts)})"


def _throughput_why(row: LoadRow, reference: float, reference_cpu: float, reference_name: str) -> str:
    cores = usable_cores()
    bound = cores * 1000 / max(row.cpu_ms_total, 1e-9)
    why = (f"{row.target} cost {_cpu_line(row)}; {reference_name} cost {reference_cpu:.0f} ms CPU per image "
           f"({reference:.1f} images/s). With {cores} cores busy, throughput is about {cores} x 1000 / "
           f"CPU ms per image (here {bound:.1f} images/s)")
    biggest = sorted(row.cpu_detail_ms.items(), key=lambda kv: -kv[1])[:3]
    if biggest:
        why += "; the largest Triton consumers: " + ", ".join(f"{k.split(': ')[-1]} {v:.0f} ms"
                                                              for k, v in biggest)
    share = row.client_cpu_ms / max(row.cpu_ms_total, 1e-9)
    if share > 0.1:
        why += f"; the load generator runs on the same cores and takes {share:.0%} of that CPU"
    return why + "."


def _split_why(split: ceiling_part.StageSplit) -> str:
    stages = sorted(((ms, name) for name, ms in split.stages_ms.items()
                     if name not in ceiling_part.MODEL_STAGES), reverse=True)
    return ", ".join(f"{name} {ms:.1f} ms" for ms, name in stages[:3])


def targets(results: Results) -> list[Target]:
    out: list[Target] = []
    c = TARGET_CONCURRENCY
    ceiling = served_ceiling(results, ONE_FACE)
    rest = find(results.stack, REST, ONE_FACE, c)

    # 1. REST identify at concurrency 8 vs the in-process ceiling.
    name = f"REST identify throughput at concurrency {c} >= 85 % of the in-process ceiling (1 face)"
    if rest and ceiling and ceiling.best_layout:
        share = rest.throughput / ceiling.images_per_s
        why = "" if share >= 0.85 else _throughput_why(rest, ceiling.images_per_s,
                                                       ceiling.best_layout.cpu_ms_per_image,
                                                       f"the ceiling ({ceiling.best_layout.label})")
        out.append(Target(name, f"{rest.throughput:.1f} / {ceiling.images_per_s:.1f} images/s = {share:.0%}",
                          _status(share >= 0.85), why))
    else:
        out.append(Target(name, "—", "not measured", _missing(results, ("stack", "ceiling"))))

    # 2./3. REST identify vs the naive baselines: 0.95x the served-settings one (the same work, so this is
    # the serving overhead), 1.5x the plain one (the obvious deployment: less work counts).
    served_naive = best_naive(results.naive, ONE_FACE, c)
    plain_naive = best_naive(results.naive_plain, ONE_FACE, c)
    pairs = ((0.95, served_naive, BASELINE_SERVED), (1.5, plain_naive, BASELINE_PLAIN))
    for factor, naive, baseline in pairs:
        name = f"REST identify throughput at concurrency {c} >= {factor}x {baseline} (1 face)"
        if rest and naive:
            ratio = rest.throughput / naive.throughput
            why = ""
            if ratio < factor:
                why = _throughput_why(rest, naive.throughput, naive.cpu_ms_total, naive.target)
                if ceiling and ceiling.layouts and naive.throughput * factor > ceiling.images_per_s:
                    why += (f" {factor}x this baseline is {naive.throughput * factor:.1f} images/s, above "
                            f"the in-process ceiling with the served settings ({ceiling.images_per_s:.1f} "
                            "images/s), so no server on this machine reaches it: on CPU cores there is no "
                            "idle accelerator for batching to fill.")
                if naive is plain_naive and served_naive:
                    why += (f" The work reductions alone make the naive app "
                            f"{served_naive.throughput / naive.throughput:.2f}x faster ({NAIVE_SERVED} "
                            f"{served_naive.throughput:.1f} images/s).")
            out.append(Target(name, f"{rest.throughput:.1f} / {naive.throughput:.1f} images/s = {ratio:.2f}x "
                              f"({naive.target}; obama.jpg; same run)", _status(ratio >= factor), why))
        else:
            out.append(Target(name, "—", "not measured", _missing(results, ("stack", "naive"))))

    # 4. face_pipeline time outside the two networks.
    split = ceiling.best_split if ceiling and ceiling.splits else None
    for concurrency in (1, c):
        grpc = find(results.stack, GRPC, ONE_FACE, concurrency)
        stats = (grpc.triton or {}).get("face_pipeline", {}) if grpc else {}
        name = ("face_pipeline time outside the two models <= 3 ms per 1-face image (Triton statistics, "
                f"gRPC, concurrency {concurrency})")
        if "outside_models_ms_per_image" in stats:
            value = stats["outside_models_ms_per_image"]
            why = ""
            if value > 3:
                why = (f"pipeline compute {stats['compute_ms_per_item']:.1f} ms per image minus "
                       f"{stats['models_ms_per_image']:.1f} ms of detector + embedder requests")
                if split:
                    own = value - split.outside_models_ms
                    why += (f"; in-process the same steps take {split.outside_models_ms:.1f} ms "
                            f"({_split_why(split)}), so {own:.1f} ms are Triton's own: BLS round trips to "
                            "two models, tensor copies through shared memory between the stub processes, the "
                            "Python-backend stub's request/response handling (and, above concurrency 1, "
                            "CPU contention with the other stubs)")
            out.append(Target(name, f"{value:.1f} ms", _status(value <= 3), why + ("." if why else "")))
        else:
            out.append(Target(name, "—", "not measured", _missing(results, ("stack",))))
    name = "face_pipeline steps outside the two models <= 3 ms per 1-face image (in-process timer split)"
    if split:
        value = split.outside_models_ms
        why = "" if value <= 3 else f"largest steps: {_split_why(split)}."
        out.append(Target(name, f"{value:.1f} ms ({split.threads} thread(s))", _status(value <= 3), why))
    else:
        out.append(Target(name, "—", "not measured", _missing(results, ("ceiling",))))

    # 5. p50 latency at concurrency 1.
    for target in (REST, GRPC):
        row = find(results.stack, target, ONE_FACE, 1)
        name = f"{target} p50 latency at concurrency 1 <= 1.3x the ceiling's single-image time (1 face)"
        if row and ceiling:
            ratio = row.p50_ms / ceiling.single_image_ms
            why = ""
            if ratio > 1.3:
                why = _latency_why(results, row, ceiling)
            out.append(Target(name, f"{row.p50_ms:.1f} / {ceiling.single_image_ms:.1f} ms = {ratio:.2f}x",
                              _status(ratio <= 1.3), why))
        else:
            out.append(Target(name, "—", "not measured", _missing(results, ("stack", "ceiling"))))

    # 6. memory.
    for process in ("gateway", "triton"):
        label = "gateway" if process == "gateway" else "Triton (server + Python-backend stubs)"
        memory = results.memory
        name = (f"{label} resident memory flat (+-10 %) across the memory run (REST identify, concurrency "
                f"{memory.concurrency if memory else c}, {memory.minutes if memory else '?'} min)")
        flat = memory.flatness(process) if memory and process in memory.rss_mib else {}
        if flat:
            ok = flat["max_deviation_pct"] <= 10
            why = "" if ok else (f"grew from {flat['start']:.0f} to {flat['max']:.0f} MiB at most "
                                 f"(trend {flat['slope_mib_per_min']:+.1f} MiB/min)")
            if not ok and process == "triton" and memory and memory.breakdown_mib:
                biggest = sorted(memory.breakdown_mib.items(), key=lambda kv: -kv[1])[:3]
                why += "; largest at the end: " + ", ".join(f"{k} {v:.0f} MiB" for k, v in biggest)
            out.append(Target(name, f"{flat['start']:.0f} -> {flat['end']:.0f} MiB, largest deviation "
                              f"{flat['max_deviation_pct']:.1f} %", _status(ok), why + ("." if why else "")))
        else:
            out.append(Target(name, "—", "not measured", _missing(results, ("memory", "stack"))))
    return out


BASELINE_SERVED = "the naive baseline with the served settings (same work: measures serving overhead)"
BASELINE_PLAIN = ("the plain naive baseline (fixed 640x640 detector input, SFace with PReLU: beat the plain "
                  "approach by doing less work)")


def _latency_why(results: Results, row: LoadRow, ceiling: PhotoCeiling) -> str:
    parts = [f"the ceiling's single image is {ceiling.single_image_ms:.1f} ms"]
    stats = row.triton or {}
    queue = sum(s.get("queue_ms_per_request", 0.0) for s in stats.values())
    if stats:
        parts.append(f"Triton queues add {queue:.1f} ms (dynamic-batching delays of face_pipeline, "
                     "face_detector and face_embedder, which wait for a fuller batch even when alone)")
        outside = stats.get("face_pipeline", {}).get("outside_models_ms_per_image")
        if outside is not None:
            parts.append(f"face_pipeline spends {outside:.1f} ms outside the networks "
                         f"(in-process: {ceiling.best_split.outside_models_ms:.1f} ms)")
        compute = sum(stats[m].get("compute_ms_per_item", 0.0) for m in ("face_detector", "face_embedder")
                      if m in stats)
        parts.append(f"the networks take {compute:.1f} ms in the stubs vs "
                     f"{sum(ceiling.best_split.stages_ms[s] for s in ceiling_part.MODEL_STAGES):.1f} ms "
                     "in-process")
    if row.target == REST:
        grpc = find(results.stack, GRPC, row.photo, 1)
        if grpc:
            parts.append("the gateway (HTTP, multipart, gallery search, JSON) adds "
                         f"{row.p50_ms - grpc.p50_ms:.1f} ms over gRPC")
    return "; ".join(parts) + "."


def _missing(results: Results, parts: Sequence[str]) -> str:
    failed = [f"{name}: {error}" for name, error in results.errors.items() if any(p in name for p in parts)]
    return "; ".join(failed) if failed else "not part of this run"


def target_table(items: Sequence[Target]) -> str:
    return markdown_table(("target", "measured", "result", "why, when short"),
                          [(t.name, t.measured, f"**{t.status}**", t.why or "—") for t in items])


# --- plots ----------------------------------------------------------------------------------------------


def plots(results: Results, out: Path) -> dict[str, str]:
    """PNG plots into ``out``; returns {plot: file name} or {"error": why} when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return {"error": f"plots skipped: {exc} (install the `bench` extra: matplotlib)"}
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, str] = {}
    series = _series(results)

    if series:
        photos = [p for p in (ONE_FACE, SIX_FACES) if any(key[1] == p for key in series)]
        fig, axes = plt.subplots(1, len(photos), figsize=(6.5 * len(photos), 4.5), squeeze=False)
        for ax, photo in zip(axes[0], photos, strict=True):
            for (target, p), rows in series.items():
                if p == photo:
                    ax.plot([r[0] for r in rows], [r[1] for r in rows], marker="o", label=target)
            ceiling = served_ceiling(results, photo)
            if ceiling and ceiling.layouts:
                ax.axhline(ceiling.images_per_s, color="black", linestyle="--",
                           label=f"in-process ceiling ({ceiling.images_per_s:.1f})")
            ax.set(xscale="log", xlabel="concurrency (requests in flight)", ylabel="images/s", title=photo)
            ax.set_xticks([1, 2, 4, 8, 16], labels=["1", "2", "4", "8", "16"])
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle("Throughput vs concurrency (same machine, same run)")
        fig.tight_layout()
        fig.savefig(out / PLOTS["throughput"], dpi=110)
        plt.close(fig)
        written["throughput"] = PLOTS["throughput"]

    latency_rows = [r for r in [*results.stack, *results.naive, *results.naive_plain] if r.photo == ONE_FACE]
    if latency_rows:
        names = list(dict.fromkeys(r.target for r in latency_rows))
        fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 4.2), squeeze=False, sharey=True)
        ceiling = served_ceiling(results, ONE_FACE)
        for ax, target in zip(axes[0], names, strict=True):
            runs = sorted((r for r in latency_rows if r.target == target), key=lambda r: r.concurrency)
            for attribute, label in (("p50_ms", "p50"), ("p90_ms", "p90"), ("p99_ms", "p99")):
                ax.plot([r.concurrency for r in runs], [getattr(r, attribute) for r in runs], marker="o",
                        label=label)
            if ceiling and ceiling.splits:
                ax.axhline(ceiling.single_image_ms, color="black", linestyle="--",
                           label="ceiling, single image")
            ax.set(xscale="log", xlabel="concurrency", title=target)
            ax.set_xticks([1, 2, 4, 8, 16], labels=["1", "2", "4", "8", "16"])
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        axes[0][0].set_ylabel("latency ms")
        fig.suptitle(f"Latency percentiles vs concurrency ({ONE_FACE})")
        fig.tight_layout()
        fig.savefig(out / PLOTS["latency"], dpi=110)
        plt.close(fig)
        written["latency"] = PLOTS["latency"]

    memory = results.memory
    if memory and memory.times_s:
        fig, axes = plt.subplots(len(memory.rss_mib), 1, figsize=(8, 2.6 * len(memory.rss_mib)), sharex=True,
                                 squeeze=False)
        for ax, (process, values) in zip(axes[:, 0], memory.rss_mib.items(), strict=True):
            ax.plot([t / 60 for t in memory.times_s], values, marker=".", linewidth=1)
            start = values[0] if values else 0
            ax.axhspan(start * 0.9, start * 1.1, color="green", alpha=0.08, label="start +-10 %")
            ax.set(ylabel="RSS MiB", title="Triton (server + stubs)" if process == "triton" else process)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8, loc="lower right")
        axes[-1][0].set_xlabel("minutes")
        fig.suptitle(f"Resident memory, REST identify at concurrency {memory.concurrency}")
        fig.tight_layout()
        fig.savefig(out / PLOTS["memory"], dpi=110)
        plt.close(fig)
        written["memory"] = PLOTS["memory"]
    return written


def _series(results: Results) -> dict[tuple[str, str], list[tuple[int, float]]]:
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for row in [*results.stack, *results.naive, *results.naive_plain]:
        series.setdefault((row.target, row.photo), []).append((row.concurrency, row.throughput))
    for result in results.perf_analyzer:
        for pa in result.rows:
            series.setdefault((f"perf_analyzer (gRPC, {GRPC.split()[1]})", result.photo), []).append(
                (pa.concurrency, pa.throughput))
    return {key: sorted(values) for key, values in series.items()}


# --- the document ---------------------------------------------------------------------------------------

HOW_TO_READ = """\
**How to read this.** All numbers come from one run of the command above on the machine described. The
ceiling runs alone; naive, REST identify and gRPC face_pipeline alternate at every concurrency (the
servers not under load sit idle), so a slow drift of the machine hits them alike. *Ceiling*: the two
networks and the pre/post-processing in-process, best batch sizes and thread layout: what a perfect
server could do.
*Naive*: one FastAPI process doing decode -> detect -> align -> embed per request in its thread pool,
with the served settings (*naive served*) or the plain ones (*naive plain*; see the two baselines above).
*REST identify* goes through the whole stack (gateway: API key, multipart, `face_pipeline` over gRPC,
FAISS search, JSON); *gRPC face_pipeline* is the call the gateway makes, sent by this process directly.
Closed loop: each of N client threads sends its next request when the previous one returns. The load
generator runs on the same cores as the servers: its CPU per request is reported, and it is part of
every figure (the naive baseline and the stack pay for it alike). Triton statistics are deltas over each
run: *avg batch* is items per execution; *queue* and *request* times are per request; *compute per
execution* comes from the batch statistics (per-request compute counts a batch's time once per member).
*Outside the networks* is face_pipeline's execution time minus the detector and embedder request
times its BLS calls waited for, per image.
"""


def _at_one_thread(sweep: dict[int, dict[int, float]]) -> tuple[int, float] | None:
    """(threads, ms per item at batch 1) with the fewest threads measured: what the naive app pays."""
    if not sweep:
        return None
    threads = min(sweep)
    return (threads, sweep[threads][1]) if 1 in sweep[threads] else None


def _detector_text(results: Results) -> str:
    parts, threads = [], None
    for photo in (ONE_FACE, SIX_FACES):
        served, plain = ceiling_of(results, photo, "served"), ceiling_of(results, photo, "plain")
        if not (served and plain):
            continue
        (w, h), (pw, ph) = served.input_size, plain.input_size
        text = f"{served.label} {w}x{h} instead of {pw}x{ph}: {1 - w * h / (pw * ph):.0%} fewer pixels"
        a, b = _at_one_thread(served.detector_ms), _at_one_thread(plain.detector_ms)
        if a and b:
            text += f", detector {a[1]:.1f} instead of {b[1]:.1f} ms per image"
            threads = a[0]
        parts.append(text)
    if not parts:
        return ""
    return "; ".join(parts) + (f" (batch 1, {threads} thread(s))" if threads else "")


def _embedder_text(results: Results) -> str:
    served = next((c for c in results.ceiling if c.variant == "served"), None)
    plain = next((c for c in results.ceiling if c.variant == "plain"), None)
    a = _at_one_thread(served.embedder_ms) if served else None
    b = _at_one_thread(plain.embedder_ms) if plain else None
    if not (a and b):
        return ""
    return (f"{a[1]:.1f} instead of {b[1]:.1f} ms per face, {1 - a[1] / b[1]:.0%} less "
            f"(batch 1, {a[0]} thread(s))")


def baselines_text(results: Results) -> str:
    """What each naive baseline runs, which target uses which, and where the work reduction comes from
    (with this run's numbers where they were measured)."""
    c = TARGET_CONCURRENCY
    check = f" {results.plain_check}." if results.plain_check else ""
    lines = [
        "Both are `bench/naive_app.py` (one FastAPI process: decode -> detect -> align -> embed per request, "
        "batch 1, 1 ONNX Runtime intra-op thread per session), measured at the same concurrencies and "
        "alternating with the stack.",
        "",
        f"- **{NAIVE_SERVED}** runs exactly what `face_pipeline` serves, work reductions included: the same "
        "work as the stack, so REST identify / naive served measures the serving overhead. The >= 0.95x "
        "target uses it.",
        f"- **{NAIVE_PLAIN}** runs the same two networks the obvious way: every image letterboxed to the "
        "fixed 640x640 detector input (`dynamic_input=False`, full-size decode) and SFace converted from the "
        "pinned int8 file without the PReLU rewrite (`bench/plain.py`)." + check + " The >= 1.5x target "
        "uses it: beat the plain approach by doing less work, with unchanged decisions.",
        "",
        "The work reduction has two sources, both visible in the ceiling tables (the served rows against the "
        "*fixed 640x640* and *PReLU embedder* rows, and the two embedder sweeps):",
        "",
    ]
    detector, embedder = _detector_text(results), _embedder_text(results)
    lines.append("- **detector input sized to the image**: fewer pixels per image"
                 + (f"; {detector}" if detector else "") + ".")
    lines.append("- **the PReLU rewrite** (`Relu(x) - a * Relu(-x)`, exact; ONNX Runtime runs SFace's "
                 "per-channel PRelu as a slow broadcast with layout reorders around it): fewer embedder ms "
                 "per face" + (f"; {embedder}" if embedder else "") + ".")
    served, plain = best_naive(results.naive, ONE_FACE, c), best_naive(results.naive_plain, ONE_FACE, c)
    if served and plain:
        lines.append(f"- together, in the naive app: {served.throughput / plain.throughput:.2f}x at "
                     f"concurrency {c} ({served.throughput:.1f} instead of {plain.throughput:.1f} images/s, "
                     f"{ONE_FACE}).")
    if results.naive_agreement:
        lines.append(f"- the same decisions: {results.naive_agreement}.")
    return "\n".join(lines)


def _load_sections(results: Results) -> list[str]:
    parts = []
    if results.naive or results.naive_plain:
        parts += ["### Naive baselines (`bench/naive_app.py`, `bench/naive.py`)",
                  naive_part.load_table([*results.naive, *results.naive_plain])]
    if results.stack:
        parts += ["### Our stack (`bench/stack.py`)", stack_part.load_table(results.stack),
                  "CPU milliseconds per request, by process (the Triton tree: the server and one "
                  "Python-backend stub process per model instance):", stack_part.cpu_table(results.stack),
                  "Triton statistics per model (deltas over each run):",
                  stack_part.stats_table(results.stack)]
    if results.perf_analyzer:
        first = results.perf_analyzer[0]
        parts += ["### perf_analyzer against face_pipeline (`bench/perf_analyzer.py`)",
                  f"{first.version or 'perf_analyzer'} from the `tritonclient==2.51.0` wheel (sha256 "
                  f"`{pa_part.WHEEL.sha256}`), real JPEG input data, gRPC. Command per concurrency: "
                  f"`{first.command}`", pa_part.table(results.perf_analyzer)]
    return parts


def document(results: Results, written: dict[str, str]) -> str:
    parts = ["## Serving: ceiling, naive baseline, our stack, perf_analyzer, memory (`python -m bench`)",
             f"Command: `{results.command}`  \nDate: {results.date}  \nMachine: {results.machine}  \n"
             f"Run: {', '.join(f'{k} {v}' for k, v in results.settings.items())}  \n"
             f"Served (model_repository): {results.served or 'unknown'}  \n"
             f"Wall time per part: {', '.join(f'{k} {v / 60:.1f} min' for k, v in results.seconds.items())}"]
    if results.errors:
        parts.append("**Parts that failed in this run:**\n\n" + "\n".join(
            f"- {part}: `{error}`" for part, error in results.errors.items()))
    parts += ["### Targets (reported, not asserted)", target_table(targets(results))]
    if results.naive or results.naive_plain:
        parts += ["### The two naive baselines", baselines_text(results)]
    parts += ["### Ratios (both sides measured in this run)", ratio_table(ratios(results))]
    if "error" in written:
        parts.append(f"*{written['error']}*")
    pictures = [f"![{name}]({file})" for name, file in written.items() if name in PLOTS]
    if pictures:
        parts.append("\n".join(pictures))
    if results.ceiling:
        parts.append(ceiling_part.document(results.ceiling))
    parts += _load_sections(results)
    if results.memory:
        memory = results.memory
        parts += [f"### Memory: REST identify at concurrency {memory.concurrency} for {memory.minutes:g} min",
                  f"Resident memory sampled every {memory.interval_s:.1f} s after a {memory.warmup_s:.0f} s "
                  f"warm-up at the same load ({len(memory.times_s)} samples; {memory.load.requests} "
                  f"requests, {memory.load.throughput:.1f} images/s, {memory.load.errors} errors). The "
                  "Triton figure sums the server and its Python-backend stub processes (shared pages count "
                  "once per process).",
                  stack_part.memory_table(memory),
                  "Triton's processes at the end: " + ", ".join(
                      f"{k} {v:.0f} MiB"
                      for k, v in sorted(memory.breakdown_mib.items(), key=lambda kv: -kv[1]))]
    if results.gallery:
        parts += ["### Gallery search scaling (`bench/gallery.py`; details in [gallery.md](gallery.md))",
                  results.gallery]
    if results.enroll:
        parts += ["### Enrollment throughput (`bench/enroll.py`; details in [gallery.md](gallery.md))",
                  results.enroll]
    parts.append(HOW_TO_READ.strip())
    return "\n\n".join(parts)


def write(results: Results, out: Path) -> Path:
    """Plots, ``results.json`` and this run's section of ``out/README.md``; returns the README path."""
    out.mkdir(parents=True, exist_ok=True)
    written = plots(results, out)
    readme = out / "README.md"
    write_section(readme, SECTION, document(results, written))
    (out / "results.json").write_text(json.dumps(results.to_json(), indent=2, default=str))
    return readme


def section(text: str, name: str = SECTION) -> str:
    """The text between this report's markers (for tests and tools)."""
    return read_section(text, name)

