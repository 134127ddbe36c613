"""Which instances of one Triton model are executing right now, as every instance's process sees it.

Triton runs each Python-backend model instance in a process of its own. On a CPU server, an instance that
is the only one working can give a lone request every core (it is answered sooner), while instances
working side by side do better with one thread each (two-thread networks then oversubscribe the cores,
and a second thread's idle spinning takes CPU from the others). This board tells an instance which case
it is in: one byte per instance in a small file in shared memory (``/dev/shm``), 1 while it executes.
Each process writes only its own byte, so no lock is needed; a reading can be a moment stale, which
costs a little parallelism, never a wrong answer.

The file is named after the server's process (the instances' parent) and the model; the last instance
to close removes it, and a file whose server is gone (killed) is removed by the next server's instances.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
from collections.abc import Iterator
from pathlib import Path

#: Instances one board can tell apart (an instance's slot is its index modulo this).
SLOTS = 64
_SIZE = 2 * SLOTS  # a "busy" byte and a "present" byte per slot
_FILE = re.compile(r"facerec-(\d+)-.+\.occupancy")


def default_folder() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path("/tmp")


def instance_slot(instance_name: str) -> int:
    """The slot of a Triton instance name (``face_pipeline_0_2`` -> 2): the number it ends with, or, for a
    name without one, this process's id (two instances sharing a slot would only see each other as
    idle: more threads than cores for a while, never a wrong answer)."""
    match = re.search(r"(\d+)$", instance_name)
    return (int(match.group(1)) if match is not None else os.getpid()) % SLOTS


def remove_stale(folder: Path) -> list[Path]:
    """Boards left by servers that are gone (a killed server does not close its instances)."""
    removed = []
    for path in folder.glob("facerec-*.occupancy"):
        match = _FILE.fullmatch(path.name)
        if match is None or _alive(int(match.group(1))):
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


class Occupancy:
    """One instance's view of the board ``path``; ``slot`` is its own byte."""

    def __init__(self, path: Path, slot: int) -> None:
        if not 0 <= slot < SLOTS:
            raise ValueError(f"slot must be in [0, {SLOTS}), got {slot}")
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(descriptor).st_size < _SIZE:
                os.ftruncate(descriptor, _SIZE)  # zero-filled; idempotent when several open it at once
            self._board = mmap.mmap(descriptor, _SIZE)
        finally:
            os.close(descriptor)
        self.path, self.slot = path, slot
        self._board[slot] = 0
        self._board[SLOTS + slot] = 1

    @classmethod
    def of_instance(cls, model: str, instance_name: str, folder: Path | None = None) -> Occupancy:
        """The board of ``model``'s instances under this server (this process's parent)."""
        folder = default_folder() if folder is None else folder
        remove_stale(folder)
        return cls(folder / f"facerec-{os.getppid()}-{model}.occupancy", instance_slot(instance_name))

    def others_busy(self) -> int:
        """How many other instances are executing now."""
        busy = self._board[:SLOTS]
        return sum(busy) - busy[self.slot]

    def alone(self) -> bool:
        return self.others_busy() == 0

    @contextlib.contextmanager
    def executing(self) -> Iterator[None]:
        self._board[self.slot] = 1
        try:
            yield
        finally:
            self._board[self.slot] = 0

    def close(self) -> None:
        """Leave the board; the last instance to leave removes the file."""
        if self._board.closed:
            return
        self._board[self.slot] = 0
        self._board[SLOTS + self.slot] = 0
        last = not any(self._board[SLOTS:])
        self._board.close()
        if last:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
