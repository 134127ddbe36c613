"""The gateway's cached recognition check (``facecore.probe``), refreshed in the background.

``/health/ready`` must not run an inference for every poll of every load balancer, and must not
report a stale success: a successful result is reused for ``interval_s``, a failed one for at most
``RETRY_S`` (so readiness comes back within a second or so of Triton coming back). One probe runs at
a time; concurrent readiness requests wait for it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from facecore.client import AsyncPipeline
from facecore.probe import ProbeResult, probe_async

log = logging.getLogger(__name__)

RETRY_S = 1.0
PROBE_TIMEOUT_S = 4.0  # under the readiness probes' 5 s
NOT_READY = "face_pipeline is not ready in Triton, or Triton does not answer"


@dataclass(frozen=True)
class TritonStatus:
    """What a supervisor of the local tritonserver says (``service.supervisor``)."""

    up: bool
    detail: str


class RecognitionCheck:
    """``ready(timeout)``, when given, asks Triton whether face_pipeline is ready before each probe, so that
    the metrics tell "Triton not ready" (``triton_ready``) from "ready, but recognition fails"."""

    def __init__(self, pipeline: AsyncPipeline, image: bytes, interval_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 ready: Callable[[float], Awaitable[bool]] | None = None) -> None:
        self.pipeline, self.image, self.interval_s, self.clock = pipeline, image, interval_s, clock
        self.ready = ready
        self.last = ProbeResult(False, "not checked yet", float("-inf"))
        #: face_pipeline's readiness at the last probe (None: not known yet, or no ``ready`` to ask)
        self.triton_ready: bool | None = None
        self.failures = 0  # probes that failed, for the metrics
        self._lock = asyncio.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None  # the one ``run`` runs in, for ``from_thread``

    def _fresh(self, result: ProbeResult) -> bool:
        age = self.clock() - result.checked_at
        return age < (self.interval_s if result.ok else RETRY_S)

    async def refresh(self) -> ProbeResult:
        """Run the probe now (or wait for the one running) and remember its result."""
        started = self.clock()
        async with self._lock:
            if self.last.checked_at >= started:  # another caller probed while this one waited
                return self.last
            try:
                async with asyncio.timeout(PROBE_TIMEOUT_S):
                    result = await self._probe()
            except TimeoutError:
                result = ProbeResult.failed(f"no answer to the probe within {PROBE_TIMEOUT_S} s")
            except Exception as exc:  # whatever the client raised: not ready, and say why
                result = ProbeResult.failed(f"the probe failed: {exc!r}")
            result = ProbeResult(result.ok, result.detail, self.clock())
            self.failures += not result.ok
            if result.ok != self.last.ok:
                log.log(logging.INFO if result.ok else logging.WARNING, "recognition probe: %s%s",
                        "ok, " if result.ok else "FAILED, ", result.detail)
            self.last = result
            return result

    async def _probe(self) -> ProbeResult:
        if self.ready is not None:
            # half the probe's budget: a Triton that does not answer is "not ready", not a probe timeout
            self.triton_ready = await self.ready(PROBE_TIMEOUT_S / 2)
            if not self.triton_ready:
                return ProbeResult.failed(NOT_READY)
        return await probe_async(self.pipeline, self.image)

    def invalidate(self, detail: str) -> ProbeResult:
        """Forget a success (Triton went away); returns the failed result now cached."""
        self.last = ProbeResult(False, detail, self.clock())
        if self.ready is not None:
            self.triton_ready = False
        return self.last

    async def result(self) -> ProbeResult:
        """The cached result while it is fresh, else a new probe."""
        last = self.last
        return last if self._fresh(last) else await self.refresh()

    async def run(self) -> None:
        """Refresh every ``interval_s`` (every ``RETRY_S`` while failing) until cancelled."""
        self.loop = asyncio.get_running_loop()
        try:
            while True:
                result = await self.refresh()
                await asyncio.sleep(self.interval_s if result.ok else max(RETRY_S, self.interval_s / 10))
        finally:
            self.loop = None

    def from_thread(self, fresh: bool) -> ProbeResult | None:
        """For a thread beside the event loop (the supervisor's watcher): a probe run now in the loop
        ``run`` runs in (``fresh``), else the last result. None when there is no answer to give: ``run``
        is not running, or the loop did not run the probe in time (the gateway, not Triton, is stuck)."""
        loop = self.loop
        if loop is None:
            return None
        if not fresh:
            return self.last
        try:
            return asyncio.run_coroutine_threadsafe(self.refresh(), loop).result(PROBE_TIMEOUT_S + 1)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError, RuntimeError):
            # RuntimeError: the loop closed meanwhile; cancelled: the gateway is shutting down
            return None
