"""Searches raced by the changes applied under them: an index filled between a search's first engine call
and its widening (``gallery.search``), and requests batched together that found different
indexes of one collection (``Searcher.search`` with ``SearchBatcher``). Real FAISS, SQLite and PostgreSQL."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from gallery.engines.batching import Arrays, Search, SearchBatcher
from gallery.gallery import Gallery, SearchResult
from gallery.store.store import GalleryStore
from tests.gallery.helpers import MODEL, OTHER_MODEL, new_faces, unit_vectors

pytest_plugins = ["tests.gallery.fixtures"]

DIM = 16


def in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """``call()`` in a daemon thread; its outcome lands in the dict (``result`` or ``error``)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = call()
        except BaseException as exc:  # handed to the test
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


class SyncAfterSearch(SearchBatcher):
    """A batcher after whose engine call the gallery applies the change log: a follower's sync landing
    between a search's first engine call and its widening."""

    gallery: Gallery

    def search(self, key: Any, queries: NDArray[np.float32], k: int, search: Search) -> Arrays:
        found = super().search(key, queries, k, search)
        self.gallery.sync()
        return found


def test_a_search_whose_index_filled_after_its_first_call_ends(store: GalleryStore) -> None:
    """The first call found the index empty (no columns); faces applied before the widening gave it one face
    per call, never more: the search looped for ever (a CPU and a worker thread held) when that face did not
    give k identities. Failed before (the search never returned)."""
    rng = np.random.default_rng(60)
    store.create_collection("c", MODEL, DIM, 0.5)
    batcher = SyncAfterSearch()
    gallery = Gallery(store, batcher=batcher)
    batcher.gallery = gallery
    gallery.load()  # the collection's index is empty
    for person in ("ann", "bob", "cy"):
        store.add_faces("c", person, new_faces(unit_vectors(rng, 2, DIM), tag=person), MODEL,
                        create=(person.title(), {}))
    query = unit_vectors(rng, 1, DIM)
    thread, outcome = in_thread(lambda: gallery.search("c", query, k=2))
    thread.join(10)
    if thread.is_alive():  # stop the spinning search: its next engine call raises
        entry = next(iter(gallery.replica.collections.values()))

        def stopped(*_: Any) -> None:
            raise RuntimeError("stopped by the test")

        entry.index.search = stopped  # type: ignore[method-assign]
        thread.join(5)
        raise AssertionError("the search did not end within 10 s (the widening made no progress)")
    assert "error" not in outcome, outcome
    (result,) = outcome["result"]
    assert isinstance(result, SearchResult)
    assert [(c.external_id, c.face_id) for c in result.candidates] == [
        (c.external_id, c.face_id) for c in gallery.search("c", query, k=2)[0].candidates]
    assert len(result.candidates) == 2


def queued(gallery: Gallery, collection_id: int) -> int:
    queue = gallery.batcher._queues.get(collection_id)
    return 0 if queue is None else len(queue.waiting)


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def test_a_request_is_searched_in_the_index_it_found(store: GalleryStore) -> None:
    """A request queued behind a search of the collection's old index (replaced since by a rebuild that left
    out a deleted face) is searched in the new one, not in the old one with the request that leads the next
    call. Failed before: batched with that leader, it found the deleted face."""
    rng = np.random.default_rng(61)
    store.create_collection("c", MODEL, DIM, 0.5)
    vectors = unit_vectors(rng, 6, DIM)
    _, ann = store.add_faces("c", "ann", new_faces(vectors[:2], tag="ann"), MODEL, create=("Ann", {}))
    for number, person in enumerate(("bob", "cy"), start=1):
        store.add_faces("c", person, new_faces(vectors[2 * number:2 * number + 2], tag=person), MODEL,
                        create=(person.title(), {}))
    gallery = Gallery(store)
    gallery.load()
    collection_id = store.get_collection("c").id
    old = gallery.replica.collections[collection_id]
    entered, release = threading.Event(), threading.Event()
    search = old.index.search

    def held(queries: NDArray[np.float32], k: int) -> tuple[NDArray[Any], ...]:
        entered.set()
        release.wait(10)
        return search(queries, k)

    old.index.search = held  # type: ignore[method-assign]
    first, _ = in_thread(lambda: gallery.search("c", vectors[5], k=1))  # leads a call, held in the engine
    assert entered.wait(10)
    behind, _ = in_thread(lambda: gallery.search("c", vectors[4], k=1))  # found the old index: queued
    wait_until(lambda: queued(gallery, collection_id) == 1, "the request on the old index to queue")
    deleted = ann[0].id
    store.delete_face("c", deleted)
    gallery.rebuild("c")  # a new index, without the deleted face, replaces the one being searched
    assert gallery.replica.collections[collection_id] is not old
    late, outcome = in_thread(lambda: gallery.search("c", vectors[0], k=1))
    wait_until(lambda: queued(gallery, collection_id) == 2, "the request on the new index to queue")
    release.set()
    for thread in (first, behind, late):
        thread.join(10)
    assert "error" not in outcome, outcome
    (result,) = outcome["result"]
    assert result.candidates and result.candidates[0].face_id != deleted, result.candidates
    assert result.candidates == gallery.search("c", vectors[0], k=1)[0].candidates


@pytest.mark.parametrize("change", ["recreated", "reembedded"])
def test_a_collection_changed_as_its_index_is_first_built_is_built_as_it_is_now(
        store: GalleryStore, monkeypatch: pytest.MonkeyPatch, change: str) -> None:
    """A collection's index is built when first used, after the log is applied: deleted and created again
    (or re-embedded) between the read of the collection and that sync, which applied the DROP, the index
    was built for the collection as read before, a deleted one (or the old model), then found by its name
    for ever, no DROP being left to drop it: searches answered from the deleted collection (an empty index)
    or for the old model, until a restart. Failed before."""
    rng = np.random.default_rng(62)
    store.create_collection("c", MODEL, DIM, 0.5)
    store.add_faces("c", "ann", new_faces(unit_vectors(rng, 2, DIM), tag="ann"), MODEL, create=("Ann", {}))
    gallery = Gallery(store)  # not loaded: each index is built when first used
    sync = gallery.sync

    def raced() -> int:
        if change == "recreated":
            store.delete_collection("c")
            store.create_collection("c", MODEL, DIM, 0.5)
            store.add_faces("c", "bob", new_faces(unit_vectors(rng, 3, DIM), tag="bob"), MODEL,
                            create=("Bob", {}))
        else:
            faces = sorted(store.collection_identities(store.get_collection("c").id)[0].tolist())
            store.replace_embeddings("c", faces, unit_vectors(rng, len(faces), DIM), OTHER_MODEL, DIM, 0.5)
        monkeypatch.setattr(gallery, "sync", sync)
        return sync()

    monkeypatch.setattr(gallery, "sync", raced)
    gallery.face_ids("c")
    gallery.sync()
    info = store.get_collection("c")
    assert gallery.collection_info("c") == info
    assert gallery.face_ids("c") == set(store.collection_identities(info.id)[0].tolist())
    vectors = store.collection_vectors(info.id, DIM)[2]
    scores = [r.candidates[0].score for r in gallery.search("c", vectors, k=1)]
    assert scores == pytest.approx([1.0] * len(vectors))
