"""A call repeated in a daemon thread: the gallery's change-log follower, the gateway's key-table watch."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

#: While the calls keep failing, a reminder is logged this often (the first failure has its traceback).
REMIND_S = 60.0


class Periodic:
    """Calls ``action`` every ``interval_s`` seconds in a daemon thread named ``name`` between ``start``
    and ``stop``. A call that raises is logged (and ``on_error`` run) and the calls go on: what they read
    (a database) may be briefly unreachable. A run of failures is logged once with its traceback, then
    every ``REMIND_S`` (five a second, for a database down a minute, were 300 tracebacks a thread), and
    its end with how long it lasted."""

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
            failing = _Failures(self.failure)
            while not self._stop.wait(interval_s):
                try:
                    self.action()
                except Exception as error:
                    if self.on_error is not None:
                        self.on_error()
                    failing.failed(error)
                else:
                    failing.ended()

        self._thread = threading.Thread(target=repeat, name=self.name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


class _Failures:
    """A run of failed calls, for its log lines."""

    def __init__(self, failure: str) -> None:
        self.failure = failure
        self.count = 0
        self.since = self.reminded = 0.0

    def failed(self, error: Exception) -> None:
        now = time.monotonic()
        self.count += 1
        if self.count == 1:
            self.since = self.reminded = now
            log.error("%s; retrying", self.failure, exc_info=error)
        elif now - self.reminded >= REMIND_S:
            self.reminded = now
            log.error("%s for %.0f s (%d tries); retrying: %r", self.failure, now - self.since, self.count,
                      error)

    def ended(self) -> None:
        if self.count:
            log.warning("%s for %.1f s (%d tries); working again", self.failure,
                        time.monotonic() - self.since, self.count)
            self.count = 0
