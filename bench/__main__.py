"""Every benchmark in one go on this machine; writes ``docs/benchmarks/`` (Markdown tables, PNG plots).

    python -m bench                     # the full run: ~25-30 minutes, 10 of them the memory run
    python -m bench --quick             # ~3 minutes: shorter runs, a 30 s memory run, a small gallery
    python -m bench --seconds 20 --memory-minutes 30 --full-gallery

In this order:

1. ceiling (``bench/ceiling.py``), alone: detector + embedder in-process with the served runtime and
   precisions (OpenVINO), and with ONNX Runtime f32 on the same files, best batch sizes and thread layout,
   plus decode and pre/post-processing -> images/s and single-image time for each;
2. the naive baselines (``bench/naive_app.py`` under uvicorn, 1 intra-op thread; *served*: what
   face_pipeline serves, runtime and precisions included; *served-onnxruntime*: the same on ONNX Runtime
   f32; *plain*: ONNX Runtime, the original float detector at fixed 640x640 and SFace without the PReLU
   rewrite, see ``bench/plain.py``) and our stack (Triton + gateway, ``bench/stack.py``), alternating at
   every concurrency: each naive ``/embed``, REST ``identify``, gRPC ``face_pipeline``
   (the servers not under load sit idle), with Triton's statistics and the CPU and memory of every
   process;
3. latency at concurrency 1, paired (``bench/latency.py``): the ceiling's single image in this process,
   gRPC face_pipeline and REST identify, one call of each in turn for ``--latency-rounds`` rounds, so the
   machine's drift falls on all three alike (the p50 latency target's figures); then REST identify at its
   best concurrency of the sweep and at 16, alternating for 3 rounds (``stack.hold_check``: the target of
   throughput holding at 16);
4. enrollment throughput (``bench/enroll.py``) against the same Triton;
5. the memory run: REST identify at concurrency 16 for ``--memory-minutes``, resident memory sampled;
6. the ceiling's second pass, alone again: the served and ONNX Runtime rows' stage split and layouts
   measured once more, each keeping the better of its two passes (the machine's speed drifts; noise only
   slows a measurement down);
7. gallery search scaling (``bench/gallery.py``; its quick sizes unless ``--full-gallery``).

Then the ratios, the targets table and the plots go to ``<out>/README.md`` (between marker comments),
``<out>/*.png`` and ``<out>/results.json``; the gallery and enrollment sections to ``<out>/gallery.md``.
A part that fails is reported with its error; the others still run (exit code 1).
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

from bench import ceiling, latency, naive, plain, report, stack
from bench.core.inputs import PHOTOS, REPOSITORY, ROOT, ServedModels, load_photos, served_models
from bench.core.reporting import machine_description, read_section
from bench.results import HIGH_CONCURRENCY, Results, peak
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
    naive_threads: tuple[int, ...]
    naive_variants: tuple[str, ...]
    ceiling: ceiling.CeilingOptions
    enroll_images: int
    enroll_repeats: int
    latency_rounds: int
    gallery_args: tuple[str, ...]
    skip: frozenset[str] = field(default_factory=frozenset)


def _layouts(values: list[str]) -> tuple[tuple[int, int], ...]:
    out = []
    for value in values:
        processes, _, threads = value.partition("x")
        out.append((int(processes), int(threads)))
    return tuple(out)


def plan(args: argparse.Namespace) -> Plan:
    quick = args.quick
    seconds = args.seconds if args.seconds is not None else (2.0 if quick else 10.0)
    threads = tuple(sorted({t for _, t in _layouts(args.layouts)}))
    gallery_args: tuple[str, ...]
    if args.gallery_sizes:
        dims = args.gallery_dims or [128]
        gallery_args = ("--sizes", *map(str, args.gallery_sizes), "--dims", *map(str, dims), "--queries",
                        "50" if quick else "200")
    elif args.full_gallery:
        gallery_args = ()
    elif quick:
        gallery_args = ("--sizes", "10000", "--dims", "128", "--queries", "100")
    else:
        gallery_args = ("--quick",)
    return Plan(
        seconds=seconds,
        memory_minutes=args.memory_minutes if args.memory_minutes is not None else (0.5 if quick else 10.0),
        concurrency=tuple(args.concurrency),
        photos=tuple(args.photos),
        naive_threads=tuple(args.naive_threads),
        naive_variants=tuple(dict.fromkeys(args.naive_variants)),
        ceiling=ceiling.CeilingOptions(
            seconds=seconds, repeats=2 if quick else 5, split_repeats=5 if quick else 15,
            embedder_batches=(1, 4, 16) if quick else ceiling.EMBEDDER_BATCHES,
            threads=threads, layouts=_layouts(args.layouts), fixed=not (args.no_fixed or quick)),
        enroll_images=args.enroll_images or (24 if quick else 100),
        enroll_repeats=args.enroll_repeats or (1 if quick else 3),
        latency_rounds=args.latency_rounds or (30 if quick else latency.ROUNDS),
        gallery_args=gallery_args,
        skip=frozenset(args.skip),
    )


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


def _gallery(results: Results, out: Path, args: tuple[str, ...], folder: Path) -> None:
    from bench import gallery

    data = folder / "gallery.json"
    if gallery.main([*args, "--out", str(out / "gallery.md"), "--json", str(data)]) != 0:
        raise RuntimeError("bench.gallery failed")
    rows = [gallery.Row(**row) for row in json.loads(data.read_text())["rows"]]
    results.gallery = f"Command: `python -m bench.gallery {' '.join(args)}`\n\n{gallery.result_table(rows)}"


def _enroll(results: Results, out: Path, url: str, images: int, repeats: int, folder: Path) -> None:
    from bench import enroll

    data = folder / "enroll.json"
    argv = ["--url", url, "--images", str(images), "--repeats", str(repeats)]
    if enroll.main([*argv, "--out", str(out / "gallery.md"), "--json", str(data)]) != 0:
        raise RuntimeError("bench.enroll failed")
    results.enroll = (f"Command: `python -m bench.enroll {' '.join(argv[2:])} --url <this run's Triton>`\n\n"
                      + enroll.table(json.loads(data.read_text())["rows"]))


def _loads(results: Results, p: Plan, photos: dict[str, bytes], naive_servers: list[naive.NaiveServer],
           running: stack.Stack | None) -> None:
    """Naive, REST identify and gRPC face_pipeline, alternating at every concurrency: the servers not under
    load sit idle (measured: ~1 % of a core for the gateway's change-log follower, ~0 for the others), and a
    slow drift of a shared machine hits all three alike instead of skewing their ratios."""
    first = p.photos[0]
    for server in naive_servers:
        log.info("naive %s, %d thread(s), %s: %d face(s)", server.variant, server.threads, first,
                 naive.faces_found(server, first, photos[first]))
    by_variant = {naive.SERVED: results.naive, naive.SERVED_ORT: results.naive_onnxruntime,
                  naive.PLAIN: results.naive_plain}
    client = PipelineClient(running.triton_grpc, timeout_s=300) if running else None
    try:
        for name, data in photos.items():
            if running:
                log.info("REST identify %s: %s", name, stack.decisions(running, name, data))
            for c in p.concurrency:
                for server in naive_servers:
                    row = naive.measure_once(server, name, data, c, p.seconds)
                    by_variant[server.variant].append(row)
                if running and client:
                    results.stack.append(stack.measure_rest(running, name, data, c, p.seconds))
                    results.stack.append(stack.measure_grpc(running, client, name, data, c, p.seconds))
    finally:
        if client:
            client.close()


def _hold(results: Results, p: Plan, running: stack.Stack, photos: dict[str, bytes]
          ) -> list[stack.HoldCheck]:
    """Each photo's REST identify at its best concurrency of the sweep against the target's high one (16),
    alternating; none where that was the best, or it was not part of the sweep."""
    high = HIGH_CONCURRENCY
    if high not in p.concurrency:
        return []
    out = []
    for name, data in photos.items():
        top = peak(results.stack, stack.REST, name)
        if top is not None and top.concurrency != high:
            out.append(stack.hold_check(running, name, data, top.concurrency, high, p.seconds / 2))
    return out


def _plain(results: Results, p: Plan, models: ServedModels, photos: dict[str, bytes]
           ) -> ServedModels | None:
    """The plain variant's models (built or reused, checked against the served embedder) when the ceiling
    or the plain naive baseline needs them; None (and the error reported) when they cannot be had."""
    wanted = "ceiling" not in p.skip or ("naive" not in p.skip and naive.PLAIN in p.naive_variants)
    if not wanted:
        return None
    try:
        prepared = plain.prepare(models, photos)
    except Exception as exc:  # the served baseline and the stack are still measured
        log.exception("the plain variant's models are not usable")
        results.errors["naive plain"] = f"plain models: {type(exc).__name__}: {exc}"
        return None
    results.plain_check = prepared.describe()
    return prepared.models


def run(args: argparse.Namespace, argv: list[str]) -> Results:
    p = plan(args)
    command = " ".join(["python -m bench", *argv]).strip()
    results = Results(command=command, date=time.strftime("%Y-%m-%d %H:%M %Z"), machine="", settings={
        "seconds per point": p.seconds, "concurrency": list(p.concurrency), "photos": list(p.photos),
        "memory minutes": p.memory_minutes, "naive variants": list(p.naive_variants),
        "naive intra-op threads": list(p.naive_threads),
        "ceiling layouts (processes x threads)": [f"{a}x{b}" for a, b in p.ceiling.layouts]})
    photos = load_photos(p.photos)
    models = served_models(args.repository)
    out: Path = args.out
    version = ""
    plain_models = _plain(results, p, models, photos)
    with tempfile.TemporaryDirectory(prefix="bench-") as scratch:
        folder = Path(scratch)

        def do_ceiling() -> None:
            results.ceiling = ceiling.run(models, photos, p.ceiling, plain_models)

        run_part(results, "ceiling", p.skip, do_ceiling)  # alone: it uses every core itself
        with ExitStack() as servers:
            running: stack.Stack | None = None
            stack_parts = {"stack", "latency", "hold", "enroll", "memory"} - p.skip
            if stack_parts:
                try:
                    running = servers.enter_context(stack.running_stack(args.repository,
                                                                        photos.get(stack.ENROLLED)))
                    version = running.version
                except Exception as exc:  # Triton or the gateway did not start
                    log.exception("the stack did not start")
                    for part in stack_parts:
                        results.errors[part] = f"the stack did not start: {type(exc).__name__}: {exc}"
            with ExitStack() as naive_apps:  # stopped before enroll and the memory run
                naive_servers: list[naive.NaiveServer] = []
                if "naive" not in p.skip:
                    for variant in p.naive_variants:
                        run_models = naive.variant_models(models, plain_models, variant)
                        if run_models is None:  # the plain models failed: reported by _plain
                            continue
                        try:
                            for t in p.naive_threads:
                                server = naive.naive_server(run_models, t, variant)
                                naive_servers.append(naive_apps.enter_context(server))
                        except Exception as exc:  # reported; the stack is still measured
                            log.exception("the naive %s app did not start", variant)
                            results.errors[f"naive {variant}"] = (f"the naive {variant} app did not start: "
                                                                  f"{type(exc).__name__}: {exc}")
                measured = running if "stack" not in p.skip else None
                if naive_servers or measured:
                    run_part(results, "naive + stack (alternating)", frozenset(),
                             lambda: _loads(results, p, photos, naive_servers, measured))
            if running is not None:
                stacked = running

                def do_latency() -> None:
                    threads = {c.photo: c.best_split.threads for c in results.ceiling
                               if c.variant == "served" and c.splits}
                    results.paired_latency = latency.measure(stacked, models, photos, threads,
                                                             p.latency_rounds)

                def do_hold() -> None:
                    results.hold = _hold(results, p, stacked, photos)

                def do_enroll() -> None:
                    _enroll(results, out, stacked.triton_grpc, p.enroll_images, p.enroll_repeats, folder)

                def do_memory() -> None:
                    name = p.photos[0]
                    results.memory = stack.memory_run(stacked, name, photos[name], p.memory_minutes)

                run_part(results, "latency", p.skip, do_latency)
                run_part(results, "hold", p.skip, do_hold)
                run_part(results, "enroll", p.skip, do_enroll)
                if p.memory_minutes > 0:
                    run_part(results, "memory", p.skip, do_memory)
        if results.ceiling:  # the servers are stopped: the ceiling has the cores to itself again

            def do_second_pass() -> None:
                ceiling.second_pass(models, photos, p.ceiling, results.ceiling)

            run_part(results, "ceiling, second pass", p.skip, do_second_pass)
        run_part(results, "gallery", p.skip, lambda: _gallery(results, out, p.gallery_args, folder))
    results.machine = machine_description(serving=True, triton=f"tritonserver {version}" if version else "")
    results.served = models.summary
    return results


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="~3 minutes: short runs, 30 s memory run")
    parser.add_argument("--seconds", type=float, help="each load measurement (default: 10; --quick: 2)")
    parser.add_argument("--memory-minutes", type=float,
                        help="memory run (default: 10; --quick: 0.5; 0: none)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks", help="report folder")
    parser.add_argument("--full-gallery", action="store_true", help="gallery up to 1M faces (adds ~15 min)")
    parser.add_argument("--repository", type=Path, default=REPOSITORY, help="CPU model repository")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--photos", nargs="+", default=list(PHOTOS), help="photos (the first one also for "
                        "naive and the memory run; default: obama.jpg t1.jpg)")
    parser.add_argument("--naive-variants", nargs="+", default=list(naive.VARIANTS), choices=naive.VARIANTS,
                        help="naive baselines: served (the served settings and files) and plain (fixed "
                        "640x640, SFace without the PReLU rewrite); default: both")
    parser.add_argument("--naive-threads", type=int, nargs="+", default=list(naive.THREADS),
                        help="naive intra-op threads, for every variant (default: 1; 2 lost at every "
                        "concurrency on 2 cores)")
    parser.add_argument("--layouts", nargs="+", default=["1x1", "1x2", "2x1"],
                        help="ceiling: processes x intra-op threads (default: 1x1 1x2 2x1)")
    parser.add_argument("--no-fixed", action="store_true",
                        help="ceiling: skip the fixed 640x640 input (--quick skips it too)")
    parser.add_argument("--enroll-images", type=int, help="bench.enroll images (default: 100; quick: 24)")
    parser.add_argument("--enroll-repeats", type=int, help="bench.enroll rounds (default: 3; quick: 1)")
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
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    began = time.perf_counter()
    results = run(args, raw)
    results.seconds["total"] = time.perf_counter() - began
    readme = report.write(results, args.out)
    print(read_section(readme.read_text(), report.SECTION))
    log.info("wrote %s in %.1f min", readme, results.seconds["total"] / 60)
    return 1 if results.errors else 0


if __name__ == "__main__":
    sys.exit(main())
