"""A Triton that hangs instead of dying (``service.supervisor``'s health watch) and a silent network (gRPC
keepalive, ``facecore.client.channel_options``): the real tritonserver frozen with SIGSTOP under load, its
stubs stopped, and the supervisor's rule on scripted answers.

A frozen server answers nothing and resets nothing, as a host that vanishes does: the gateway's calls must
fail within seconds (503 with Retry-After, their in-flight slots freed), not wait out their 30 s timeout,
and the supervisor must kill it (SIGKILL: a stopped process ignores SIGTERM), clean up after it and start
another."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from facecore.client import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS, PipelineClient
from facecore.probe import PROBE_FILE, ProbeResult, probe
from service import supervisor as watched
from service.launcher import TritonPorts, TritonServer, group_members
from service.supervisor import Supervisor
from tests.service.test_supervisor import (
    SleepingServer,
    alive,
    local_stack,
    shm,
    tritonserver_child,
    wait_for,
)

#: A frozen peer is noticed within a keepalive period and its timeout; a call that then opens a new
#: connection waits as long again for it to fail (measured: 2.0-2.4 s, then 4.0-4.1 s), and the 2-core
#: machines add their share. Anything under 30 s would be a call's timeout instead.
FAIL_FAST_S = 2 * (KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS) / 1000 + 2


# --- the rule, on scripted answers ------------------------------------------------------------------

@dataclass
class ScriptedServer(SleepingServer):
    """A running process whose health answer is scripted; counts the kills."""

    answers: bool = True
    kills: list[int] = field(default_factory=list)

    def start(self, _timeout: float, _stop: threading.Event | None = None) -> ScriptedServer:
        return replace(self, process=subprocess.Popen(["sleep", "60"]))

    def healthy(self, _timeout: float) -> bool:
        return self.answers

    def kill(self) -> int | None:
        self.kills.append(1)
        return self.stop()


FAILED = ProbeResult(False, "no answer to the probe within 4.0 s", 0.0)
OK = ProbeResult(True, "1 face, 128-d embedding", 0.0)
STUB = ProbeResult(False, "face_pipeline failed: Stub process 'face_pipeline_0_0' is not healthy.", 0.0)


@pytest.mark.parametrize(("answers", "probe_result", "hung"), [
    (False, FAILED, True),    # frozen: neither answers
    (False, None, True),      # no gateway probe yet: the health check alone
    (True, STUB, True),       # a stopped stub: Triton says so, its health endpoint does not
    (True, FAILED, False),    # busy or broken models, but Triton answers: a restart would not help
    (False, OK, False),       # the HTTP endpoint alone is stuck, recognition works
])
def test_hung_means_no_health_answer_and_no_recognition(monkeypatch: pytest.MonkeyPatch, answers: bool,
                                                        probe_result: ProbeResult | None, hung: bool) -> None:
    monkeypatch.setattr(watched, "WATCH_S", 0.05)
    monkeypatch.setattr(watched, "HEALTH_S", 0.1)
    asked: list[bool] = []

    def recognition(fresh: bool) -> ProbeResult | None:
        asked.append(fresh)
        return probe_result

    supervisor = Supervisor(ScriptedServer(answers=answers), steps=(60.0,),  # type: ignore[arg-type]
                            hang_timeout_s=0.5, recognition=recognition).start()
    try:
        time.sleep(0.3)
        assert supervisor.ended == {"exited": 0, "hung": 0}, "not before hang_timeout_s"
        if hung:
            wait_for(lambda: supervisor.ended["hung"] == 1, 5, "the hung server is killed")
            assert "hung (" in supervisor.status().detail and not supervisor.status().up
        else:
            time.sleep(1.5)
            assert supervisor.ended == {"exited": 0, "hung": 0} and supervisor.status().up
        assert supervisor.server is not None
        assert supervisor.server.kills == ([1] if hung else [])  # type: ignore[attr-defined]
        # a fresh probe only when the health check fails; else the gateway's last result
        assert asked and set(asked) == {not answers}
    finally:
        supervisor.stop()


# --- the real tritonserver ------------------------------------------------------------------------------

def stubs_of(pid: int, model: str = "") -> list[int]:
    """The Python-backend stubs of tritonserver ``pid`` (those of ``model`` only, when given)."""
    stubs = [p for p in group_members(pid) if p != pid]
    return [p for p in stubs if f"/{model}/" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")] \
        if model else stubs


def shm_prefix_of(pid: int) -> str:
    arguments = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    (option,) = [a for a in arguments if "shm-region-prefix-name=" in a]
    return option.rsplit("=", 1)[1]


@pytest.fixture
def repository(cpu_repository: Path, tmp_path: Path) -> Path:
    copied = shutil.copytree(cpu_repository, tmp_path / "cpu", ignore=shutil.ignore_patterns("__pycache__"))
    return Path(copied)


@pytest.mark.triton
def test_stopped_stubs_get_the_server_restarted(repository: Path, tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """A stub that stops responding (here SIGSTOP; a deadlock looks the same) leaves Triton's health
    endpoints answering ready; Triton fails each request saying the stub is not healthy, and after
    hang_timeout_s the run is killed and replaced."""
    caplog.set_level(logging.INFO, logger="service.supervisor")
    server = TritonServer(repository, TritonPorts.free(), log_file=tmp_path / "tritonserver.log")
    client = PipelineClient(server.grpc_url, timeout_s=5)
    image = (repository / PROBE_FILE).read_bytes()
    supervisor = Supervisor(server, steps=(0.5,), hang_timeout_s=2.0,
                            recognition=lambda _fresh: probe(client, image)).start()
    try:
        first = supervisor.server
        assert first is not None and first.pid is not None
        stopped = stubs_of(first.pid, "face_pipeline")
        assert stopped
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        assert first.healthy(), "Triton itself still says ready"
        wait_for(lambda: supervisor.ended["hung"] == 1, 30, "the run is ended as hung")
        wait_for(lambda: supervisor.status().up, 120, "the restart")
        assert [p for p in stopped if alive(p)] == [] and shm(first.shm_prefix) == []
        assert supervisor.ended == {"exited": 0, "hung": 1} and supervisor.restarts == 1
        assert probe(client, image).ok
    finally:
        supervisor.stop()
        client.close()
    assert "is not healthy" in caplog.text and "killing it and its stubs" in caplog.text


@dataclass
class Outcome:
    began: float  # time.monotonic()
    ended: float
    status: int
    code: str | None
    retry_after: str | None

    @property
    def took(self) -> float:
        return self.ended - self.began


@pytest.mark.triton
def test_a_frozen_triton_fails_calls_fast_and_is_healed(cpu_repository: Path, tmp_path: Path,
                                                         photo_bytes: dict[str, bytes]) -> None:
    """``python -m service`` under load, its whole tritonserver process group frozen (SIGSTOP: as a
    frozen host, it answers nothing and resets nothing). Every call fails within seconds with 503 and
    Retry-After, none is refused as ``overloaded`` (their slots are freed), readiness says why, and the
    supervisor kills the run after FACEREC_TRITON__HANG_TIMEOUT_S, removes what it left and starts another;
    recognition resumes without a gateway restart, and the restart is counted as ``hung``."""
    outcomes: list[Outcome] = []
    stop = threading.Event()
    with local_stack(cpu_repository, tmp_path, FACEREC_TRITON__HANG_TIMEOUT_S="3",
                     FACEREC_LIMITS__MAX_IN_FLIGHT="4") as stack:
        service, base = stack.process, stack.base

        def load() -> None:  # one client of four, each with one request at a time
            while not stop.is_set():
                began = time.monotonic()
                response = httpx.post(f"{base}/v1/detect", headers=stack.headers, timeout=60,
                                      files={"image": ("t1.jpg", photo_bytes["t1.jpg"], "image/jpeg")})
                code = None if response.status_code == 200 else response.json().get("code")
                outcomes.append(Outcome(began, time.monotonic(), response.status_code, code,
                                        response.headers.get("retry-after")))

        def readiness() -> dict[str, Any]:
            try:
                body: dict[str, Any] = httpx.get(f"{base}/health/ready", timeout=10).json()
            except httpx.HTTPError:
                return {}
            return body

        clients = [threading.Thread(target=load) for _ in range(4)]
        try:
            wait_for(lambda: readiness().get("ready") is True, 180, "the stack is ready")
            server = tritonserver_child(service.pid)
            assert server is not None
            stubs, prefix = stubs_of(server), shm_prefix_of(server)
            assert stubs and shm(prefix)
            for client in clients:
                client.start()
            wait_for(lambda: len(outcomes) >= 8, 30, "load before the freeze")
            os.killpg(server, signal.SIGSTOP)
            frozen = time.monotonic()
            why = "no answer to its health check"
            wait_for(lambda: why in readiness().get("details", {}).get("triton", ""), 30, "readiness says")
            wait_for(lambda: readiness().get("ready") is True, 120, "ready again")
            healed = time.monotonic() - frozen
            time.sleep(1.0)
        finally:
            stop.set()
            for client in clients:
                client.join(60)
        restarts = httpx.get(f"{base}/metrics", timeout=10).text
        assert 'facerec_triton_restarts_total{reason="hung"} 1.0' in restarts
        assert 'facerec_triton_restarts_total{reason="exited"} 0.0' in restarts
        assert [p for p in [server, *stubs] if alive(p)] == [], "the frozen run and its stubs were killed"
        assert shm(prefix) == [], "and its shared memory removed"
        restarted = tritonserver_child(service.pid)
        assert restarted is not None and restarted != server and service.poll() is None
    after = [o for o in outcomes if o.ended > frozen]
    assert len([o for o in after if o.status != 200]) >= 4, outcomes
    slow = [o for o in after if o.took > FAIL_FAST_S]
    assert slow == [], f"calls that waited for the frozen server: {slow}"
    refused = {(o.status, o.code, o.retry_after is not None and o.retry_after.isdigit()) for o in after
               if o.status != 200}
    assert refused == {(503, "triton_unavailable", True)}, "503 + Retry-After; never overloaded"
    assert after[-1].status == 200, "recognition resumed"
    in_flight = [o.ended - frozen for o in after if o.began < frozen]
    log = stack.log.read_text()
    assert "tritonserver hung (no answer to its health check" in log and "restarted and ready" in log
    print(f"calls in flight at the freeze failed {min(in_flight):.1f}-{max(in_flight):.1f} s after it, the "
          f"slowest call took {max(o.took for o in after):.1f} s; ready again {healed:.1f} s after the "
          "SIGSTOP (hang timeout 3 s)")
