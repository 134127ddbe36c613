"""Do searches pause while the gallery writes a snapshot or applies an import?

    python -m bench.gallery_pauses          # a 200k x 128 collection beside a 200-face one (~2 min)
    python -m bench.gallery_pauses --faces 20000 --rounds 2

A gateway's gallery does more than search: every ``snapshot_interval_s`` (and a few seconds after
deletions) it writes each collection's index to disk, and its follower applies what other processes
enrolled (an import: thousands of faces at a time, their vectors read from the database). Here one
thread searches a small collection without pause (one query at a time, 2 ms apart) while the gallery
writes snapshots of a large collection and applies imports into it, on SQLite; each search's latency is
reported by what it overlapped. The large collection is kept exact (``exact_max`` above its size): what
a snapshot costs depends on the bytes written, not on the index kind. Writes a Markdown section to
``--out``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from bench.core.inputs import ROOT
from bench.core.reporting import fmt, machine_description, markdown_table, write_section
from gallery.engines.index import IndexConfig
from gallery.gallery import Gallery
from gallery.store.db import Database, create_db_engine, migrate
from gallery.store.store import GalleryStore, NewFace

MODEL = "bench-model"
PER_IDENTITY = 1000  # faces per identity of the large collection (fewer rows to write than one each)


def faces(rng: np.random.Generator, count: int, dimension: int, tag: str) -> list[NewFace]:
    vectors = rng.standard_normal((count, dimension)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return [NewFace(embedding=v, image_sha256=f"{tag}-{n}", box=(0.0, 0.0, 1.0, 1.0), detection_score=1.0)
            for n, v in enumerate(vectors)]


def enroll(store: GalleryStore, collection: str, rng: np.random.Generator, count: int, dimension: int,
           tag: str) -> None:
    for first in range(0, count, PER_IDENTITY):
        person = f"{tag}{first // PER_IDENTITY}"
        store.add_faces(collection, person, faces(rng, min(PER_IDENTITY, count - first), dimension, person),
                        MODEL, create=(person.upper(), {}))


class Searches:
    """One thread searching ``collection`` one query at a time until stopped: (start, end) of each."""

    def __init__(self, gallery: Gallery, collection: str, query: NDArray[np.float32]) -> None:
        self.spans: list[tuple[float, float]] = []
        self._stop = threading.Event()

        def run() -> None:
            while not self._stop.is_set():
                began = time.perf_counter()
                gallery.search(collection, query)
                self.spans.append((began, time.perf_counter()))
                time.sleep(0.002)

        self._thread = threading.Thread(target=run, name="searches", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def during(self, windows: list[tuple[float, float]]) -> NDArray[np.float64]:
        """Latencies (ms) of the searches that overlapped any of ``windows``."""
        return np.array([(end - start) * 1000 for start, end in self.spans
                         if any(start < w_end and end > w_start for w_start, w_end in windows)])


def timed(call: Callable[[], object]) -> tuple[float, float]:
    began = time.perf_counter()
    call()
    return began, time.perf_counter()


def measure(size: int, dimension: int, imported: int, rounds: int) -> list[list[str]]:
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="pauses-") as folder:
        engine = create_db_engine(f"sqlite:///{folder}/gallery.db")
        migrate(engine)
        store = GalleryStore(Database(engine))
        for name in ("large", "small"):
            store.create_collection(name, MODEL, dimension, 0.5)
        enroll(store, "large", rng, size, dimension, "l")
        enroll(store, "small", rng, 200, dimension, "s")
        exact = IndexConfig(exact_max=2 * (size + imported * rounds))
        gallery = Gallery(store, Path(folder) / "snapshots", exact)
        gallery.load()
        query = faces(rng, 1, dimension, "q")[0].embedding[None]
        gallery.search("small", query)
        searches = Searches(gallery, "small", query)
        time.sleep(1.0)
        idle = len(searches.spans)
        snapshots, syncs = [], []
        for number in range(rounds):
            snapshots.append(timed(lambda: gallery.snapshot("large")))
            time.sleep(0.5)
            enroll(store, "large", rng, imported, dimension, f"i{number}-")  # another process's import
            syncs.append(timed(gallery.sync))  # the follower's next interval applies it
            time.sleep(0.5)
        searches.stop()
    rows = [["none (idle, 1 s)", "—", *row(np.array([(e - s) * 1000 for s, e in searches.spans[:idle]]))]]
    for label, windows in ((f"snapshot of the {size:,}-face collection", snapshots),
                           (f"sync applying {imported:,} new faces", syncs)):
        took = " / ".join(f"{end - start:.2f}" for start, end in windows)
        rows.append([label, took, *row(searches.during(windows))])
    return rows


def row(latencies: NDArray[np.float64]) -> list[str]:
    if not len(latencies):
        return ["0", "—", "—", "—"]
    p50, p99 = np.percentile(latencies, [50, 99])
    return [str(len(latencies)), fmt(float(p50), 2), fmt(float(p99), 2), fmt(float(latencies.max()), 1)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gallery_pauses", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faces", type=int, default=200_000, help="faces of the large collection "
                        "(default: %(default)s)")
    parser.add_argument("--dim", type=int, default=128, help="(default: %(default)s)")
    parser.add_argument("--import", dest="imported", type=int, default=5000, help="faces per import "
                        "(default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="snapshots and imports (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "gallery.md")
    args = parser.parse_args(argv)
    if args.faces < 1 or args.imported < 1 or args.rounds < 1:
        parser.error("--faces, --import and --rounds must be >= 1")
    rows = measure(args.faces, args.dim, args.imported, args.rounds)
    command = "python -m bench.gallery_pauses " + " ".join(argv if argv is not None else sys.argv[1:])
    text = "\n\n".join([
        "## Searches while the gallery writes snapshots and applies imports (`bench/gallery_pauses.py`)",
        f"Command: `{command.strip()}`  \nDate: {time.strftime('%Y-%m-%d %H:%M %Z')}  \n"
        f"Machine: {machine_description()}",
        markdown_table(["while", "it took (s)", "searches of the 200-face collection", "p50 ms", "p99 ms",
                        "max ms"], rows),
    ])
    print(text)
    write_section(args.out, "bench.gallery_pauses", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
