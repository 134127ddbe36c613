"""Sweep serving configurations, Model-Analyzer style, and keep the best one for a latency budget.

    python -m bench.tune --budget-ms 250 --seconds 8
    python -m bench.tune --dry-run --dimensions runtime layout "detector instances x threads"

Each candidate is a full repository (written by ``export``) served by a fresh tritonserver and measured
over gRPC with real photos: p50 at concurrency 1, p99 and throughput at concurrency 8, the peak PSS of
Triton's tree at concurrency 16. Coordinate descent from the current default over ``DIMENSIONS``, one at
a time; docs/benchmarks/tuning.md says when a change is kept. The winner is written to
``export/tuning/cpu.json`` (the default from then on) and ``model_repository/cpu``; ``--dry-run``
measures and reports only.
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from bench.core.inputs import ARTIFACTS, REPOSITORY, load_photos
from bench.core.load import closed_loop, in_turn
from bench.core.processes import RssSampler, Watched
from bench.core.reporting import cli, command_line, log_progress, machine_description, table
from bench.core.triton import served_tuning
from export.defaults import prepare_default_models
from export.profiles import TUNING_DIR, Profile, ProfileTuning
from export.repository import RepositoryPlan, write_repository
from facecore.client import PipelineClient

log = logging.getLogger("bench.tune")


@dataclass(frozen=True)
class Trial:
    name: str
    tuning: ProfileTuning
    p50_c1_ms: float
    p99_c8_ms: float
    throughput_c8: float
    errors: int
    #: Peak resident memory of the Triton process tree while loaded at concurrency 16 (MiB).
    rss_mib: float = 0.0


Mutation = Callable[[ProfileTuning], ProfileTuning]


def _options(**values: str) -> Mutation:
    return lambda t: replace(t, pipeline_options={**t.pipeline_options, **values})


def _batching(model: str, **changes: object) -> Mutation:
    return lambda t: replace(t, **{model: replace(getattr(t, model), **changes)})


def _model(model: str, instances: int, threads: int) -> Mutation:
    """``instances`` x ``threads`` for one network (``detector`` or ``embedder``)."""
    return lambda t: replace(t, **{model: replace(getattr(t, model), instances=instances),
                                   f"{model}_threads": threads})


def _model_delay(tuning: ProfileTuning, microseconds: int) -> ProfileTuning:
    return replace(tuning, detector=replace(tuning.detector, queue_delay_us=microseconds),
                   embedder=replace(tuning.embedder, queue_delay_us=microseconds))


#: Dimensions in the order they are tried, each with its candidate values.
DIMENSIONS: dict[str, dict[str, Mutation]] = {
    "runtime": {
        "OpenVINO (precision per network by the export's check)": lambda t: replace(t, runtime="openvino"),
        "ONNX Runtime f32": lambda t: replace(t, runtime="onnxruntime"),
    },
    "layout": {
        "BLS: face_pipeline calls face_detector / face_embedder": lambda t: replace(t, layout="bls"),
        "in_process: both networks inside face_pipeline": lambda t: replace(t, layout="in_process"),
    },
    "solo threads": {
        "a lone request on one thread per network (solo threads off)": lambda t: replace(t, solo_threads=0),
        "a lone request on 2 threads per network": lambda t: replace(t, solo_threads=2),
    },
    "spinning": {
        "ONNX Runtime threads do not spin": lambda t: replace(t, spinning=False),
        "ONNX Runtime threads spin": lambda t: replace(t, spinning=True),
    },
    "detector instances x threads": {
        f"{i} detector(s) x {n} thread(s)": _model("detector", i, n) for i, n in ((1, 1), (1, 2), (2, 1))
    },
    "embedder instances x threads": {
        f"{i} embedder(s) x {n} thread(s)": _model("embedder", i, n) for i, n in ((1, 1), (1, 2), (2, 1))
    },
    "pipeline instances": {
        "1 pipeline": _batching("pipeline", instances=1),
        "2 pipelines": _batching("pipeline", instances=2),
        "3 pipelines": _batching("pipeline", instances=3),
    },
    "batching": {
        "pipeline delay 0.5 ms": _batching("pipeline", queue_delay_us=500, preferred=(4, 8)),
        "pipeline delay 0": _batching("pipeline", queue_delay_us=0, preferred=(2, 4, 8)),
        "pipeline delay 5 ms": _batching("pipeline", queue_delay_us=5000, preferred=(8,)),
        # smaller batches: OpenVINO keeps buffers for the largest batch a network has seen, per instance
        "small batches: pipeline max 2, embedder max 16": lambda t: _batching(
            "embedder", max_batch_size=16, preferred=(16,))(_batching(
                "pipeline", max_batch_size=2, preferred=(2,))(t)),
    },
    "model queue delay": {
        "detector/embedder delay 0": lambda t: _model_delay(t, 0),
        "detector/embedder delay 1 ms": lambda t: _model_delay(t, 1000),
    },
    "detector size": {
        "dynamic, max 640": _options(dynamic_input="True"),
        "fixed 640x640": _options(dynamic_input="False"),
    },
    "decode": {
        "full decode": _options(decode_min_side="0"),
        "reduced JPEG decode (>= 1280 px)": _options(decode_min_side="1280"),
    },
}


def measure(tuning: ProfileTuning, name: str, payloads: list[bytes], seconds: float, work: Path) -> Trial:
    with tempfile.TemporaryDirectory(dir=work) as folder, \
            served_tuning(tuning, Path(folder), work / "tune-tritonserver.log") as server:
        client = PipelineClient(server.grpc_url)
        send = in_turn(client.infer, payloads)
        single = closed_loop(send, 1, seconds / 2)
        loaded = closed_loop(send, 8, seconds)
        with RssSampler([Watched("triton", server.pid or 0)], 0.5) as memory:
            burst = closed_loop(send, 16, seconds / 2)
        client.close()
    peak = max((sample["triton"] for _, sample in memory.samples), default=0) / 2**20
    trial = Trial(name, tuning, single.percentile(50), loaded.percentile(99), loaded.throughput,
                  single.errors + loaded.errors + burst.errors, peak)
    log.info("%-40s p50@1 %6.1f ms  p99@8 %7.1f ms  %5.2f img/s  %5.0f MiB@16  errors %d", name,
             trial.p50_c1_ms, trial.p99_c8_ms, trial.throughput_c8, trial.rss_mib, trial.errors)
    return trial


#: Triton's process tree at concurrency 16 stays within this (issue 10's memory target); --memory-mib.
MEMORY_BUDGET_MIB = 1536.0


#: A candidate whose throughput is the kept one's within the noise margin is kept when Triton's tree
#: needs at least this much less memory (OpenVINO keeps buffers per instance for the largest batch it
#: has seen: at equal throughput, less memory is the better default).
MEMORY_GAIN = 0.15


#: ... or answers a lone request in at least this much less time (p50 at concurrency 1: a network on two
#: threads when the machine is otherwise idle), in not clearly more memory.
LATENCY_GAIN = 0.15


def improves(trial: Trial, best: Trial, margin: float) -> bool:
    """Faster beyond the noise margin, or as fast (within it) in clearly less memory, or as fast with a
    clearly quicker lone request in not clearly more memory."""
    faster = trial.throughput_c8 > best.throughput_c8 * (1 + margin)
    as_fast = trial.throughput_c8 >= best.throughput_c8 * (1 - margin)
    leaner = as_fast and best.rss_mib > 0 and 0 < trial.rss_mib <= best.rss_mib * (1 - MEMORY_GAIN)
    quicker = (as_fast and 0 < trial.p50_c1_ms <= best.p50_c1_ms * (1 - LATENCY_GAIN)
               and (best.rss_mib <= 0 or trial.rss_mib <= best.rss_mib * (1 + MEMORY_GAIN)))
    return faster or leaner or quicker


def acceptable(trial: Trial, budget_ms: float, memory_mib: float = MEMORY_BUDGET_MIB) -> bool:
    return trial.errors == 0 and trial.p99_c8_ms <= budget_ms and trial.rss_mib <= memory_mib


def applies(dimension: str, tuning: ProfileTuning) -> bool:
    """Whether a dimension changes anything for this tuning: spinning is ONNX Runtime's, solo threads the
    in_process layout's (whose networks still take the detector / embedder thread counts)."""
    if dimension == "spinning":
        return tuning.runtime == "onnxruntime"
    if dimension == "solo threads":
        return tuning.layout == "in_process"
    return True


Measure = Callable[[ProfileTuning, str, list[bytes], float, Path], Trial]


def sweep(start: ProfileTuning, payloads: list[bytes], seconds: float, budget_ms: float, margin: float,
          work: Path, dimensions: Sequence[str] | None = None, measure: Measure = measure,
          memory_mib: float = MEMORY_BUDGET_MIB) -> tuple[Trial, list[Trial]]:
    """Coordinate descent over ``dimensions`` (default: all, in ``DIMENSIONS`` order) from ``start``."""
    best = measure(start, "current default", payloads, seconds, work)
    trials = [best]
    for dimension in dimensions or list(DIMENSIONS):
        candidates = DIMENSIONS[dimension]
        if not applies(dimension, best.tuning):
            log.info("skipping %s: it does not apply to %s / %s", dimension, best.tuning.runtime,
                     best.tuning.layout)
            continue
        for name, mutate in candidates.items():
            candidate = mutate(best.tuning)
            if candidate == best.tuning:
                continue
            trial = measure(candidate, f"{dimension}: {name}", payloads, seconds, work)
            trials.append(trial)
            if acceptable(trial, budget_ms, memory_mib) and (improves(trial, best, margin)
                                                             or not acceptable(best, budget_ms, memory_mib)):
                best = trial
    return best, trials


TRIALS = (("candidate", "{0.name}"), ("p50 @1 (ms)", "{0.p50_c1_ms:.1f}"),
          ("p99 @8 (ms)", "{0.p99_c8_ms:.1f}"), ("images/s @8", "{0.throughput_c8:.2f}"),
          ("MiB @16", "{0.rss_mib:.0f}"), ("errors", "{0.errors}"))


def report(best: Trial, trials: list[Trial], budget_ms: float) -> str:
    return (f"Latency budget: p99 at concurrency 8 <= {budget_ms:.0f} ms; Triton tree memory (PSS) at "
            f"concurrency 16 <= {MEMORY_BUDGET_MIB:.0f} MiB. Chosen: **{best.name}**.\n\n"
            f"{table(trials, TRIALS)}")


def main(argv: list[str] | None = None) -> int:
    parser = cli("bench.tune", __doc__)
    parser.add_argument("--budget-ms", type=float, default=1000.0, help="p99 latency budget at concurrency 8")
    parser.add_argument("--seconds", type=float, default=8.0, help="measurement time per candidate")
    parser.add_argument("--margin", type=float, default=0.03, help="improvement needed to keep a change")
    parser.add_argument("--memory-mib", type=float, default=MEMORY_BUDGET_MIB,
                        help="Triton tree PSS budget at concurrency 16 (default: %(default)s)")
    parser.add_argument("--dry-run", action="store_true", help="measure and report, do not record the winner")
    parser.add_argument("--report", type=Path, help="also write the Markdown table here")
    parser.add_argument("--dimensions", nargs="+", choices=list(DIMENSIONS), metavar="DIMENSION",
                        help=f"sweep only these, in this order (default: all: {', '.join(DIMENSIONS)})")
    args = parser.parse_args(argv)
    log_progress("service.launcher", "export")
    payloads = list(load_photos(("obama.jpg", "t1.jpg", "obama2.jpg", "biden.jpg")).values())
    work = ARTIFACTS / "tune"
    work.mkdir(parents=True, exist_ok=True)
    best, trials = sweep(ProfileTuning.default(Profile.CPU), payloads, args.seconds, args.budget_ms,
                         args.margin, work, args.dimensions, memory_mib=args.memory_mib)
    text = report(best, trials, args.budget_ms)
    print(text)
    command = command_line("bench.tune", argv)
    if args.report:
        args.report.write_text(f"# Serving configuration sweep\n\nCommand: `{command}` on "
                               f"{machine_description()}; docs/benchmarks/tuning.md says how to read it."
                               f"\n\n{text}\n")
    if not args.dry_run:
        TUNING_DIR.mkdir(parents=True, exist_ok=True)
        recorded = json.loads(best.tuning.to_json())
        recorded["note"] = f"chosen by `{command}`; the last change kept: {best.name}"
        (TUNING_DIR / "cpu.json").write_text(json.dumps(recorded, indent=2) + "\n")
        models = prepare_default_models(ARTIFACTS)
        plan = RepositoryPlan(Profile.CPU, models.detector, models.embedder, tuning=best.tuning)
        write_repository(plan, REPOSITORY, models.detector_file, models.embedder_file)
        print(f"recorded in {TUNING_DIR / 'cpu.json'} and model_repository/cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
