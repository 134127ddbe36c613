"""Load shedding: at most ``max_in_flight`` recognition requests inside the gateway at once.

Beyond that a request is answered at once with 503 ``overloaded`` and ``Retry-After`` instead of joining
a queue that only grows (with it, latency and memory): a client that retries after a second finds room,
and the requests already admitted keep their latency. Triton's own queue is bounded too
(``max_queue_size`` on face_pipeline, see export/repository.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

from fastapi import Request

from service.errors import Overloaded


class Admission:
    """A counter, not a lock: every request runs on the one event loop, so no await separates the
    check from the increment."""

    def __init__(self, limit: int) -> None:
        self.limit, self.in_flight, self.refused = limit, 0, 0

    def enter(self) -> None:
        if self.in_flight >= self.limit:
            self.refused += 1
            raise Overloaded(f"the gateway is at its limit of {self.limit} recognition requests in flight; "
                             "retry shortly", limit=self.limit)
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1

    @contextmanager
    def slot(self) -> Iterator[None]:
        """One admitted request for the block (a recognition route holds it around its work)."""
        self.enter()
        try:
            yield
        finally:
            self.leave()


async def admit(request: Request) -> AsyncIterator[None]:
    """Admission alone, for the CompreFace routes (their keys are checked inside the route); the native
    recognition routes hold ``Admitted.slot()`` (``service.deps``) around their work, the DeepStack ones
    ``Admission.slot()`` once their key and images passed (``service.routers.deepstack``)."""
    admission: Admission = request.app.state.admission
    with admission.slot():
        yield
