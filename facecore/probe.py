"""The recognition probe: one real face photo through ``face_pipeline``, which must answer with a face
and an L2-normalized embedding of the size its config announces.

``is_model_ready`` only says that Triton loaded the models; a pipeline that fails every request (BLS
outputs it cannot read, a broken engine, a missing library in the stub's environment) is "ready" too.
This probe is the readiness check of the gateway (cached, ``service.readiness``), of the Triton
containers (compose healthcheck) and of the Kubernetes Triton pod (readiness probe):

    python -m facecore.probe --url 127.0.0.1:8001 [--image model_repository/cpu/face_pipeline/probe.jpg]

It exits 0 when recognition works, 1 otherwise, and prints one line saying why.

The photo is scikit-image's ``astronaut`` (Eileen Collins, NASA; public domain, shipped inside the
scikit-image wheel), cropped to her head and encoded as JPEG. ``python -m export`` writes it into every
model repository it writes (``face_pipeline/probe.jpg``), so that images without scikit-image (the NGC
Triton image) have it as a file.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from facecore.client import AsyncPipeline, PipelineClient, PipelineError
from facecore.contract import Faces

#: Where ``python -m export`` puts the probe photo, relative to the model repository.
PROBE_FILE = Path("face_pipeline") / "probe.jpg"
#: Head-and-shoulders crop of the 512x512 astronaut (rows, columns): one face, about 90x120 pixels.
_CROP = (slice(20, 276), slice(100, 356))
#: How Triton's Python backend fails a request while a stub process of the model does not respond (stopped,
#: deadlocked) — within a second, while its health endpoints go on answering ready (measured with 2.51).
_STUB_UNHEALTHY = re.compile(r"Stub process '[^']*' is not healthy")


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    detail: str
    checked_at: float  # time.monotonic()

    @staticmethod
    def failed(detail: str) -> ProbeResult:
        return ProbeResult(False, detail, time.monotonic())


def probe_image() -> bytes:
    """The probe photo as JPEG bytes (needs scikit-image, a dependency of the project)."""
    import cv2
    from skimage import data

    astronaut: Callable[[], NDArray[np.uint8]] = data.astronaut  # untyped; an RGB uint8 image
    bgr = cv2.cvtColor(astronaut()[_CROP], cv2.COLOR_RGB2BGR)
    ok, encoded = cv2.imencode(".jpg", bgr, [cv2.IMWRITE_JPEG_QUALITY, 90])
    if not ok:
        raise RuntimeError("OpenCV could not encode the probe image")
    return bytes(encoded.tobytes())


def write_probe_image(repository: Path) -> Path:
    path = repository / PROBE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(probe_image())
    return path


def judge(faces: Faces, embedding_dim: int) -> ProbeResult:
    """Whether ``faces`` is what a working pipeline answers for the probe photo."""
    if len(faces) == 0:
        return ProbeResult.failed("face_pipeline found no face in the probe photo")
    embeddings = faces.embeddings
    if embeddings.shape != (len(faces), embedding_dim):
        return ProbeResult.failed(f"face_pipeline returned embeddings of shape {embeddings.shape}, "
                                  f"expected ({len(faces)}, {embedding_dim})")
    norms = np.linalg.norm(embeddings, axis=1)
    if not np.all(np.isfinite(norms)) or not np.allclose(norms, 1.0, atol=1e-3):
        return ProbeResult.failed(f"face_pipeline returned embeddings that are not unit vectors: {norms}")
    return ProbeResult(True, f"{len(faces)} face, {embedding_dim}-d embedding", time.monotonic())


def stub_unhealthy(result: ProbeResult) -> bool:
    """Whether the probe failed because Triton says that a stub process of its own is not healthy: Triton,
    not the request, is at fault (the supervisor and the Triton containers' liveness check treat it as
    Triton not answering its health check)."""
    return not result.ok and _STUB_UNHEALTHY.search(result.detail) is not None


def probe(client: PipelineClient, image: bytes) -> ProbeResult:
    """The probe with the blocking client (the command line)."""
    try:
        dim = client.embedder().embedding_dim
        return judge(client.infer(image), dim)
    except PipelineError as exc:
        return ProbeResult.failed(f"face_pipeline failed: {exc}")


async def probe_async(pipeline: AsyncPipeline, image: bytes) -> ProbeResult:
    """The probe with the gateway's client."""
    try:
        dim = (await pipeline.embedder()).embedding_dim
        return judge(await pipeline.infer(image), dim)
    except PipelineError as exc:
        return ProbeResult.failed(f"face_pipeline failed: {exc}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m facecore.probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="127.0.0.1:8001", help="Triton gRPC address")
    parser.add_argument("--image", type=Path, help="the probe photo (default: made from scikit-image's data)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds for each call")
    args = parser.parse_args(argv)
    image = args.image.read_bytes() if args.image else probe_image()
    client = PipelineClient(args.url, args.timeout)
    try:
        result = probe(client, image)
    finally:
        client.close()
    print(("ok: " if result.ok else "FAILED: ") + result.detail, flush=True)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
