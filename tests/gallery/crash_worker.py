"""A gallery writer that runs until it is killed:
``python -m tests.gallery.crash_worker URL SNAPSHOTS SEED [MILVUS_URI PREFIX]`` (with the last two its
gallery's engine is that Milvus server, collection names starting with PREFIX).

It migrates, loads the gallery (snapshots + replay), writes a first snapshot, then loops forever:
random enrolls (new and existing identities, 1-4 faces), face deletes and identity deletes through
GalleryStore, each followed by ``Gallery.sync()``, and a snapshot every few operations. It prints a
line at each stage (``started``, ``migrating``, ``loading``, ``snapshotting``, ``running``) so that
tests/gallery/test_consistency.py can SIGKILL it at a chosen moment.

``GALLERY_CRASH_PAUSE`` holds it still where a kill is otherwise hard to land: ``ddl`` stops inside
the migration transaction right after its first CREATE TABLE of a gallery table (prints
``paused-in-ddl``); ``fsync:N`` stops at the N-th ``os.fsync`` (snapshots fsync the index, then the
metadata: an even N leaves a new index next to the previous metadata) and prints ``paused-in-fsync``;
``record:N`` (Milvus) stops in the N-th recording of the applied position, after the changes were
written to Milvus and before the position that includes them is (prints ``paused-in-record``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import Engine, event

from gallery.engines.milvus import MilvusEngine
from gallery.errors import Conflict
from gallery.gallery import Gallery
from gallery.store.db import Database, create_db_engine, migrate
from gallery.store.store import GalleryStore, NewFace

COLLECTION = "crash"
MODEL = "crash-model"
DIMENSION = 16


def say(stage: str) -> None:
    print(stage, flush=True)


def faces(rng: np.random.Generator, count: int, tag: str) -> list[NewFace]:
    vectors = rng.standard_normal((count, DIMENSION)).astype(np.float32)
    return [NewFace(embedding=v, image_sha256=f"{tag}-{n}".ljust(64, "0")[:64], box=[0, 0, 10, 10],
                    detection_score=0.9, crop=b"crop") for n, v in enumerate(vectors)]


def pause_milvus(engine: MilvusEngine, pause: str) -> None:
    if not pause.startswith("record:"):
        return
    target, calls, real_record = int(pause.split(":")[1]), 0, engine.record

    def record(seq: int) -> None:
        nonlocal calls
        calls += 1
        if calls == target:
            say("paused-in-record")
            time.sleep(60)
        real_record(seq)

    engine.record = record  # type: ignore[method-assign]


def install_pause(engine: Engine, pause: str) -> None:
    if pause == "ddl":
        def in_ddl(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
            if statement.lstrip().upper().startswith("CREATE TABLE") and "alembic_version" not in statement:
                say("paused-in-ddl")
                time.sleep(60)

        event.listen(engine, "after_cursor_execute", in_ddl)
    elif pause.startswith("fsync:"):
        target, calls, real_fsync = int(pause.split(":")[1]), 0, os.fsync

        def fsync(fd: int) -> None:
            nonlocal calls
            calls += 1
            if calls == target:
                say("paused-in-fsync")
                time.sleep(60)
            real_fsync(fd)

        os.fsync = fsync


def main(url: str, snapshot_dir: Path, seed: int, milvus: list[str]) -> None:
    say("started")
    rng = np.random.default_rng(seed)
    engine = create_db_engine(url)
    install_pause(engine, os.environ.get("GALLERY_CRASH_PAUSE", ""))
    say("migrating")
    migrate(engine)
    store = GalleryStore(Database(engine))
    with contextlib.suppress(Conflict):  # made by an earlier run
        store.create_collection(COLLECTION, MODEL, DIMENSION, 0.5)
    vectors = None
    if milvus:
        vectors = MilvusEngine(milvus[0], prefix=milvus[1])
        pause_milvus(vectors, os.environ.get("GALLERY_CRASH_PAUSE", ""))
    gallery = Gallery(store, snapshot_dir, engine=vectors)
    say("loading")
    gallery.load()
    say("snapshotting")
    gallery.snapshot()
    say("running")
    identities = [i.external_id for i in store.list_identities(COLLECTION, limit=1_000_000)[0]]
    operations = 0
    while True:
        operations += 1
        choice = rng.random()
        tag = f"s{seed}-{operations}"
        if choice < 0.35 or not identities:  # a new identity
            store.add_faces(COLLECTION, tag, faces(rng, int(rng.integers(1, 5)), tag), MODEL,
                            create=(tag, {}))
            identities.append(tag)
        elif choice < 0.6:  # more faces for an existing one
            external = identities[int(rng.integers(len(identities)))]
            store.add_faces(COLLECTION, external, faces(rng, int(rng.integers(1, 5)), tag), MODEL)
        elif choice < 0.85:  # one face
            present = sorted(gallery.face_ids(COLLECTION))
            if present:
                store.delete_face(COLLECTION, present[int(rng.integers(len(present)))])
        else:  # a whole identity
            external = identities.pop(int(rng.integers(len(identities))))
            store.delete_identity(COLLECTION, external)
        gallery.sync()
        if operations % int(rng.integers(2, 7)) == 0:
            gallery.snapshot()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4:6])
