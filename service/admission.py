"""Load shedding: at most ``max_in_flight`` recognition requests inside the gateway at once.

Beyond that a request is answered at once with 503 ``overloaded`` and ``Retry-After`` instead of joining
a queue that only grows (with it, latency and memory): a client that retries after a second finds room,
and the requests already admitted keep their latency. Triton's own queue is bounded too
(``max_queue_size`` on face_pipeline, see export/repository.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Request

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


async def admit(request: Request) -> AsyncIterator[None]:
    admission: Admission = request.app.state.admission
    admission.enter()
    try:
        yield
    finally:
        admission.leave()


AdmitDep = Annotated[None, Depends(admit)]
