"""The serving report of ``python -m bench``: the targets and ratios, evaluated from the run's ``Results``,
and every part's figures, as Markdown tables between the markers of ``<out>/README.md``.

    python -m bench.report --rerender docs/benchmarks   # the section again from its runs/results.json

Every comparison is a ratio of two numbers measured in the same run; targets are reported, never
asserted. What the tables mean is written once, in docs/benchmarks/README.md.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.ceiling import STAGES, best
from bench.core.reporting import cli, markdown_table, table, write_section
from bench.latency import PairedLatency
from bench.results import (
    HIGH_CONCURRENCY,
    NAIVE,
    ONE_FACE,
    PHOTOS,
    SIX_FACES,
    C,
    Results,
    ceiling_of,
    find,
    load_row,
    peak,
)
from bench.stack import GRPC, REST, MemoryRun

SECTION = "bench"
RESULTS = Path("runs") / "results.json"


#: A figure read from the results (None: not measured in this run).
Quantity = Callable[[Results], float | None]
#: The value a target holds to its bound and how it was made ("114.7 / 142.0 images/s = 0.81"), or None.
Measure = Callable[[Results], tuple[float, str] | None]


def ratio(numerator: Quantity, denominator: Quantity, unit: str) -> Measure:
    def measure(results: Results) -> tuple[float, str] | None:
        a, b = numerator(results), denominator(results)
        return None if a is None or not b else (a / b, f"{a:.1f} / {b:.1f} {unit} = {a / b:.2f}")
    return measure


def amount(quantity: Quantity, unit: str) -> Measure:
    def measure(results: Results) -> tuple[float, str] | None:
        value = quantity(results)
        return None if value is None else (value, f"{value:.1f} {unit}")
    return measure


def _field(row: object | None, name: str) -> float | None:
    return None if row is None else float(getattr(row, name))


def throughput(name: str, photo: str) -> Quantity:
    return lambda r: _field(load_row(r, name, photo), "throughput")


def ceiling_rate(photo: str, variant: str = "served") -> Quantity:
    return lambda r: c.images_per_s if (c := ceiling_of(r, photo, variant)) and c.layouts else None


def outside_networks(concurrency: int) -> Quantity:
    """face_pipeline's time outside the two networks per image in Triton's statistics (gRPC, 1 face); None
    in the in_process layout, where Triton cannot tell the networks' time from face_pipeline's."""
    def get(results: Results) -> float | None:
        row = find(results.stack, GRPC, ONE_FACE, concurrency)
        return ((row.triton or {}) if row else {}).get("face_pipeline", {}).get("outside_models_ms_per_image")
    return get


def split_outside(results: Results) -> float | None:
    return c.best_split.outside_models_ms if (c := ceiling_of(results, ONE_FACE)) and c.splits else None


def p50_at_1(target: str, paired: bool) -> tuple[Quantity, Quantity]:
    """p50 at concurrency 1 and the ceiling's single image: from the paired rounds (``bench/latency.py``)
    or from the closed loop and the ceiling part, minutes apart."""
    if paired:
        def rounds(r: Results) -> PairedLatency | None:
            return next((x for x in r.paired_latency if x.photo == ONE_FACE), None)
        return ((lambda r: x.p50_ms(target) if (x := rounds(r)) else None),
                lambda r: _field(rounds(r), "ceiling_ms"))
    return (lambda r: _field(find(r.stack, target, ONE_FACE, 1), "p50_ms"),
            lambda r: c.single_image_ms if (c := ceiling_of(r, ONE_FACE)) and c.splits else None)


def latency(target: str) -> Measure:
    """The paired rounds' ratio when the run has them, else the closed loop's."""
    paired = ratio(*p50_at_1(target, True), "ms (paired rounds)")
    closed = ratio(*p50_at_1(target, False), "ms")
    return lambda r: paired(r) or closed(r)


def holds(photo: str) -> Measure:
    """REST identify at the high concurrency over its best: the alternating rounds' median
    (``stack.hold_check``) when the run has them, else the sweep's two windows."""
    sweep = ratio(lambda r: _field(find(r.stack, REST, photo, HIGH_CONCURRENCY), "throughput"),
                  lambda r: _field(peak(r.stack, REST, photo), "throughput"), "images/s")

    def measure(results: Results) -> tuple[float, str] | None:
        check = next((h for h in results.hold if (h.photo, h.high_concurrency) == (photo, HIGH_CONCURRENCY)),
                     None)
        if check is None:
            return sweep(results)
        return check.share, f"{check.share:.2f}, the median of {_joined(check.shares, '.2f')}"
    return measure


def tail(photo: str) -> Measure:
    return ratio(lambda r: _field(find(r.stack, REST, photo, C), "p99_ms"),
                 lambda r: _field(find(r.stack, REST, photo, C), "p50_ms"), "ms")


def memory_drift(process: str) -> Quantity:
    return lambda r: m.flatness(process)["max_deviation_pct"] if (m := r.memory) and m.rss_mib.get(process) \
        else None


def triton_pss(results: Results) -> float | None:
    """The largest Triton tree PSS at the high concurrency: the memory run's samples, the load runs' ends."""
    seen = [r.rss_mib["triton"] for r in results.stack
            if r.concurrency == HIGH_CONCURRENCY and "triton" in r.rss_mib]
    if (memory := results.memory) and memory.concurrency == HIGH_CONCURRENCY:
        seen += memory.rss_mib.get("triton", [])
    return max(seen, default=None)


def gateway_cpu(photo: str) -> Quantity:
    return lambda r: row.cpu_ms.get("gateway") if (row := find(r.stack, REST, photo, C)) else None


@dataclass(frozen=True)
class Target:
    """A figure of the run with the bound it is held to (None: a ratio reported without one)."""

    name: str
    measure: Measure
    bound: float | None = None
    at_most: bool = False  # the value must stay <= bound (else >= bound)


RUNTIME_FACTORS = {ONE_FACE: 1.3, SIX_FACES: 1.7}  # the served runtime's ceiling over ONNX Runtime's
PLAIN_FACTORS = {ONE_FACE: 1.6, SIX_FACES: 2.0}  # REST identify over the plain naive baseline
#: The targets of issue 10, in the order the report lists them.
TARGETS: tuple[Target, ...] = (
    *(Target(f"in-process ceiling, served runtime / ONNX Runtime on the same files, {p}",
             ratio(ceiling_rate(p), ceiling_rate(p, "onnxruntime"), "images/s"), RUNTIME_FACTORS[p])
      for p in PHOTOS),
    *(Target(f"REST identify at concurrency {C} / in-process ceiling of the same runtime, {p}",
             ratio(throughput(REST, p), ceiling_rate(p), "images/s"), 0.8) for p in PHOTOS),
    *(Target(f"REST identify / naive plain, concurrency {C}, {p}",
             ratio(throughput(REST, p), throughput("naive plain", p), "images/s"), PLAIN_FACTORS[p])
      for p in PHOTOS),
    *(Target(f"REST identify / naive served, concurrency {C}, {p}",
             ratio(throughput(REST, p), throughput("naive served", p), "images/s"), 0.9) for p in PHOTOS),
    *(Target(f"face_pipeline ms outside the two networks per 1-face image, Triton statistics, gRPC at "
             f"concurrency {c}", amount(outside_networks(c), "ms"), 3.0, at_most=True) for c in (1, C)),
    Target("face_pipeline ms outside the two networks per 1-face image, in-process timer split",
           amount(split_outside, "ms"), 3.0, at_most=True),
    *(Target(f"{t} p50 at concurrency 1 / the ceiling's single image, {ONE_FACE}", latency(t), 1.3,
             at_most=True) for t in (REST, GRPC)),
    *(target for p in PHOTOS for target in (
        Target(f"REST identify throughput at concurrency {HIGH_CONCURRENCY} / at its best concurrency, {p}",
               holds(p), 0.95),
        Target(f"REST identify p99 / p50 at concurrency {C}, {p}", tail(p), 3.0, at_most=True))),
    *(Target(f"{name} PSS over the memory run: largest deviation from its start",
             amount(memory_drift(process), "%"), 10.0, at_most=True)
      for process, name in (("gateway", "gateway"), ("triton", "Triton tree"))),
    Target(f"Triton tree PSS (server + Python-backend stubs) at concurrency {HIGH_CONCURRENCY}",
           amount(triton_pss, "MiB"), 1536.0, at_most=True),
    *(Target(f"gateway CPU per identify at concurrency {C}, {p}", amount(gateway_cpu(p), "ms"), 3.0,
             at_most=True) for p in PHOTOS),
)
#: Ratios of two figures of the run, reported without a bound.
RATIOS: tuple[Target, ...] = tuple(target for p in PHOTOS for target in (
    Target(f"ceiling, served runtime / ONNX Runtime, {p}",
           ratio(ceiling_rate(p), ceiling_rate(p, "onnxruntime"), "images/s")),
    *(Target(f"{name} / ceiling, concurrency {C}, {p}",
             ratio(throughput(name, p), ceiling_rate(p), "images/s"))
      for name in (REST, GRPC, *NAIVE)),
    *(Target(f"{name} / {naive}, concurrency {C}, {p}",
             ratio(throughput(name, p), throughput(naive, p), "images/s"))
      for name in (REST, GRPC, "naive served") for naive in NAIVE if naive != name),
    Target(f"REST identify / gRPC face_pipeline, concurrency {C}, {p} (the gateway's cost)",
           ratio(throughput(REST, p), throughput(GRPC, p), "images/s")),
)) + tuple(Target(f"{t} p50 at concurrency 1 / the ceiling's single image, {ONE_FACE}, {how}",
                  ratio(*p50_at_1(t, paired), "ms")) for t in (REST, GRPC)
           for how, paired in (("closed loop", False), ("paired rounds", True)))


def judge(target: Target, results: Results) -> list[str]:
    measured = target.measure(results)
    bound = "—" if target.bound is None else f"{'<=' if target.at_most else '>='} {target.bound:g}"
    if measured is None:
        return [target.name, "—", bound, "not measured"]
    value, shown = measured
    if target.bound is None:
        return [target.name, shown, bound, "—"]
    held = value <= target.bound if target.at_most else value >= target.bound
    return [target.name, shown, bound, "**pass**" if held else "**falls short**"]


def evaluate(targets: Sequence[Target], results: Results) -> str:
    """One table of ``targets`` (ratios without a bound: only their names and values)."""
    rows = [judge(target, results) for target in targets]
    if all(target.bound is None for target in targets):
        return markdown_table(["figure", "measured"], [row[:2] for row in rows])
    return markdown_table(["figure", "measured", "bound", "result"], rows)


def _by_thread(sweep: dict[int, dict[int, float]]) -> str:
    return " / ".join(f"{t} thr: {best(v)}: {v[best(v)]:.1f}" for t, v in sweep.items()) or "—"


def _by_process(values: Mapping[str, float], digits: int) -> str:
    return ", ".join(f"{name} {value:.{digits}f}" for name, value in values.items())


CEILING = (("photo", "{0.label}"), ("variant", "{0.variant}"), ("runtime", "{0.runtime}"),
           ("detector input", "{0.input_size[0]}x{0.input_size[1]} ({0.sizing})"), ("faces", "{0.faces}"),
           ("single image ms, by threads",
            lambda r: " / ".join(f"{s.threads}: {s.total_ms:.1f}" for s in r.splits)),
           ("best detector batch: ms per image", lambda r: _by_thread(r.detector_ms)),
           ("best embedder batch: ms per face", lambda r: _by_thread(r.embedder_ms)),
           ("images/s, processes x threads", lambda r: ", ".join(
               f"{lay.processes}x{lay.threads}: {lay.images_per_s:.1f}" for lay in r.layouts) or "—"),
           ("ceiling images/s", lambda r: f"**{r.images_per_s:.1f}**" if r.layouts else "—"))
SPLIT = (("photo", "{0.label}"), ("variant", "{0.variant}"), ("input", "{0.input_size[0]}x{0.input_size[1]}"),
         ("threads", "{1.threads}"), *((stage, f"{{1.stages_ms[{stage}]:.2f}}") for stage in STAGES),
         ("total ms", "{1.total_ms:.1f}"), ("outside the two networks ms", "{1.outside_models_ms:.2f}"))
LOAD = (("target", "{0.target}"), ("photo", "{0.photo}"), ("concurrency", "{0.concurrency}"),
        ("images/s", "{0.throughput:.1f}"), ("p50 ms", "{0.p50_ms:.0f}"), ("p90 ms", "{0.p90_ms:.0f}"),
        ("p99 ms", "{0.p99_ms:.0f}"), ("errors", "{0.errors}"),
        ("CPU ms per request", lambda r: _by_process({"client": r.client_cpu_ms, **r.cpu_ms,
                                                      "total": r.cpu_ms_total}, 1)),
        ("PSS MiB at the end", lambda r: _by_process(r.rss_mib, 0)))
HOLD = (("photo", "{0.photo}"), ("concurrency: best / high", "{0.best_concurrency} / {0.high_concurrency}"),
        ("window s", "{0.seconds:g}"), ("images/s at the best, per round", lambda c: _joined(c.best, ".1f")),
        ("images/s at the high, per round", lambda c: _joined(c.high, ".1f")),
        ("high / best, per round", lambda c: _joined(c.shares, ".2f")), ("median", "{0.share:.2f}"),
        ("errors", "{0.errors}"))
LATENCY = (("photo", "{0.photo}"), ("rounds", "{0.rounds}"), ("ceiling threads", "{0.threads}"),
           ("pause ms", "{0.pause_ms:.0f}"), ("ceiling single image p50 ms", "{0.ceiling_ms:.1f}"),
           ("gRPC face_pipeline p50 ms", "{0.grpc_ms:.1f}"), ("REST identify p50 ms", "{0.rest_ms:.1f}"),
           ("gRPC / ceiling, per round (median)", "{0.grpc_paired:.2f}"),
           ("REST / ceiling, per round (median)", "{0.rest_paired:.2f}"))
RUN = (("minutes", "{0.minutes:g}"), ("concurrency", "{0.concurrency}"), ("photo sizes", "{0.shapes}"),
       ("warm-up s", "{0.warmup_s:.0f}"), ("sampled every s", "{0.interval_s:.1f}"),
       ("samples", lambda m: len(m.times_s)), ("requests", "{0.load.requests}"),
       ("images/s", "{0.load.throughput:.1f}"), ("errors", "{0.load.errors}"))
FLAT = (("process", "{0}"), ("start MiB", "{1[start]:.0f}"), ("end MiB", "{1[end]:.0f}"),
        ("max MiB", "{1[max]:.0f}"), ("largest deviation %", "{1[max_deviation_pct]:.1f}"))


def _joined(values: Sequence[float], spec: str) -> str:
    return " / ".join(format(v, spec) for v in values)


def _memory(memory: MemoryRun) -> list[str]:
    flat = [(name, memory.flatness(name)) for name in memory.rss_mib if memory.flatness(name)]
    return [f"### Memory: REST identify at concurrency {memory.concurrency} for {memory.minutes:g} min",
            table([memory], RUN), table(flat, FLAT)]


def header(results: Results) -> str:
    rows = {"command": f"`{results.command}`", "date": results.date, "machine": results.machine,
            "settings": ", ".join(f"{k} {v}" for k, v in results.settings.items()),
            "served (model repository)": results.served or "unknown",
            "plain baseline's networks": results.plain_check or "—",
            "wall time per part, min": ", ".join(f"{k} {v / 60:.1f}" for k, v in results.seconds.items())}
    return markdown_table(["the run", ""], [[k, v] for k, v in rows.items()])


def document(results: Results) -> str:
    """The report section: the targets and ratios, then every part's tables."""
    parts = ["## Serving: ceiling, naive baselines, our stack, memory (`python -m bench`)", header(results)]
    if results.errors:
        parts += ["### Parts that failed", markdown_table(["part", "error"], [[k, f"`{v}`"] for k, v in
                                                                             results.errors.items()])]
    parts += ["### Targets (reported, not asserted)", evaluate(TARGETS, results),
              "### Ratios (both sides measured in this run)", evaluate(RATIOS, results)]
    if results.ceiling:
        splits = [(r, s) for r in results.ceiling for s in r.splits]
        parts += ["### Ceiling: in-process (`bench/ceiling.py`)", table(results.ceiling, CEILING),
                  "Stage split, one image at a time (ms, medians):", table(splits, SPLIT)]
    load = [*results.naive, *results.naive_plain, *results.stack]
    if load:
        parts += ["### Naive baselines and our stack under load (`bench/naive.py`, `bench/stack.py`)",
                  table(load, LOAD)]
    if results.hold:
        parts += ["REST identify at the sweep's best concurrency and the high one, alternating "
                  "(`stack.hold_check`):", table(results.hold, HOLD)]
    if results.paired_latency:
        parts += ["### Latency at concurrency 1, paired (`bench/latency.py`)",
                  table(results.paired_latency, LATENCY)]
    if results.memory:
        parts += _memory(results.memory)
    if results.gallery:
        parts += ["### Gallery search scaling (`bench/gallery.py`; more in [gallery.md](gallery.md))",
                  results.gallery]
    if results.enroll:
        parts += ["### Enrollment throughput (`bench/enroll.py`; more in [gallery.md](gallery.md))",
                  results.enroll]
    return "\n\n".join(part for part in parts if part)


def write(results: Results, out: Path, record: bool = True) -> Path:
    """This run's section of ``out/README.md`` and, with ``record``, its ``runs/results.json``; returns
    the README path."""
    if record:
        (out / RESULTS).parent.mkdir(parents=True, exist_ok=True)
        (out / RESULTS).write_text(json.dumps(results.to_json(), indent=2, default=str))
    write_section(readme := out / "README.md", SECTION, document(results))
    return readme


def main(argv: list[str] | None = None) -> int:
    parser = cli("bench.report", __doc__)
    parser.add_argument("--rerender", type=Path, required=True, metavar="FOLDER",
                        help="a report folder with runs/results.json (e.g. docs/benchmarks)")
    folder = parser.parse_args(argv).rerender
    results = Results.from_json(json.loads((folder / RESULTS).read_text()))
    print(f"rewrote the `{SECTION}` section of {write(results, folder, record=False)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
