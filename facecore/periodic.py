"""A call repeated in a daemon thread: the gallery's change-log follower, the gateway's key-table check."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class Periodic:
    """Calls ``action`` every ``interval_s`` seconds in a daemon thread named ``name`` between ``start``
    and ``stop``. A call that raises is logged (and ``on_error`` run) and the calls go on: what they read
    (a database) may be briefly unreachable."""

    def __init__(self, name: str, action: Callable[[], object], failure: str,
                 on_error: Callable[[], None] | None = None) -> None:
        self.name, self.action, self.failure, self.on_error = name, action, failure, on_error
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self, interval_s: float) -> None:
        if self._thread is not None:
            return
        self._stop.clear()

        def repeat() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self.action()
                except Exception:
                    if self.on_error is not None:
                        self.on_error()
                    log.exception("%s; retrying", self.failure)

        self._thread = threading.Thread(target=repeat, name=self.name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
