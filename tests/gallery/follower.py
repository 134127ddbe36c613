"""A read replica in its own process: ``python -m tests.gallery.follower URL COLLECTION [MILVUS_URI PREFIX]``
(with the last two, a gateway on that Milvus server: its index is Milvus, none in memory).

It loads a Gallery on the shared database, starts the follower thread (``start_follower(0.1)``) and
prints, as one JSON line, what its index holds each time that changes: ``{"faces": {face id: identity
id that a search with the face's own vector ranks first}}``. It prints ``ready`` once following and
exits when its standard input closes.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import numpy as np

from gallery.engines.milvus import MilvusEngine
from gallery.gallery import Gallery
from gallery.store.db import Database, create_db_engine
from gallery.store.store import GalleryStore


def main(url: str, collection: str, milvus: list[str]) -> None:
    store = GalleryStore(Database(create_db_engine(url)))
    gallery = Gallery(store, engine=MilvusEngine(milvus[0], prefix=milvus[1]) if milvus else None)
    gallery.load()
    gallery.start_follower(0.1)
    dimension = store.get_collection(collection).dimension
    print("ready", flush=True)
    closed = threading.Event()

    def watch_stdin() -> None:
        sys.stdin.read()
        closed.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    seen: set[int] | None = None
    while not closed.is_set():
        current = gallery.face_ids(collection)
        if current != seen:
            ids = sorted(current)
            vectors = store.vectors(ids, dimension)
            found: dict[int, int | None] = {}
            if ids:
                results = gallery.search(collection, np.stack([vectors[i] for i in ids if i in vectors]), k=1)
                found = {i: r.candidates[0].identity_id if r.candidates else None
                         for i, r in zip([i for i in ids if i in vectors], results, strict=True)}
            print(json.dumps({"faces": found}), flush=True)
            seen = current
        time.sleep(0.005)
    gallery.stop_follower()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:5])
