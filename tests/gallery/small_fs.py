"""A small filesystem that a test fills up: a tmpfs of a few MB mounted on a folder (root only; the tests
that need one skip where mounting is not permitted), and ballast that takes every free byte."""

from __future__ import annotations

import errno
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

CHUNK = 64 * 1024


@contextmanager
def small_filesystem(folder: Path, size: str = "2m") -> Iterator[Path]:
    """``folder`` (created) with a tmpfs of ``size`` mounted on it; a test skips where mount is refused."""
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(folder)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (root and CAP_SYS_ADMIN needed): {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        # lazily: a file a dying thread still holds open must not leave the mount behind
        subprocess.run(["umount", "-l", str(folder)], capture_output=True, check=False)


def fill(folder: Path) -> Path:
    """Write a ballast file in ``folder`` until its filesystem has no byte left; returns it (delete it to
    give the space back)."""
    ballast = folder / "ballast"
    block = b"\0" * CHUNK
    with ballast.open("wb", buffering=0) as handle:
        size = CHUNK
        while size:
            try:
                handle.write(block[:size])
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                size //= 2  # down to the last byte
    return ballast
