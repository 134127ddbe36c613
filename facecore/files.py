"""Small file helpers shared by the export tools and the gallery."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import BinaryIO


def sha256_of(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB blocks."""
    with path.open("rb") as handle:
        return sha256_of_handle(handle)


def sha256_of_handle(handle: BinaryIO) -> str:
    """Hex SHA-256 of what is left in an open binary file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    for block in iter(lambda: handle.read(1 << 20), b""):
        digest.update(block)
    return digest.hexdigest()
