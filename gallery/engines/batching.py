"""Searches that arrive together are made together: one engine call for concurrent requests.

Like Triton's dynamic batcher: requests for one key (a collection) queue up; the first one to find the
key idle becomes the *leader*, waits ``window_s`` (0 by default, as Triton's queue delay) and runs one
search for every queued query, with the largest k asked; each request gets its own rows back, cut to
its own k. Requests that arrive while that search runs queue for the next one, whose leader is the
first of them. A leader also waits, at most ``gather_s``, until as many requests are queued as the
previous engine call carried: clients whose answers just came back send their next request within
microseconds, and without that wait every other call would carry one query (the first to come back)
instead of all of them. So a lone request pays nothing (the previous call carried one), and under load
each engine call serves many requests: the scan of a million vectors is shared instead of repeated.
Only requests with equal ``search`` callables share a call (the gallery passes the bound method of the
collection's index it found): a request that found a newer index of the collection than the leader's
(rebuilt, re-embedded) is searched in a call of its own, never in the index the leader found.

Each waiting request sleeps on an event of its own, set when its answer is ready or when it becomes the
next leader: finishing a batch wakes the requests it answered and one leader, not every waiting thread
(with one condition shared by all, every batch woke every waiting thread to re-check its own state, each
taking the interpreter's lock in turn: 32 wake-ups per batch at a concurrency of 32).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

Arrays = tuple[NDArray[Any], ...]
#: search(queries [n, d], k) -> arrays whose first axis is the query and second the rank
Search = Callable[[NDArray[np.float32], int], Arrays]


@dataclass
class _Request:
    queries: NDArray[np.float32]
    k: int
    search: Search
    result: Arrays | None = None
    error: BaseException | None = None
    done: bool = False
    lead: bool = False
    wake: threading.Event = field(default_factory=threading.Event)  # done, or leads


@dataclass
class _Queue:
    lock: threading.Lock = field(default_factory=threading.Lock)
    waiting: list[_Request] = field(default_factory=list)
    busy: bool = False
    last_size: int = 1  # requests the previous engine call carried

    def __post_init__(self) -> None:
        self.arrived = threading.Condition(self.lock)  # a request was queued (for the gathering leader)


class SearchBatcher:
    def __init__(self, window_s: float = 0.0, max_queries: int = 512, gather_s: float = 0.002) -> None:
        if window_s < 0 or gather_s < 0 or max_queries < 1:
            raise ValueError("the batching windows must be >= 0 and max_queries >= 1")
        self.window_s, self.max_queries, self.gather_s = window_s, max_queries, gather_s
        self._queues: dict[Hashable, _Queue] = {}
        self._lock = threading.Lock()
        #: engine calls made and queries they carried (for metrics and tests)
        self.calls = 0
        self.queries = 0

    def search(self, key: Hashable, queries: NDArray[np.float32], k: int, search: Search) -> Arrays:
        with self._lock:
            queue = self._queues.setdefault(key, _Queue())
        request = _Request(queries, k, search)
        with queue.lock:
            queue.waiting.append(request)
            queue.arrived.notify()
            if not queue.busy:
                queue.busy = request.lead = True
                request.wake.set()
        request.wake.wait()
        if not request.done:
            self._lead(queue)
        if request.error is not None:
            raise request.error
        assert request.result is not None  # set with done (not input validation)
        return request.result

    def _take(self, queue: _Queue) -> list[_Request]:
        """The leader (first waiting) and those behind it with the same search, up to ``max_queries``
        queries in all; the others keep their places."""
        taken: list[_Request] = []
        total = 0
        left: list[_Request] = []
        full = False  # a request of the same search did not fit: it and those behind it wait
        with queue.lock:
            leader = queue.waiting[0]
            for r in queue.waiting:
                same = r is leader or r.search == leader.search
                full = full or (same and bool(taken) and total + len(r.queries) > self.max_queries)
                if same and not full:
                    taken.append(r)
                    total += len(r.queries)
                else:
                    left.append(r)
            queue.waiting[:] = left
        return taken

    def _lead(self, queue: _Queue) -> None:
        if self.window_s:
            time.sleep(self.window_s)
        with queue.lock:  # as many as last time, or gather_s at most
            queue.arrived.wait_for(lambda: len(queue.waiting) >= queue.last_size, timeout=self.gather_s)
        batch = self._take(queue)
        try:
            k = max(r.k for r in batch)
            arrays = batch[0].search(np.concatenate([r.queries for r in batch]), k)
            start = 0
            for r in batch:
                stop = start + len(r.queries)
                r.result = tuple(a[start:stop, : r.k] for a in arrays)
                start = stop
        except BaseException as exc:  # every request of the batch gets the engine's error
            for r in batch:
                r.error = exc
        with queue.lock:
            self.calls += 1
            self.queries += sum(len(r.queries) for r in batch)
            queue.last_size = len(batch)
            for r in batch:
                r.done = True
                r.wake.set()
            if queue.waiting:  # the next batch is led by the first that waited
                queue.waiting[0].lead = True
                queue.waiting[0].wake.set()
            else:
                queue.busy = False
