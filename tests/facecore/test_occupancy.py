"""``facecore/occupancy.py``: which face_pipeline instances are executing, seen across processes."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

from facecore.occupancy import SLOTS, Occupancy, instance_slot, remove_stale


def test_an_instance_sees_the_others_but_not_itself(tmp_path: Path) -> None:
    board = tmp_path / "facerec-1-face_pipeline.occupancy"
    first, second, third = Occupancy(board, 0), Occupancy(board, 1), Occupancy(board, 2)
    assert first.alone() and second.alone()
    with first.executing():
        assert first.alone()  # its own work does not count
        assert second.others_busy() == 1 and not third.alone()
        with second.executing():
            assert first.others_busy() == 1 and third.others_busy() == 2
    assert first.alone() and second.alone() and third.alone()


def test_the_busy_mark_is_cleared_when_the_work_fails(tmp_path: Path) -> None:
    board = tmp_path / "facerec-1-m.occupancy"
    first, second = Occupancy(board, 0), Occupancy(board, 1)
    with pytest.raises(RuntimeError), first.executing():
        raise RuntimeError("a failed execute")
    assert second.alone()


def _busy_until_told(board: Path, ready: multiprocessing.synchronize.Event,
                     done: multiprocessing.synchronize.Event) -> None:
    with Occupancy(board, 5).executing():
        ready.set()
        done.wait(30)


def test_the_board_is_shared_between_processes(tmp_path: Path) -> None:
    board = tmp_path / "facerec-1-face_pipeline.occupancy"
    mine = Occupancy(board, 0)
    context = multiprocessing.get_context("spawn")
    ready, done = context.Event(), context.Event()
    other = context.Process(target=_busy_until_told, args=(board, ready, done))
    other.start()
    try:
        assert ready.wait(60)
        assert mine.others_busy() == 1 and not mine.alone()
    finally:
        done.set()
        other.join(60)
    assert mine.alone()


def test_the_last_instance_to_close_removes_the_file(tmp_path: Path) -> None:
    board = tmp_path / "facerec-1-m.occupancy"
    first, second = Occupancy(board, 0), Occupancy(board, 1)
    first.close()
    assert board.exists()
    second.close()
    second.close()  # twice is harmless
    assert not board.exists()


def test_boards_of_servers_that_are_gone_are_removed(tmp_path: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead = tmp_path / f"facerec-{gone.stdout.strip()}-face_pipeline.occupancy"
    alive = tmp_path / f"facerec-{os.getpid()}-face_pipeline.occupancy"
    other = tmp_path / "unrelated.occupancy"
    for path in (dead, alive, other):
        path.write_bytes(bytes(2 * SLOTS))
    assert remove_stale(tmp_path) == [dead]
    assert alive.exists() and other.exists() and not dead.exists()


def test_of_instance_names_the_board_after_the_server_and_takes_the_instance_index(tmp_path: Path) -> None:
    board = Occupancy.of_instance("face_pipeline", "face_pipeline_0_2", tmp_path)
    assert board.path == tmp_path / f"facerec-{os.getppid()}-face_pipeline.occupancy"
    assert board.slot == 2
    assert instance_slot("face_pipeline_0_70") == 70 % SLOTS
    assert instance_slot("face_pipeline") == os.getpid() % SLOTS  # no index: a slot all the same
    with pytest.raises(ValueError, match="slot"):
        Occupancy(tmp_path / "x.occupancy", SLOTS)
