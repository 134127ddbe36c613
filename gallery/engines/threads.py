"""How many OpenMP threads a FAISS search gets, and at what priority a background build runs.

FAISS spreads a search over OpenMP threads, and libgomp's idle workers then spin, waiting for the next
parallel region. For the searches a gateway mostly does (one query, a collection of hundreds or thousands
of faces) that spin cost many times the CPU of the search itself, taken from the Triton process on the
same cores. A lone query gains nothing from a second thread either: FAISS 1.15's exact search splits its
work by query, so a lone query over a large collection took several times longer on two threads than on
one, for several times the CPU, where two or more queries took about half as long each on two threads. So
small searches and lone queries run on the calling thread alone, and large batches on all of FAISS's
threads. ``omp_set_num_threads`` sets the calling thread's own count (libgomp keeps it per thread), so it
is set around every search, in the thread that searches, and put back after it (an index build in the
same thread keeps all of them).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import faiss

#: Below this many multiply-adds (queries x vectors x dimension, exact-search terms) a search runs on one
#: thread (65k faces x 128-d for one query): too little work to pay for a second thread's idle spin.
SMALL_WORK = 1 << 23


@contextlib.contextmanager
def threads_for(queries: int, work: int) -> Iterator[None]:
    """The calling thread searches on one OpenMP thread inside this block when it searches one query or
    ``work`` (multiply-adds) is small, and on its usual count otherwise; the count it had is put back
    after."""
    previous = faiss.omp_get_max_threads()
    if (queries > 1 and work >= SMALL_WORK) or previous == 1:
        yield
        return
    faiss.omp_set_num_threads(1)
    try:
        yield
    finally:
        faiss.omp_set_num_threads(previous)


#: Nice value a background index build adds to its thread. On Linux a thread's nice value is its own and
#: the threads it starts inherit it (FAISS's OpenMP workers, the selection's throughput probes), so the
#: searches and requests served meanwhile go first; on an idle machine the build runs as fast as before.
#: Beside a large selection, the searches' p99 more than halved, and the build took hardly longer.
BACKGROUND_NICE = 10


def lower_this_thread(by: int = BACKGROUND_NICE) -> bool:
    """Raise the calling thread's nice value by ``by`` (at most 19); False where the system does not
    allow it (a platform without per-thread priorities)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))
    except (AttributeError, OSError):
        return False
    return True


T = TypeVar("T")


def at_low_priority(function: Callable[[], T]) -> T:
    """``function()`` run on a thread of its own whose nice value is raised (``lower_this_thread``),
    waited for; its exception is raised here. The caller keeps its priority: an unprivileged thread
    cannot lower its nice value again, and a low-priority thread should not hold the locks that requests
    wait for."""
    outcome: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        lower_this_thread()
        try:
            outcome.append(function())
        except BaseException as exc:  # handed to the caller
            failure.append(exc)

    worker = threading.Thread(target=run, name=f"{threading.current_thread().name}-low", daemon=True)
    worker.start()
    worker.join()
    if failure:
        raise failure[0]
    return outcome[0]
