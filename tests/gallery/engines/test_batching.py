"""Concurrent searches of one collection are made in one engine call (gallery/engines/batching.py)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from gallery.engines.batching import SearchBatcher
from gallery.gallery import Gallery
from gallery.store.store import GalleryStore
from tests.gallery.helpers import MODEL, new_faces, unit_vectors

pytest_plugins = ["tests.gallery.fixtures"]


class Recorder:
    """A search that echoes each query's first value at every rank, blocked until released."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []  # (queries, k) per call
        self.release = threading.Event()
        self.fail = False

    def __call__(self, queries: NDArray[np.float32], k: int) -> tuple[NDArray[Any], ...]:
        self.calls.append((len(queries), k))
        self.release.wait(10)
        if self.fail:
            raise RuntimeError("engine down")
        ranks = np.arange(k)[None, :]
        return np.repeat(queries[:, :1], k, axis=1), queries[:, :1].astype(np.int64) * 100 + ranks


def waiting(batcher: SearchBatcher, key: str) -> int:
    queue = batcher._queues.get(key)
    return 0 if queue is None else len(queue.waiting)


def test_requests_queued_behind_a_running_search_go_in_one_call() -> None:
    batcher, search = SearchBatcher(), Recorder()
    results: dict[int, tuple[NDArray[Any], ...]] = {}

    def request(number: int) -> None:
        queries = np.full((1 + number % 2, 4), number, np.float32)  # 1 or 2 queries each
        results[number] = batcher.search("c", queries, 3 + number, search)

    first = threading.Thread(target=request, args=(0,))
    first.start()
    while not search.calls:
        time.sleep(0.001)
    others = [threading.Thread(target=request, args=(n,)) for n in range(1, 10)]
    for thread in others:
        thread.start()
    deadline = time.monotonic() + 10
    while waiting(batcher, "c") < 9 and time.monotonic() < deadline:
        time.sleep(0.001)
    search.release.set()
    for thread in [first, *others]:
        thread.join(10)
    queued = sum(1 + n % 2 for n in range(1, 10))
    assert search.calls == [(1, 3), (queued, 12)]  # the lone first, then everyone queued behind it, max k
    assert (batcher.calls, batcher.queries) == (2, 1 + queued)
    for number, (scores, ids) in results.items():
        assert scores.shape == ids.shape == (1 + number % 2, 3 + number)  # own rows, own k
        assert (scores == number).all() and (ids // 100 == number).all()
        assert ids[0].tolist() == [number * 100 + r for r in range(3 + number)]


def test_an_engine_error_reaches_every_request_of_its_batch_and_the_next_batch_runs() -> None:
    batcher, search = SearchBatcher(max_queries=4), Recorder()
    search.fail = True
    errors: list[BaseException] = []

    def request() -> None:
        try:
            batcher.search("c", np.ones((1, 4), np.float32), 2, search)
        except RuntimeError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=request) for _ in range(6)]
    for thread in threads:
        thread.start()
    while waiting(batcher, "c") < 5 and search.calls == []:
        time.sleep(0.001)
    time.sleep(0.05)
    search.release.set()
    for thread in threads:
        thread.join(10)
    assert len(errors) == 6 and all(str(e) == "engine down" for e in errors)
    assert all(n <= 4 for n, _ in search.calls)  # max_queries bounds a batch
    search.fail = False
    scores, _ = batcher.search("c", np.full((1, 4), 7, np.float32), 2, search)
    assert (scores == 7).all()


def test_a_lone_request_is_not_delayed_and_keys_do_not_mix() -> None:
    batcher, search = SearchBatcher(), Recorder()
    search.release.set()
    began = time.perf_counter()
    a = batcher.search("a", np.full((1, 4), 1, np.float32), 1, search)
    b = batcher.search("b", np.full((1, 4), 2, np.float32), 1, search)
    assert time.perf_counter() - began < 0.5
    assert a[0].tolist() == [[1.0]] and b[0].tolist() == [[2.0]] and search.calls == [(1, 1), (1, 1)]
    with pytest.raises(ValueError):
        SearchBatcher(window_s=-1)


def test_concurrent_gallery_searches_are_batched_and_equal_sequential_ones(store: GalleryStore) -> None:
    rng = np.random.default_rng(40)
    store.create_collection("b", MODEL, 32, 0.5)
    for number in range(60):
        store.add_faces("b", f"p{number}", new_faces(unit_vectors(rng, 3, 32), tag=f"b{number}"), MODEL,
                        create=(f"P{number}", {}))
    gallery = Gallery(store, batcher=SearchBatcher(window_s=0.002))
    gallery.load()
    queries = unit_vectors(rng, 64, 32)
    sequential = [gallery.search("b", q, k=5)[0].candidates for q in queries]
    calls = gallery.batcher.calls
    with ThreadPoolExecutor(32) as pool:
        concurrent = list(pool.map(lambda q: gallery.search("b", q, k=5)[0].candidates, queries))
    assert concurrent == sequential
    assert gallery.batcher.calls - calls < len(queries) / 2  # most searches shared an engine call


def test_clients_that_come_right_back_fill_the_next_call() -> None:
    """8 clients each sending 20 requests in a row: without the leader's gathering wait every other call
    would carry the one client that came back first (about 40 calls); with it, about 20 full ones."""
    batcher = SearchBatcher(gather_s=0.05)
    sizes: list[int] = []

    def search(queries: NDArray[np.float32], k: int) -> tuple[NDArray[Any], ...]:
        sizes.append(len(queries))
        time.sleep(0.005)
        return (np.zeros((len(queries), k), np.float32),)

    def client(_: int) -> None:
        for _round in range(20):
            batcher.search("c", np.ones((1, 4), np.float32), 1, search)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(client, range(8)))
    assert sum(sizes) == 160
    assert len(sizes) <= 26, sizes
    assert sum(1 for s in sizes if s == 8) >= 15, sizes


def test_a_finished_batch_wakes_its_own_requests_and_one_leader_only() -> None:
    """Each waiting request sleeps on its own event: when a batch ends, the requests queued behind it stay
    asleep except the first, which leads the next call (a condition shared by all woke every one of them
    to re-check, 32 threads per answer at concurrency 32)."""
    batcher = SearchBatcher(max_queries=2, gather_s=0)
    entered, proceed = threading.Semaphore(0), threading.Semaphore(0)

    def search(queries: NDArray[np.float32], k: int) -> tuple[NDArray[Any], ...]:
        entered.release()
        assert proceed.acquire(timeout=10)
        return (np.repeat(queries[:, :1], k, axis=1),)

    results: dict[int, float] = {}

    def request(number: int) -> None:
        results[number] = float(batcher.search("c", np.full((1, 4), number, np.float32), 1, search)[0][0, 0])

    threads = [threading.Thread(target=request, args=(0,))]
    threads[0].start()
    assert entered.acquire(timeout=10)  # request 0 leads a call of its own
    threads += [threading.Thread(target=request, args=(n,)) for n in range(1, 6)]
    for thread in threads[1:]:
        thread.start()
    deadline = time.monotonic() + 10
    while waiting(batcher, "c") < 5 and time.monotonic() < deadline:
        time.sleep(0.001)
    queued = list(batcher._queues["c"].waiting)
    assert not any(r.wake.is_set() for r in queued)
    proceed.release()  # the first call ends: request 1 leads the next, with request 2 (max 2 queries)
    assert entered.acquire(timeout=10)
    assert [r.wake.is_set() for r in queued] == [True, False, False, False, False]
    assert [r.lead for r in queued] == [True, False, False, False, False]
    for _ in range(3):  # the calls of (1, 2), (3, 4) and (5)
        proceed.release()
        if _ < 2:
            assert entered.acquire(timeout=10)
    for thread in threads:
        thread.join(10)
    assert results == {n: float(n) for n in range(6)} and batcher.calls == 4


def test_requests_of_different_searches_are_never_mixed_in_one_call() -> None:
    """Requests queued together that found different indexes of one key (a collection rebuilt, or re-embedded
    to another dimension, meanwhile) each go to their own search; the first one's queue order is kept.
    Failed before: all went to the leader's search, and queries of two dimensions could not be joined."""
    batcher, old, new = SearchBatcher(), Recorder(), Recorder()
    results: dict[str, tuple[NDArray[Any], ...]] = {}
    errors: list[BaseException] = []

    def request(name: str, search: Recorder, dimension: int, value: float) -> None:
        try:
            results[name] = batcher.search("c", np.full((1, dimension), value, np.float32), 2, search)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=request, args=("lead", old, 4, 1.0))]
    threads[0].start()
    while not old.calls:
        time.sleep(0.001)
    for name, search, dimension, value in (("a", old, 4, 2.0), ("b", new, 8, 3.0), ("c", old, 4, 4.0)):
        threads.append(threading.Thread(target=request, args=(name, search, dimension, value)))
        threads[-1].start()
        while waiting(batcher, "c") < len(threads) - 1:
            time.sleep(0.001)
    new.release.set()
    old.release.set()
    for thread in threads:
        thread.join(10)
    assert errors == []
    assert old.calls == [(1, 2), (2, 2)] and new.calls == [(1, 2)]
    assert {name: float(r[0][0, 0]) for name, r in results.items()} == {"lead": 1, "a": 2, "b": 3, "c": 4}
