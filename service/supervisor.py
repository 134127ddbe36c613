"""Keeps the tritonserver of ``python -m service`` running: a server that dies or hangs is restarted.

A watcher thread waits on the server process. When it exits while the gateway runs, the dead run is
reaped first (``TritonServer.reap``: what is left of its process group, its Python-backend stubs, is
killed, and its own /dev/shm regions are removed), then a new run starts on the same ports with a new
shared-memory prefix, after a backoff that grows with each failed attempt (1, 2, 4, 8, 15, 30 s) and is
reset once a run stays up. Each step is logged, and ``status()`` says what is going on, for
``/health/ready`` (while Triton is down, requests get 503 with Retry-After from the gateway's error
handler, which is what a client should see during a restart). ``stop()`` during a restart cancels the
run being started (its wait for readiness watches the same stop event) instead of waiting it out.

A server that hangs instead (stopped, deadlocked) does not exit, so the watcher also asks it every
``HEALTH_S`` whether it is ready (``TritonServer.healthy``, ``HEALTH_TIMEOUT_S``). A server that has
neither answered that nor passed the recognition probe for ``hang_timeout_s`` (``FACEREC_TRITON__
HANG_TIMEOUT_S``) counts as dead: ``TritonServer.kill`` (SIGTERM, then SIGKILL for it and its stubs), then
the same reap and restart. Both must fail: a server busy enough to fail the probe still answers its health
check, and one whose health endpoint alone is stuck still recognizes faces. The probe is the gateway's
(``recognition``: ``RecognitionCheck.from_thread``), run afresh while the health check fails; without it
(the gateway has not started yet) the health check alone decides. A stub that stopped responding leaves
Triton's health endpoints answering ready, but Triton then fails each request saying so
(``facecore.probe.stub_unhealthy``), which counts as failing the health check. Restarts are counted by
reason (``restart_counts``: ``exited``, ``hung``) for the gateway's metrics.

Restarts are started from the watcher thread, which lives until ``stop()``: a run dies with the thread
that started it (``launcher.parent_death_signal``), so they must not come from a short-lived thread.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from facecore.probe import ProbeResult, stub_unhealthy
from service.launcher import HEALTH_TIMEOUT_S, TritonServer, TritonStartError
from service.readiness import TritonStatus

log = logging.getLogger(__name__)

BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0)
#: How often the supervisor looks whether tritonserver is still running.
WATCH_S = 0.5
#: How often it asks the running server whether it is ready (an HTTP request; a hung one takes
#: HEALTH_TIMEOUT_S to not answer).
HEALTH_S = 2.0
#: Why runs end, the label values of the restart counts.
REASONS = ("exited", "hung")

#: The recognition probe as the supervisor reads it: ``fresh`` asks for a probe now rather than the last
#: result; None when there is none to give.
Recognition = Callable[[bool], ProbeResult | None]


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
    #: A run that answers neither its health check nor the recognition probe this long is killed.
    hang_timeout_s: float = 30.0
    recognition: Recognition | None = None
    server: TritonServer | None = field(default=None, init=False)
    restarts: int = field(default=0, init=False)
    #: Runs ended, by reason (``REASONS``), whether their restart succeeded yet or not.
    ended: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0), init=False)
    _unwell_since: float | None = field(default=None, init=False)
    _status: TritonStatus = field(default=TritonStatus(False, "tritonserver not started yet"), init=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)

    def status(self) -> TritonStatus:
        return self._status

    def restart_counts(self) -> dict[str, int]:
        return dict(self.ended)

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
        next_health = started + HEALTH_S
        # one look every WATCH_S: Popen.wait(timeout) looks every 50 ms or less, CPU spent for nothing
        while not self._stop.wait(WATCH_S) and self.server is not None:
            why: str | None
            code = self.server.exit_code()
            if code is not None:
                reason, why = "exited", f"exited with code {code}"
            elif time.monotonic() < next_health:
                continue
            else:
                why, next_health = self._hung(self.server), time.monotonic() + HEALTH_S
                if why is None:
                    continue
                log.error("tritonserver %s: killing it and its stubs", why)
                self.server.kill()
                reason = "hung"
            self.ended[reason] += 1
            self._unwell_since = None
            # a run that died soon after its start continues the backoff instead of resetting it
            attempts = attempts if time.monotonic() - started < self.stable_s else 0
            attempts = self._restart(self.server, why, attempts)
            started = next_health = time.monotonic()

    def _hung(self, server: TritonServer) -> str | None:
        """Why ``server`` counts as hung; None while it does not (see the module's doc)."""
        healthy = server.healthy(HEALTH_TIMEOUT_S)
        probe = self.recognition(not healthy) if self.recognition is not None else None
        unwell = None if healthy else f"no answer to its health check within {HEALTH_TIMEOUT_S:.0f} s"
        if probe is not None and stub_unhealthy(probe):
            unwell = probe.detail
        if unwell is None or (probe is not None and probe.ok):
            if self._unwell_since is not None:
                log.warning("tritonserver answers again")
                self._status = self._running()
            self._unwell_since = None
            return None
        now = time.monotonic()
        if self._unwell_since is None:
            self._unwell_since = now
            log.warning("tritonserver: %s; recognition probe: %s; restarting it if this lasts %.0f s", unwell,
                        probe.detail if probe else "none yet", self.hang_timeout_s)
        lasted = now - self._unwell_since
        self._status = TritonStatus(False, f"tritonserver: {unwell}, for {lasted:.0f} s (restarted at "
                                           f"{self.hang_timeout_s:.0f} s)")
        if lasted < self.hang_timeout_s:
            return None
        return f"hung ({unwell}, and no recognition, for {lasted:.0f} s)"

    def _running(self) -> TritonStatus:
        again = f" (restarted {self.restarts} times)" if self.restarts else ""
        return TritonStatus(True, f"tritonserver running{again}")

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
            self._status = self._running()
            log.warning("tritonserver restarted and ready (attempt %d, %.1f s after it died)", attempts,
                        time.monotonic() - died)
            break
        return attempts
