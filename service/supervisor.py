"""Keeps the tritonserver of ``python -m service`` running: a server that dies is restarted.

A watcher thread waits on the server process. When it exits while the gateway runs, the dead run is
reaped first (``TritonServer.reap``: what is left of its process group, its Python-backend stubs, is
killed, and its own /dev/shm regions are removed), then a new run starts on the same ports with a new
shared-memory prefix, after a backoff that grows with each failed attempt (1, 2, 4, 8, 15, 30 s) and is
reset once a run stays up. Each step is logged, and ``status()`` says what is going on, for
``/health/ready`` (while Triton is down, requests get 503 with Retry-After from the gateway's error
handler, which is what a client should see during a restart). ``stop()`` during a restart cancels the
run being started (its wait for readiness watches the same stop event) instead of waiting it out.

Restarts are started from the watcher thread, which lives until ``stop()``: a run dies with the thread
that started it (``launcher.parent_death_signal``), so they must not come from a short-lived thread.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field, replace

from service.launcher import TritonServer, TritonStartError
from service.readiness import TritonStatus

log = logging.getLogger(__name__)

BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0)
#: How often the supervisor looks whether tritonserver is still running.
WATCH_S = 0.5


def backoff(attempt: int, steps: tuple[float, ...] = BACKOFF_S) -> float:
    """Seconds to wait before restart attempt ``attempt`` (1-based) since the last good run."""
    return steps[min(max(attempt, 1), len(steps)) - 1]


@dataclass
class Supervisor:
    """``start()`` the first run (its failure is the caller's), then restart it whenever it dies."""

    template: TritonServer
    steps: tuple[float, ...] = BACKOFF_S
    start_timeout_s: float = 120.0
    #: A run that stays up this long resets the backoff.
    stable_s: float = 60.0
    server: TritonServer | None = field(default=None, init=False)
    restarts: int = field(default=0, init=False)
    _status: TritonStatus = field(default=TritonStatus(False, "tritonserver not started yet"), init=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)

    def status(self) -> TritonStatus:
        return self._status

    def start(self) -> Supervisor:
        self.server = self.template.start(self.start_timeout_s)
        self._status = TritonStatus(True, "tritonserver running")
        self._thread = threading.Thread(target=self._watch, name="triton-supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> int | None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.start_timeout_s + 30)
        server, self.server = self.server, None
        self._status = TritonStatus(False, "stopped")
        return server.stop() if server is not None else None

    def __enter__(self) -> Supervisor:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def _watch(self) -> None:
        attempts, started = 0, time.monotonic()
        # one look every WATCH_S: Popen.wait(timeout) looks every 50 ms or less, CPU spent for nothing
        while not self._stop.wait(WATCH_S) and self.server is not None:
            code = self.server.exit_code()
            if code is None:
                continue
            # a run that died soon after its start continues the backoff instead of resetting it
            attempts = attempts if time.monotonic() - started < self.stable_s else 0
            attempts = self._restart(self.server, f"exited with code {code}", attempts)
            started = time.monotonic()

    def _restart(self, dead: TritonServer, why: str, attempts: int) -> int:
        """Reap ``dead``, then start new runs until one is ready (or the gateway stops); returns the
        number of attempts made since the last stable run."""
        died = time.monotonic()
        while not self._stop.is_set():
            attempts += 1
            reaped = dead.reap()
            delay = backoff(attempts, self.steps)
            self._status = TritonStatus(False, f"tritonserver {why}; restart attempt {attempts} "
                                               f"in {delay:.0f} s")
            log.error("tritonserver %s; %d leftover processes of it killed and its shared memory (%s*) "
                      "removed; restarting it in %.0f s (attempt %d)", why, len(reaped), dead.shm_prefix,
                      delay, attempts)
            if self._stop.wait(delay):
                break
            run = replace(self.template, shm_prefix=f"facerec_{uuid.uuid4().hex[:8]}_")
            self._status = TritonStatus(False, f"tritonserver {why}; restart attempt {attempts} starting")
            try:
                self.server = run.start(self.start_timeout_s, self._stop)
            except TritonStartError as exc:
                if self._stop.is_set():  # cancelled: run.start stopped what it had started
                    break
                dead, why = run, f"failed to restart ({exc})"
                continue
            self.restarts += 1
            self._status = TritonStatus(True, f"tritonserver running (restarted {self.restarts} times)")
            log.warning("tritonserver restarted and ready (attempt %d, %.1f s after it died)", attempts,
                        time.monotonic() - died)
            break
        return attempts
