"""How many OpenMP threads a FAISS search gets.

FAISS spreads a search over OpenMP threads, and libgomp's idle workers then spin, waiting for the next
parallel region, for a few milliseconds of CPU. For the searches a gateway mostly does (one query, a
collection of hundreds or thousands of faces: well under a millisecond of work) that spin cost more than
the search itself: 5.8 ms of CPU per search, spaced like requests, against 0.3 ms on one thread, taken
from the Triton process on the same cores. So small searches run on the calling thread alone and large
ones (big collections, batches) on all of FAISS's threads. ``omp_set_num_threads`` sets the calling
thread's own count (libgomp keeps it per thread), so it is set around every search, in the thread that
searches, and put back after it (an index build in the same thread keeps all of them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import faiss

#: Below this many multiply-adds (queries x vectors x dimension, exact-search terms) a search runs on one
#: thread: about a millisecond of work (65k faces x 128-d for one query).
SMALL_WORK = 1 << 23


@contextlib.contextmanager
def threads_for(work: int) -> Iterator[None]:
    """The calling thread searches on one OpenMP thread inside this block when ``work`` (multiply-adds)
    is small, and on its usual count otherwise; the count it had is put back after."""
    previous = faiss.omp_get_max_threads()
    if work >= SMALL_WORK or previous == 1:
        yield
        return
    faiss.omp_set_num_threads(1)
    try:
        yield
    finally:
        faiss.omp_set_num_threads(previous)
