"""Serving configurations side by side: paired measurements that this noisy machine cannot blur.

    python -m bench.compare --candidate previous detector_threads=2 solo_threads=0 pipeline.queue_delay_us=500
    python -m bench.compare --candidate 'one pipeline fewer' pipeline.instances=2 --photos obama.jpg t1.jpg

``bench.tune`` measures one candidate after another, so a shared machine's drift falls between
candidates. Here every candidate's tritonserver runs at the same time as the recorded default's
(``current``), and the load alternates:

- latency at concurrency 1: requests go to the servers in turn, one by one (p50 and p90 per server);
- throughput at ``--concurrency``: windows of ``--seconds`` alternate between the servers for
  ``--rounds`` rounds (the order reversed every round); the median window per server;
- memory: Triton's process tree (PSS) of each server after its load.

A candidate is the recorded tuning (``export/tuning/cpu.json``) with ``field=value`` changes: a
``ProfileTuning`` field (``detector_threads=1``, ``solo_threads=0``, ``layout=bls``) or a batching field
(``pipeline.instances=2``, ``pipeline.queue_delay_us=500``, ``pipeline.preferred=2,4``), or a
face_pipeline option (``option.decode_min_side=0``). Nothing is recorded; ``--report`` appends the table.
"""

from __future__ import annotations

import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from bench.core.inputs import load_photos
from bench.core.load import closed_loop, in_turn
from bench.core.processes import process_tree, resident_bytes
from bench.core.reporting import cli, command_line, log_progress, machine_description, markdown_table
from bench.core.triton import served_tuning
from export.profiles import Batching, Profile, ProfileTuning
from facecore.client import PipelineClient
from service.launcher import TritonServer

log = logging.getLogger("bench.compare")

CURRENT = "current"


def changed(tuning: ProfileTuning, assignments: Sequence[str]) -> ProfileTuning:
    """``tuning`` with ``field=value`` changes (see the module's help); a bad one raises ValueError."""
    for assignment in assignments:
        key, sep, value = assignment.partition("=")
        if not sep or not value:
            raise ValueError(f"{assignment!r}: field=value expected")
        model, dot, attribute = key.partition(".")
        if dot and model == "option":
            tuning = replace(tuning, pipeline_options={**tuning.pipeline_options, attribute: value})
        elif dot:
            batching = getattr(tuning, model, None)
            if not isinstance(batching, Batching) or attribute not in {f.name for f in fields(Batching)}:
                raise ValueError(f"{assignment!r}: no batching field {key!r}")
            parsed: dict[str, Any] = {attribute: tuple(int(v) for v in value.split(","))
                                      if attribute == "preferred" else int(value)}
            updated: dict[str, Any] = {model: replace(batching, **parsed)}
            tuning = replace(tuning, **updated)
        else:
            kinds = {f.name: type(getattr(tuning, f.name)) for f in fields(ProfileTuning)}
            if key not in kinds or kinds[key] in (Batching, dict):
                raise ValueError(f"{assignment!r}: no tuning field {key!r}")
            kind = kinds[key]
            field_value: dict[str, Any] = {key: value.lower() == "true" if kind is bool else kind(value)}
            tuning = replace(tuning, **field_value)
    return tuning


@dataclass(frozen=True)
class Result:
    name: str
    p50_c1_ms: float
    p90_c1_ms: float
    throughput: float  # the median window, images/s
    windows: list[float]
    pss_mib: float  # Triton's process tree after the load


def compare(candidates: dict[str, ProfileTuning], photos: dict[str, bytes], concurrency: int, seconds: float,
            rounds: int, single_requests: int, work: Path) -> list[Result]:
    """Every candidate served at once, measured with the load alternating between them."""
    payloads = list(photos.values())
    with ExitStack() as stack:
        servers: dict[str, TritonServer] = {}
        clients: dict[str, PipelineClient] = {}
        for index, (name, tuning) in enumerate(candidates.items()):
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=work)))
            servers[name] = stack.enter_context(served_tuning(tuning, folder, work / f"compare-{index}.log"))
            clients[name] = PipelineClient(servers[name].grpc_url, timeout_s=300)
        for client in clients.values():
            for payload in payloads * 3:
                client.infer(payload)
        latencies: dict[str, list[float]] = {name: [] for name in clients}
        for index in range(single_requests):
            for name, client in clients.items():
                began = time.perf_counter()
                client.infer(payloads[index % len(payloads)])
                latencies[name].append((time.perf_counter() - began) * 1000)
        windows: dict[str, list[float]] = {name: [] for name in clients}
        for round_index in range(rounds):
            order = list(clients) if round_index % 2 == 0 else list(clients)[::-1]
            for name in order:
                windows[name].append(closed_loop(in_turn(clients[name].infer, payloads), concurrency,
                                                 seconds).throughput)
                log.info("round %d %-12s %.1f images/s", round_index + 1, name, windows[name][-1])
        memory = {name: resident_bytes(process_tree(server.pid or 0)) / 2**20
                  for name, server in servers.items()}
        for client in clients.values():
            client.close()
    return [Result(name, statistics.median(latencies[name]), _percentile(latencies[name], 90),
                   statistics.median(windows[name]), windows[name], memory[name]) for name in candidates]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))]


def table(results: Sequence[Result], changes: dict[str, str], concurrency: int) -> str:
    columns = ["candidate", "changes", "p50 @1 (ms)", "p90 @1 (ms)",
               f"images/s @{concurrency} (median window)", "windows", "Triton PSS MiB"]
    return markdown_table(columns, [
        [r.name, changes.get(r.name) or "—", f"{r.p50_c1_ms:.1f}", f"{r.p90_c1_ms:.1f}",
         f"{r.throughput:.1f}", " / ".join(f"{w:.1f}" for w in r.windows), f"{r.pss_mib:.0f}"]
        for r in results])


def main(argv: list[str] | None = None) -> int:
    parser = cli("bench.compare", __doc__)
    parser.add_argument("--candidate", nargs="+", action="append", default=[],
                        metavar=("NAME", "FIELD=VALUE"),
                        help="a name and its changes to the recorded tuning (repeatable)")
    parser.add_argument("--photos", nargs="+", default=["obama.jpg"])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=8.0, help="each throughput window")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--single", type=int, default=150, help="lone requests per server")
    parser.add_argument("--report", type=Path, help="append the table to this Markdown file")
    args = parser.parse_args(argv)
    log_progress()
    current = ProfileTuning.default(Profile.CPU)
    candidates, changes = {CURRENT: current}, {CURRENT: ""}
    for name, *assignments in args.candidate:
        if name in candidates:
            parser.error(f"two candidates named {name!r}")
        try:
            candidates[name] = changed(current, assignments)
        except (ValueError, TypeError) as exc:
            parser.error(str(exc))
        changes[name] = " ".join(f"`{a}`" for a in assignments)
    if len(candidates) < 2:
        parser.error("name at least one --candidate to compare with the recorded tuning")
    with tempfile.TemporaryDirectory(prefix="bench-compare-") as work:
        rows = compare(candidates, load_photos(args.photos), args.concurrency, args.seconds, args.rounds,
                       args.single, Path(work))
    command = command_line("bench.compare", argv)
    text = (f"Command: `{command}` on {machine_description()}. Photos: {', '.join(args.photos)}; every "
            f"server up at once, the load alternating between them.\n\n"
            f"{table(rows, changes, args.concurrency)}\n")
    print(text)
    if args.report:
        with args.report.open("a") as report:
            report.write("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
