"""What every target of the serving report is made of: the ``Target`` row, pass / falls short, and the
shared explanations (where the CPU went, what is missing). The targets themselves are in
``bench/report_targets.py`` (throughput, runtimes, time outside the networks) and
``bench/report_load_targets.py`` (latency, behaviour under load, memory, gateway CPU)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bench import report_text as text
from bench.core.load import LoadRow
from bench.core.reporting import usable_cores
from bench.report_text import say
from bench.results import Results


@dataclass(frozen=True)
class Target:
    name: str
    measured: str
    status: str  # text.PASS, text.SHORT, text.NOT_MEASURED
    why: str = ""


def status(ok: bool) -> str:
    return text.PASS if ok else text.SHORT


def sentence(why: str) -> str:
    return why + ("." if why else "")


def cpu_line(row: LoadRow) -> str:
    parts = [say(text.CPU_PART, name=text.LOAD_CLIENT, ms=row.client_cpu_ms)]
    parts += [say(text.CPU_PART, name=k, ms=v) for k, v in row.cpu_ms.items()]
    return say(text.CPU_LINE, total=row.cpu_ms_total, parts=", ".join(parts))


def throughput_why(row: LoadRow, reference: float, reference_cpu: float, reference_name: str) -> str:
    cores = usable_cores()
    why = say(text.WHY_THROUGHPUT, target=row.target, cpu_line=cpu_line(row), reference_name=reference_name,
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


def missing(results: Results, parts: Sequence[str]) -> str:
    failed = [f"{name}: {error}" for name, error in results.errors.items() if any(p in name for p in parts)]
    return "; ".join(failed) if failed else text.NOT_IN_RUN


def not_measured(name: str, results: Results, parts: Sequence[str]) -> Target:
    return Target(name, "—", text.NOT_MEASURED, missing(results, parts))
