"""JPEG decoding through libjpeg-turbo's TurboJPEG API (``simplejpeg``), with EXIF orientation applied.

libjpeg-turbo is also what OpenCV's ``imdecode`` runs (simplejpeg bundles its own build): the same pixels,
bit-identical on the test photos at full size and at 1/2, 1/4, 1/8 scale, but ``imdecode`` spends more
time around it. The fast path is taken only when it is sure to give what OpenCV gives; for
anything else (a JPEG TurboJPEG cannot read, a damaged file, EXIF it cannot read, simplejpeg not
installed) ``decode`` returns None and the caller decodes with OpenCV as before.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from types import ModuleType
from typing import cast

import cv2
import numpy as np
from numpy.typing import NDArray

try:
    turbo: ModuleType | None = importlib.import_module("simplejpeg")
except ImportError:  # an image without it decodes every JPEG with OpenCV
    turbo = None

ImageArray = NDArray[np.uint8]

_EXIF = b"Exif\x00\x00"
_ORIENTATION_TAG = 0x0112


#: Marker segments a JPEG may have before its first scan. Real files have tens (APPn metadata split in
#: 64 KiB chunks stays in the hundreds for a 10 MiB upload); a body of empty segments would otherwise
#: cost seconds of walking in Python, on the gateway's event loop.
MAX_SEGMENTS = 1024
#: Fill bytes (0xFF) in a row before a marker: encoders write a few, if any.
MAX_FILL = 4096


def markers(data: bytes) -> Iterator[tuple[int, int]]:
    """(marker, position) of each marker segment of a JPEG after its SOI, in order, up to and including the
    first scan (SOS) or the end of image (EOI); fill bytes and standalone markers are stepped over. A byte
    where a marker should be gives (-1, position) and ends the walk; so do the end of the data and more
    than ``MAX_SEGMENTS`` markers."""
    position = 2
    for _ in range(MAX_SEGMENTS):
        if position + 4 > len(data):
            return
        if data[position] != 0xFF:
            yield -1, position
            return
        marker = data[position + 1]
        if marker == 0xFF:  # fill bytes, stepped over at once; a run longer than any encoder writes ends it
            run = data[position + 1:position + 1 + MAX_FILL]
            rest = run.lstrip(b"\xff")
            if not rest:
                yield -1, position
                return
            position += len(run) - len(rest)
            continue
        if marker in (0x01, *range(0xD0, 0xD8)):  # standalone markers
            position += 2
            continue
        yield marker, position
        if marker in (0xD9, 0xDA):
            return
        position += 2 + int.from_bytes(data[position + 2:position + 4], "big")
    yield -1, position


def exif_orientation(data: bytes) -> int | None:
    """The EXIF orientation (1-8; 1 when there is none) from the APP1 segment before the first scan;
    None when the segments or the EXIF block cannot be read with certainty."""
    for marker, position in markers(data):
        if marker == -1:
            return None
        if marker in (0xD9, 0xDA):  # the EXIF block comes before the scan, or there is none
            return 1
        if marker == 0xE1:
            length = int.from_bytes(data[position + 2:position + 4], "big")
            segment = data[position + 4:position + 2 + length]
            if segment.startswith(_EXIF):
                return _orientation_in(segment[len(_EXIF):])
    return None


def _orientation_in(tiff: bytes) -> int | None:
    order = {b"II": "little", b"MM": "big"}.get(tiff[:2])
    if order is None or len(tiff) < 8:
        return None

    def number(at: int, size: int) -> int:
        return int.from_bytes(tiff[at:at + size], order)  # type: ignore[arg-type]

    if number(2, 2) != 42:
        return None
    ifd = number(4, 4)
    if ifd + 2 > len(tiff):
        return None
    for entry in range(ifd + 2, ifd + 2 + 12 * number(ifd, 2), 12):
        if entry + 12 > len(tiff):
            return None
        if number(entry, 2) == _ORIENTATION_TAG:
            value = number(entry + 8, 2) if number(entry + 2, 2) == 3 else 0  # SHORT
            return value if 1 <= value <= 8 else None
    return 1


def _orient(image: ImageArray, orientation: int) -> ImageArray:
    """What OpenCV's ``imdecode`` does for each EXIF orientation (loadsave.cpp, ExifTransform)."""
    if orientation >= 5:
        image = cast(ImageArray, cv2.transpose(image))
    flip = {2: 1, 3: -1, 4: 0, 6: 1, 7: -1, 8: 0}.get(orientation)
    return image if flip is None else cast(ImageArray, cv2.flip(image, flip))


def decode(data: bytes, width: int, height: int, factor: int = 1) -> ImageArray | None:
    """BGR pixels of a width x height JPEG decoded at 1/``factor`` scale (1, 2, 4 or 8) and oriented as
    its EXIF says, as OpenCV would; None to leave it to OpenCV."""
    if turbo is None:
        return None
    orientation = exif_orientation(data)
    if orientation is None:
        return None
    out_w, out_h = -(-width // factor), -(-height // factor)
    try:
        if factor == 1:
            image = cast(ImageArray, turbo.decode_jpeg(data, "BGR"))
        else:  # TurboJPEG picks the smallest M/8 scale giving at least this size: exactly 1/factor
            image = cast(ImageArray, turbo.decode_jpeg(data, "BGR", min_width=out_w, min_height=out_h))
    except ValueError:
        return None
    if image.shape != (out_h, out_w, 3):
        return None
    return _orient(image, orientation)
