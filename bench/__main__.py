"""The serving comparison on this machine; writes ``docs/benchmarks/`` (Markdown tables and JSON).

    python -m bench                     # the full run: ~25-30 minutes, 10 of them the memory run
    python -m bench --quick             # ~3 minutes: shorter runs, a 30 s memory run, a small gallery
    python -m bench --seconds 20 --memory-minutes 30 --gallery-sizes 100000 1000000 --gallery-dims 128 512

Its parts, in this order (``--skip`` leaves some out): the in-process ceiling, alone (``bench/ceiling.py``);
the naive baselines (``bench/naive.py``) and our stack (``bench/stack.py``) alternating at every
concurrency; on the stack, latency at concurrency 1 paired (``bench/latency.py``), hold (the sweep's best
concurrency against 16), enroll (``bench/enroll.py``) and memory; alone again, the gallery
(``bench/gallery.py``, its quick sizes unless ``--gallery-sizes``).

The targets, ratios and tables go to ``<out>/README.md``, the raw numbers to
``<out>/runs/results.json``, the gallery and enrollment sections to ``<out>/gallery.md``. A part that
fails is reported with its error; the others still run (exit code 1).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from bench import ceiling, latency, naive, report, stack
from bench.core.inputs import PHOTOS, REPOSITORY, ROOT, ServedModels, load_photos, served_models
from bench.core.reporting import cli, log_progress, machine_description, read_section
from bench.results import HIGH_CONCURRENCY, Results, peak
from bench.stack import Stack
from facecore.client import PipelineClient

log = logging.getLogger("bench")

PARTS = ("ceiling", "naive", "stack", "latency", "hold", "enroll", "memory", "gallery")


@dataclass(frozen=True)
class Plan:
    """Durations and sizes of one run (the full defaults, or --quick's)."""

    seconds: float
    memory_minutes: float
    concurrency: tuple[int, ...]
    photos: tuple[str, ...]
    ceiling: ceiling.CeilingOptions
    enroll_images: int
    enroll_repeats: int
    latency_rounds: int
    gallery_args: tuple[str, ...]
    skip: frozenset[str] = field(default_factory=frozenset)


def plan(args: argparse.Namespace) -> Plan:
    quick = args.quick
    seconds = args.seconds if args.seconds is not None else (2.0 if quick else 10.0)
    layouts = tuple((int(p), int(t)) for p, _, t in (value.partition("x") for value in args.layouts))
    gallery_args: tuple[str, ...] = ("--quick",)
    if args.gallery_sizes:
        dims = map(str, args.gallery_dims or [128])
        gallery_args = ("--sizes", *map(str, args.gallery_sizes), "--dims", *dims, "--queries",
                        "50" if quick else "200")
    elif quick:
        gallery_args = ("--sizes", "10000", "--dims", "128", "--queries", "100")
    return Plan(
        seconds=seconds,
        memory_minutes=args.memory_minutes if args.memory_minutes is not None else (0.5 if quick else 10.0),
        concurrency=tuple(args.concurrency), photos=tuple(args.photos),
        ceiling=ceiling.CeilingOptions(
            seconds=seconds, repeats=2 if quick else 5, split_repeats=5 if quick else 15,
            embedder_batches=(1, 4, 16) if quick else ceiling.EMBEDDER_BATCHES,
            threads=tuple(sorted({t for _, t in layouts})), layouts=layouts),
        enroll_images=args.enroll_images or (24 if quick else 100),
        enroll_repeats=1 if quick else 3,
        latency_rounds=args.latency_rounds or (30 if quick else latency.ROUNDS),
        gallery_args=gallery_args, skip=frozenset(args.skip))


@dataclass
class Run:
    """What the parts share: the plan, the inputs, the servers up at the time, and the results."""

    plan: Plan
    results: Results
    photos: dict[str, bytes]
    models: ServedModels
    out: Path
    scratch: Path
    plain: ServedModels | None = None
    stack: Stack | None = None
    naive_servers: list[naive.NaiveServer] = field(default_factory=list)

    @property
    def running(self) -> Stack:
        if self.stack is None:
            raise RuntimeError("the stack is not running")
        return self.stack


def run_part(results: Results, name: str, skip: frozenset[str], work: Callable[[], None]) -> None:
    """Run one part, timing it; a failure is recorded for the report and the run goes on."""
    if name in skip:
        return
    log.info("=== %s", name)
    began = time.perf_counter()
    try:
        work()
    except Exception as exc:  # one broken part must not cost the other 20 minutes of results
        log.exception("%s failed", name)
        results.errors[name] = f"{type(exc).__name__}: {exc}"
    finally:
        results.seconds[name] = time.perf_counter() - began


def in_process(r: Run) -> None:
    r.results.ceiling = ceiling.run(r.models, r.photos, r.plan.ceiling)


def loads(r: Run) -> None:
    """The naive apps, REST identify and gRPC face_pipeline, alternating at every concurrency: the servers
    not under load sit idle, and a slow drift of a shared machine hits all alike instead of skewing their
    ratios."""
    p, results, running = r.plan, r.results, r.stack if "stack" not in r.plan.skip else None
    rows = {naive.SERVED: results.naive, naive.PLAIN: results.naive_plain}
    client = PipelineClient(running.triton_grpc, timeout_s=300) if running else None
    try:
        for name, data in r.photos.items():
            for c in p.concurrency:
                for server in r.naive_servers:
                    rows[server.variant].append(naive.measure_once(server, name, data, c, p.seconds))
                if running and client:
                    results.stack.append(stack.measure_rest(running, name, data, c, p.seconds))
                    results.stack.append(stack.measure_grpc(running, client, name, data, c, p.seconds))
    finally:
        if client:
            client.close()


def paired_latency(r: Run) -> None:
    threads = {c.photo: c.best_split.threads for c in r.results.ceiling if c.variant == "served" and c.splits}
    r.results.paired_latency = latency.measure(r.running, r.models, r.photos, threads, r.plan.latency_rounds)


def hold(r: Run) -> None:
    """Each photo's REST identify at its best concurrency of the sweep against the target's high one (16),
    alternating; none where that was the best, or it was not part of the sweep."""
    if HIGH_CONCURRENCY not in r.plan.concurrency:
        return
    for name, data in r.photos.items():
        top = peak(r.results.stack, stack.REST, name)
        if top is not None and top.concurrency != HIGH_CONCURRENCY:
            r.results.hold.append(stack.hold_check(r.running, name, data, top.concurrency, HIGH_CONCURRENCY,
                                                   r.plan.seconds / 2))


def _own_section(r: Run, part: ModuleType, argv: list[str], render: Callable[[Any], str], shown: str) -> str:
    """Run a benchmark that writes its own section into ``<out>/gallery.md``; its command (as ``shown``)
    and table for this report."""
    data = r.scratch / "rows.json"
    if part.main([*argv, "--out", str(r.out / "gallery.md"), "--json", str(data)]) != 0:
        raise RuntimeError(f"{part.__name__} failed")
    return f"Command: `python -m {part.__name__} {shown}`\n\n{render(json.loads(data.read_text())['rows'])}"


def enroll(r: Run) -> None:
    from bench import enroll as part

    argv = ["--images", str(r.plan.enroll_images), "--repeats", str(r.plan.enroll_repeats)]
    r.results.enroll = _own_section(r, part, [*argv, "--url", r.running.triton_grpc], part.table,
                                    " ".join([*argv, "--url", "<this run's Triton>"]))


def memory(r: Run) -> None:
    if r.plan.memory_minutes > 0:
        name = r.plan.photos[0]
        r.results.memory = stack.memory_run(r.running, name, r.photos[name], r.plan.memory_minutes)


def gallery(r: Run) -> None:
    from bench import gallery as part
    from bench.gallery_engines import Row

    args = list(r.plan.gallery_args)
    r.results.gallery = _own_section(r, part, args, lambda rows: part.result_table([Row(**x) for x in rows]),
                                     " ".join(args))


#: The parts by the servers they need, in the order they run. The ceiling runs alone (it uses every core
#: itself); the loads need the naive apps and the stack; then the stack alone; then nothing again.
Part = Callable[[Run], None]
ALONE: dict[str, Part] = {"ceiling": in_process}
WITH_NAIVE_APPS: dict[str, Part] = {"naive + stack (alternating)": loads}
ON_THE_STACK: dict[str, Part] = {"latency": paired_latency, "hold": hold, "enroll": enroll, "memory": memory}
ALONE_AGAIN: dict[str, Part] = {"gallery": gallery}


def _plain(r: Run) -> None:
    """The plain variant's models (built or reused, checked against the served ones) when the plain naive
    baseline needs them; the error is reported when they cannot be had."""
    if "naive" in r.plan.skip:
        return
    try:
        prepared = naive.prepare(r.models, r.photos)
    except Exception as exc:  # the served baseline and the stack are still measured
        log.exception("the plain variant's models are not usable")
        r.results.errors["naive plain"] = f"plain models: {type(exc).__name__}: {exc}"
        return
    r.results.plain_check, r.plain = prepared.describe(), prepared.models


def _start(r: Run, servers: ExitStack, naive_apps: ExitStack, repository: Path) -> None:
    """The stack (unless every part that needs it is skipped) and the naive apps; what fails to start is
    reported against the parts it costs."""
    needing = ({"stack"} | set(ON_THE_STACK)) - r.plan.skip
    if needing:
        try:
            r.stack = servers.enter_context(stack.running_stack(repository, r.photos.get(stack.ENROLLED)))
        except Exception as exc:  # Triton or the gateway did not start
            log.exception("the stack did not start")
            why = f"the stack did not start: {type(exc).__name__}: {exc}"
            r.results.errors |= dict.fromkeys(needing, why)
    for variant in naive.VARIANTS if "naive" not in r.plan.skip else ():
        models = r.plain if variant == naive.PLAIN else r.models
        if models is None:  # the plain models failed: reported already
            continue
        try:
            server = naive.naive_server(models, naive.THREADS, variant)
            r.naive_servers.append(naive_apps.enter_context(server))
        except Exception as exc:  # reported; the stack is still measured
            log.exception("the naive %s app did not start", variant)
            r.results.errors[f"naive {variant}"] = f"the naive {variant} app did not start: {exc}"


def run(args: argparse.Namespace, argv: list[str]) -> Results:
    p = plan(args)
    results = Results(" ".join(["python -m bench", *argv]).strip(), time.strftime("%Y-%m-%d %H:%M %Z"), "", {
        "seconds per point": p.seconds, "concurrency": list(p.concurrency), "photos": list(p.photos),
        "memory minutes": p.memory_minutes,
        "ceiling layouts (processes x threads)": [f"{a}x{b}" for a, b in p.ceiling.layouts]})
    models = served_models(args.repository)
    with tempfile.TemporaryDirectory(prefix="bench-") as scratch:
        r = Run(p, results, load_photos(p.photos), models, args.out, Path(scratch))
        _plain(r)

        def parts(named: dict[str, Part], skip: frozenset[str] = p.skip) -> None:
            for name, part in named.items():
                run_part(results, name, skip, lambda part=part: part(r))  # type: ignore[misc]

        parts(ALONE)
        with ExitStack() as servers:
            with ExitStack() as naive_apps:  # stopped before the parts on the stack alone
                _start(r, servers, naive_apps, args.repository)
                if r.naive_servers or (r.stack and "stack" not in p.skip):
                    parts(WITH_NAIVE_APPS, frozenset())
            if r.stack is not None:
                parts(ON_THE_STACK)
                results.machine = machine_description(serving=True, triton=f"tritonserver {r.stack.version}")
        parts(ALONE_AGAIN)
    results.machine = results.machine or machine_description(serving=True)
    results.served = models.summary
    return results


def arguments() -> argparse.ArgumentParser:
    parser = cli("bench", __doc__)
    parser.add_argument("--quick", action="store_true", help="~3 minutes: short runs, 30 s memory run")
    parser.add_argument("--seconds", type=float, help="each load measurement (default: 10; --quick: 2)")
    parser.add_argument("--memory-minutes", type=float,
                        help="memory run (default: 10; --quick: 0.5; 0: none)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks", help="report folder")
    parser.add_argument("--repository", type=Path, default=REPOSITORY, help="CPU model repository")
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(stack.CONCURRENCY))
    parser.add_argument("--photos", nargs="+", default=list(PHOTOS), help="photos (the first one also for "
                        "naive and the memory run; default: obama.jpg t1.jpg)")
    parser.add_argument("--layouts", nargs="+", default=["1x1", "1x2", "2x1"],
                        help="ceiling: processes x intra-op threads (default: 1x1 1x2 2x1)")
    parser.add_argument("--enroll-images", type=int, help="bench.enroll images (default: 100; quick: 24)")
    parser.add_argument("--latency-rounds", type=int,
                        help=f"paired latency rounds per photo (default: {latency.ROUNDS}; quick: 30)")
    parser.add_argument("--gallery-sizes", type=int, nargs="+",
                        help="bench.gallery sizes (instead of its quick sizes)")
    parser.add_argument("--gallery-dims", type=int, nargs="+",
                        help="bench.gallery dimensions (with --gallery-sizes)")
    parser.add_argument("--skip", nargs="+", default=[], choices=PARTS, help="parts to leave out")
    return parser


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    args = arguments().parse_args(raw)
    log_progress("httpx")
    began = time.perf_counter()
    results = run(args, raw)
    results.seconds["total"] = time.perf_counter() - began
    readme = report.write(results, args.out)
    print(read_section(readme.read_text(), report.SECTION))
    log.info("wrote %s in %.1f min", readme, results.seconds["total"] / 60)
    return 1 if results.errors else 0


if __name__ == "__main__":
    sys.exit(main())
