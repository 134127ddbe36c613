"""CPU time and resident memory of process trees (``tritonserver`` and its Python-backend stubs) from
``/proc``, and child HTTP servers (the gateway, the naive app), stopped as the launcher stops Triton."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.core.inputs import ROOT
from service.launcher import http_status, stop_process

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()  # fields from the 3rd (state) on


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants that are alive now."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    tree, pending = [], [root]
    while pending:
        pid = pending.pop()
        if _stat_fields(pid) is not None:
            tree.append(pid)
            pending += children.get(pid, [])
    return tree


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU seconds of these processes (threads included; exited ones count nothing)."""
    total = 0
    for pid in pids:
        fields = _stat_fields(pid)
        if fields is not None:
            total += int(fields[11]) + int(fields[12])
    return total / CLOCK_TICKS


def rss_bytes(pids: Iterable[int]) -> int:
    """Summed resident set (RSS) of these processes: a page they share counts once per process."""
    total = 0
    for pid in pids:
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
        except (OSError, IndexError, ValueError):
            continue
    return total


def _pss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        return None
    return None


def resident_bytes(pids: Iterable[int]) -> int:
    """The memory these processes hold: their summed PSS (``/proc/PID/smaps_rollup``; RSS where it cannot
    be read). A page n processes share counts 1/n in each, so what Triton's server shares with its stubs
    (the shared-memory regions, the libraries) counts once in a tree's sum, not once per process."""
    total = 0
    for pid in pids:
        pss = _pss_bytes(pid)
        total += pss if pss is not None else rss_bytes([pid])
    return total


@dataclass(frozen=True)
class Watched:
    """A named process (tree) whose CPU and memory a benchmark records."""

    name: str
    root: int
    tree: bool = True

    def pids(self) -> list[int]:
        return process_tree(self.root) if self.tree else [self.root]


@dataclass
class RssSampler:
    """Samples ``resident_bytes`` of watched process trees every ``interval`` seconds in a thread."""

    watched: Sequence[Watched]
    interval: float
    samples: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    def _run(self, began: float) -> None:
        while True:
            sample = {w.name: resident_bytes(w.pids()) for w in self.watched}
            self.samples.append((time.monotonic() - began, sample))
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> RssSampler:
        self._thread = threading.Thread(target=self._run, args=(time.monotonic(),), daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def start_server(command: Sequence[str], env: Mapping[str, str], log_file: Path, ready_url: str,
                 timeout: float = 120.0) -> subprocess.Popen[bytes]:
    """Start ``command`` (output to ``log_file``, its own session) and wait until ``ready_url`` answers."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with log_file.open("ab") as output:
        process = subprocess.Popen(list(command), env=dict(env), stdout=output, stderr=subprocess.STDOUT,
                                   cwd=ROOT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{command[2:4]} exited with code {process.returncode}; see {log_file}")
        if http_status(ready_url) == 200:
            return process
        time.sleep(0.25)
    stop_process(process)
    raise RuntimeError(f"{ready_url} not ready after {timeout:.0f} s; see {log_file}")


def free_port() -> int:
    """A port free on 127.0.0.1 right now, for one child server."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
