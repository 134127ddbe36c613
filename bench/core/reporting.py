"""What every benchmark report shares: the command line and logging, Markdown tables, sections of a shared
Markdown file (between marker comments, replaced in place), and the one description of the machine."""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import platform
import re
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

MIB = 1 << 20
Row = TypeVar("Row")
#: The heading a new report file starts with, by file name (``docs/benchmarks/<name>``).
TITLES = {"README.md": "# Benchmarks", "gallery.md": "# Gallery benchmarks"}


def cli(module: str, doc: str | None) -> argparse.ArgumentParser:
    """The argument parser of ``python -m module``, its help the module's docstring as written."""
    return argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def log_progress(*quiet: str) -> None:
    """Progress lines on stderr; the ``quiet`` loggers' warnings only."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in quiet:
        logging.getLogger(name).setLevel(logging.WARNING)


def command_line(module: str, argv: Sequence[str] | None) -> str:
    """``python -m module`` with ``argv`` (None: this process's arguments), as a report quotes it."""
    return shlex.join(["python", "-m", module, *(sys.argv[1:] if argv is None else argv)])


def run_header(command: str, machine: str) -> str:
    return f"Command: `{command}`  \nDate: {time.strftime('%Y-%m-%d %H:%M %Z')}  \nMachine: {machine}"


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def table(rows: Iterable[Row], columns: Sequence[tuple[str, str | Callable[[Row], object]]]) -> str:
    """A Markdown table, one line per row. Each column is its header and its cell: a ``str.format``
    template given the row (a tuple row: its items), e.g. ``"{0.throughput:.1f}"``, or a function of it."""
    def cell(how: str | Callable[[Row], object], row: Row) -> str:
        if callable(how):
            return str(how(row))
        return how.format(*row) if isinstance(row, tuple) else how.format(row)

    return markdown_table([name for name, _ in columns],
                          [[cell(how, row) for _, how in columns] for row in rows])


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def write_section(path: Path, name: str, text: str) -> None:
    """Replace the section ``name`` of a shared Markdown file (between markers), or append it; a new file
    starts with its title (``TITLES``)."""
    start, end = _markers(name)
    block = f"{start}\n{text.strip()}\n{end}\n"
    current = path.read_text() if path.exists() else f"{TITLES.get(path.name, '# Benchmarks')}\n\n"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end) + r"\n?", re.DOTALL)
    if pattern.search(current):
        updated = pattern.sub(lambda _: block, current, count=1)
    else:
        updated = current.rstrip("\n") + "\n\n" + block
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(updated)


def read_section(text: str, name: str) -> str:
    """The text between the markers of section ``name`` ("" when absent)."""
    start, end = _markers(name)
    return text.split(start, 1)[1].split(end, 1)[0] if start in text else ""


def fmt(value: float | None, digits: int) -> str:
    """``1,234.5`` with ``digits`` decimals, ``—`` for a value that was not measured."""
    return "—" if value is None else f"{value:,.{digits}f}"


def package_version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def os_name() -> str:
    try:
        name = platform.freedesktop_os_release()["PRETTY_NAME"]
    except (OSError, KeyError):
        return platform.platform()
    return f"{name}, kernel {platform.release()}"


#: ``/proc/cpuinfo`` flags that decide how fast the networks (bf16) and FAISS's scans run
CPU_FEATURES = (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_bf16", "AVX-512 BF16"),
                ("amx_bf16", "AMX"))


def cpu_identity(cpuinfo: str | None = None) -> str:
    """The CPU's model name with its family, model and ``CPU_FEATURES``, e.g. ``AMD EPYC (family 26,
    model 2; AVX2, AVX-512, AVX-512 BF16)``: a virtual machine often shows only a generic name, and two
    machines of that name may be generations apart. ``cpuinfo``: ``/proc/cpuinfo``'s text (None: read)."""
    from facecore.runtimes import cpu_model

    if cpuinfo is None:
        cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    first = cpuinfo.split("\n\n", 1)[0]  # the first processor's block
    info = dict(re.findall(r"^(.+?)\s*:\s*(.*)$", first, re.MULTILINE))
    if "model name" not in info:
        return cpu_model()
    flags = set(info.get("flags", "").split())
    features = ", ".join(label for flag, label in CPU_FEATURES if flag in flags)
    numbers = f"family {info.get('cpu family')}, model {info.get('model')}"
    return f"{info['model name']} ({'; '.join(filter(None, (numbers, features)))})"


def _hardware() -> str:
    """CPU (``cpu_identity``), cores, memory, FAISS and numpy versions, and whether FAISS used a GPU."""
    import faiss
    import numpy as np

    from gallery.engines.index import gpu_available

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpus = faiss.get_num_gpus() if gpu_available() else 0
    return (f"{cpu_identity()}, "
            f"{os.cpu_count()} cores ({len(os.sched_getaffinity(0))} usable), "
            f"{memory:.1f} GiB RAM, {platform.system()}; "
            f"faiss {faiss.__version__} ({faiss.get_compile_options().strip()}; "
            f"{faiss.omp_get_max_threads()} OpenMP threads), "
            f"numpy {np.__version__}; "
            f"GPU: {f'yes, {gpus} visible to FAISS' if gpus else 'none used (FAISS sees no GPU)'}")


def _serving_stack(triton: str) -> str:
    import onnxruntime

    server = triton or f"tritonserver from nvidia-pytriton {package_version('nvidia-pytriton')}"
    return (f"OS: {os_name()}; Python {platform.python_version()} ({sys.implementation.name}); "
            f"onnxruntime {onnxruntime.__version__} ({', '.join(onnxruntime.get_available_providers())}); "
            f"{server}; tritonclient {package_version('tritonclient')}; "
            f"fastapi {package_version('fastapi')}, "
            f"uvicorn {package_version('uvicorn')}, opencv {package_version('opencv-python-headless')}")


def machine_description(*, serving: bool = False, triton: str = "") -> str:
    """CPU, cores, RAM, FAISS, numpy, GPU; with ``serving``, also the OS, Python and the serving stack's
    versions (``triton``: the server that ran; default: the bundled wheel's version)."""
    hardware = _hardware()
    return f"{hardware}; {_serving_stack(triton)}" if serving else hardware
