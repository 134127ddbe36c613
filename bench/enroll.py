"""Enrollment throughput: the batch importer against raw ``face_pipeline`` on the same images.

    python -m bench.enroll                       # 200 images, 8 in flight, starts the bundled Triton
    python -m bench.enroll --url 127.0.0.1:8001  # a running Triton

Distinct one-face JPEGs made from the four test portraits (a random crop, rescale, colour shift and JPEG
quality). The raw run sends them through ``face_pipeline`` with as many requests in flight as the import,
``recognition.importer.Importer``, into a fresh SQLite database. Import / raw is what the importer costs
on top of inference (target: >= 0.9). docs/benchmarks/gallery.md says how to read the section.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import cv2
import numpy as np
from numpy.typing import NDArray

from bench.core import reporting
from bench.core.inputs import ARTIFACTS, REPOSITORY, ROOT, photo_paths
from bench.core.triton import triton_url
from facecore.client import AsyncPipelineClient
from facecore.spec import ModelSpec
from gallery.cli import open_store
from recognition.importer import Importer, ImportItem, ImportOptions, Status

SOURCES = ("obama.jpg", "obama2.jpg", "obama3.jpg", "biden.jpg")
MIN_FACE = 90  # pixels: well above the quality gate's 40 after rescaling

log = logging.getLogger(__name__)


def variant(image: NDArray[np.uint8], box: Sequence[float], rng: np.random.Generator) -> bytes:
    """A crop around the face with random margins, rescaled, colour-shifted, JPEG at a random quality."""
    height, width = image.shape[:2]
    x1, y1, x2, y2 = box
    size = max(x2 - x1, y2 - y1)
    left, top = (int(max(0.0, v - size * rng.uniform(0.3, 1.2))) for v in (x1, y1))
    right = int(min(width, x2 + size * rng.uniform(0.3, 1.2)))
    bottom = int(min(height, y2 + size * rng.uniform(0.3, 1.2)))
    scale = max(rng.uniform(0.5, 1.0), MIN_FACE / min(x2 - x1, y2 - y1))
    crop = cv2.resize(image[top:bottom, left:right], None, fx=scale, fy=scale,
                      interpolation=cv2.INTER_AREA if scale < 1 else cv2.INTER_LINEAR)
    shifted = np.clip(crop.astype(np.int16) + rng.integers(-12, 13, size=3), 0, 255).astype(np.uint8)
    ok, encoded = cv2.imencode(".jpg", shifted, [cv2.IMWRITE_JPEG_QUALITY, int(rng.integers(85, 96))])
    if not ok:
        raise RuntimeError("JPEG encoding failed")
    return encoded.tobytes()


async def prepare_images(client: AsyncPipelineClient, photos: dict[str, Path],
                         boxes: dict[str, Sequence[float]], count: int, folder: Path, concurrency: int,
                         seed: int = 0) -> list[Path]:
    """``count`` JPEGs with pairwise different sha256, cycling through the source photos, each holding
    exactly one face according to ``face_pipeline`` (a variant where it finds another is replaced)."""
    rng = np.random.default_rng(seed)
    images = {name: np.asarray(cv2.imread(str(photos[name]), cv2.IMREAD_COLOR), dtype=np.uint8)
              for name in SOURCES}
    seen: set[str] = set()

    def fresh(index: int) -> bytes:
        name = SOURCES[index % len(SOURCES)]
        while True:
            data = variant(images[name], boxes[name], rng)
            digest = hashlib.sha256(data).hexdigest()
            if digest not in seen:
                seen.add(digest)
                return data

    payloads = [fresh(i) for i in range(count)]
    pending = list(range(count))
    for _ in range(5):
        counts = await face_counts(client, [payloads[i] for i in pending], concurrency)
        failed = [(i, c) for i, c in zip(pending, counts, strict=True) if c != 1]
        pending = [i for i, _ in failed]
        if not pending:
            break
        log.info("replacing %d variant(s) without exactly one face: %s", len(failed),
                 ", ".join(f"#{i} of {SOURCES[i % len(SOURCES)]} ({c} faces)" for i, c in failed))
        for i in pending:
            payloads[i] = fresh(i)
    else:
        raise RuntimeError(f"could not make {count} one-face images: {len(pending)} variants keep failing")
    paths = [folder / f"{i:05d}-{Path(SOURCES[i % len(SOURCES)]).stem}.jpg" for i in range(count)]
    for path, data in zip(paths, payloads, strict=True):
        path.write_bytes(data)
    return paths


async def face_counts(client: AsyncPipelineClient, payloads: Sequence[bytes], concurrency: int) -> list[int]:
    slots = asyncio.Semaphore(concurrency)

    async def one(data: bytes) -> int:
        async with slots:  # with the crops, as the importer asks for them
            return len(await client.infer(data, return_crops=True))

    return list(await asyncio.gather(*(one(data) for data in payloads)))


async def source_boxes(client: AsyncPipelineClient, photos: dict[str, Path]) -> dict[str, Sequence[float]]:
    """The one face box of each source photo (every variant keeps it whole)."""
    boxes: dict[str, Sequence[float]] = {}
    for name in SOURCES:
        faces = await client.infer(photos[name].read_bytes())
        if len(faces) != 1:
            raise RuntimeError(f"{name}: expected one face, found {len(faces)}")
        boxes[name] = [float(v) for v in faces.boxes[0]]
    return boxes


@dataclass
class Run:
    path: str  # "face_pipeline (raw)" or "import"
    database: str
    images: int
    faces: int  # raw: images with exactly one face; import: faces enrolled
    seconds: float
    cpu_seconds: float  # this process (client side: decode, hashing, crops, SQL)
    statuses: dict[str, int] = field(default_factory=dict)


async def raw_run(client: AsyncPipelineClient, payloads: Sequence[bytes], concurrency: int) -> Run:
    cpu, began = time.process_time(), time.perf_counter()
    counts = await face_counts(client, payloads, concurrency)
    return Run("face_pipeline (raw)", "—", len(payloads), sum(c == 1 for c in counts),
               time.perf_counter() - began, time.process_time() - cpu)


async def import_run(client: AsyncPipelineClient, spec: ModelSpec, url: str, items: list[ImportItem],
                     concurrency: int) -> Run:
    """One import into a new collection of the database at ``url``."""
    store = open_store(url)
    collection = f"bench-enroll-{uuid.uuid4().hex[:8]}"
    store.create_collection(collection, spec.name, spec.embedding_dim, spec.match_threshold)
    try:
        importer = Importer(store, client, ImportOptions(collection, spec.name, concurrency))
        cpu, began = time.process_time(), time.perf_counter()
        results = await importer.run(items, show_progress=False)
        seconds, cpu_seconds = time.perf_counter() - began, time.process_time() - cpu
    finally:
        store.delete_collection(collection)
        store.db.engine.dispose()
    statuses = Counter(r.status.value for r in results)
    database = store.db.engine.dialect.name
    return Run("import", database, len(items), statuses.get(Status.IMPORTED.value, 0), seconds, cpu_seconds,
               dict(statuses))


async def benchmark(url: str, photos: dict[str, Path], folder: Path, count: int, concurrency: int,
                    per_identity: int, repeats: int) -> list[list[Run]]:
    """Make and check the images (which also warms Triton up), then ``repeats`` rounds of both paths, the
    import into a new SQLite file each round."""
    client = AsyncPipelineClient(url)
    try:
        spec = await client.embedder()
        paths = await prepare_images(client, photos, await source_boxes(client, photos), count, folder,
                                     concurrency)
        payloads = [path.read_bytes() for path in paths]
        items = [ImportItem(path, f"person-{i // per_identity:05d}", f"Person {i // per_identity}")
                 for i, path in enumerate(paths)]
        targets = ("raw", "import")

        async def one(target: str) -> Run:
            if target == "raw":
                return await raw_run(client, payloads, concurrency)
            fresh = f"sqlite:///{folder / f'gallery-{uuid.uuid4().hex[:8]}.db'}"
            return await import_run(client, spec, fresh, items, concurrency)

        rounds = []
        for round_ in range(repeats):  # each round starts with the other path: drift hits both alike
            order = [(round_ + j) % len(targets) for j in range(len(targets))]
            done = {j: await one(targets[j]) for j in order}
            runs = [done[j] for j in range(len(targets))]
            rounds.append(runs)
            log.info("round: %s", ", ".join(f"{r.path}/{r.database} {r.faces / r.seconds:.1f} faces/s"
                                            for r in runs))
        return rounds
    finally:
        await client.close()


def summary(rounds: list[list[Run]]) -> list[dict[str, Any]]:
    """Per path: the run with the median time, and its throughput relative to the raw pipeline's."""
    rows = []
    for runs in zip(*rounds, strict=True):
        median = sorted(runs, key=lambda r: r.seconds)[len(runs) // 2]
        rows.append({**asdict(median), "faces_per_s": median.faces / median.seconds,
                     "all_faces_per_s": [r.faces / r.seconds for r in runs]})
    raw = rows[0]["faces_per_s"]
    for row in rows:
        row["vs_raw"] = row["faces_per_s"] / raw
    return rows


COLUMNS: tuple[tuple[str, Any], ...] = (
    ("path", "{0[path]}"), ("database", "{0[database]}"), ("images", "{0[images]}"), ("faces", "{0[faces]}"),
    ("seconds (median)", "{0[seconds]:.2f}"), ("faces/s", "{0[faces_per_s]:.1f}"),
    ("vs raw", "{0[vs_raw]:.2f}"),
    ("faces/s, every round", lambda r: " / ".join(f"{v:.1f}" for v in r["all_faces_per_s"])),
    ("client CPU ms/image", lambda r: f"{1000 * r['cpu_seconds'] / r['images']:.1f}"),
    ("statuses", lambda r: ", ".join(f"{k} {v}" for k, v in sorted(r["statuses"].items())) or "—"))


def table(rows: list[dict[str, Any]]) -> str:
    return reporting.table(rows, COLUMNS)


def document(command: str, triton: str, concurrency: int, per_identity: int,
             rows: list[dict[str, Any]]) -> str:
    return "\n\n".join([
        "## Enrollment throughput: import vs raw pipeline (`bench/enroll.py`)",
        f"{reporting.run_header(command, reporting.machine_description())}  \nTriton: {triton}; "
        f"{concurrency} requests in flight; {per_identity} images per identity",
        table(rows),
    ])


def main(argv: list[str] | None = None) -> int:
    parser = reporting.cli("bench.enroll", __doc__)
    parser.add_argument("--images", type=int, default=200, help="distinct images to enroll (default: 200)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (default: 8)")
    parser.add_argument("--url", help="gRPC address of a running Triton (default: start the bundled one)")
    parser.add_argument("--repository", type=Path, default=REPOSITORY)
    parser.add_argument("--per-identity", type=int, default=4, help="images per identity (default: 4)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; the median is reported (default: 3)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "gallery.md")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    reporting.log_progress("alembic")
    photos = photo_paths()
    triton = (f"running server at {args.url}" if args.url else
              f"bundled tritonserver, repository {args.repository.relative_to(ROOT)}")
    with ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-enroll-")))
        url = stack.enter_context(triton_url(args.url, args.repository,
                                             ARTIFACTS / "bench-enroll-tritonserver.log"))
        rounds = asyncio.run(benchmark(url, photos, folder, args.images, args.concurrency, args.per_identity,
                                       args.repeats))
    rows = summary(rounds)
    command = reporting.command_line("bench.enroll", argv)
    text = document(command, triton, args.concurrency, args.per_identity, rows)
    print(text)
    reporting.write_section(args.out, "bench.enroll", text)
    if args.json:
        args.json.write_text(json.dumps({"command": command, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
