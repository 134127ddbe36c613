"""``service.supervisor`` and ``python -m service`` against the real tritonserver, killed for real (SIGKILL):
the dead run's stubs and /dev/shm regions go, a new run starts with backoff, the gateway answers 503
with Retry-After meanwhile, says so in /health/ready, and serves again afterwards without a restart."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import pytest

from facecore.client import PipelineClient
from service.launcher import TritonPorts, TritonServer, group_members
from service.readiness import PROBE_TIMEOUT_S, RETRY_S
from service.supervisor import WATCH_S, Supervisor, backoff
from tests import ROOT
from tests.conftest import free_ports

pytestmark = pytest.mark.triton


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> float:
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.1)
    return time.monotonic() - started


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def shm(prefix: str) -> list[Path]:
    return list(Path("/dev/shm").glob(f"{prefix}*"))


def test_backoff_grows_then_stays() -> None:
    assert [backoff(n) for n in (1, 2, 3, 4, 5, 6, 7, 50)] == [1, 2, 4, 8, 15, 30, 30, 30]


@pytest.fixture
def supervisor(cpu_repository: Path, tmp_path: Path) -> Iterator[Supervisor]:
    repository = Path(shutil.copytree(cpu_repository, tmp_path / "cpu",
                                      ignore=shutil.ignore_patterns("__pycache__")))
    server = TritonServer(repository, TritonPorts.free(), log_file=tmp_path / "tritonserver.log")
    running = Supervisor(server, steps=(0.5, 1.0, 2.0)).start()
    try:
        yield running
    finally:
        running.stop()


def test_a_killed_server_is_reaped_and_restarted(supervisor: Supervisor, photo_bytes: dict[str, bytes],
                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="service.supervisor")
    first = supervisor.server
    assert first is not None and first.pid is not None
    pid, prefix = first.pid, first.shm_prefix
    stubs = [p for p in group_members(pid) if p != pid]
    assert len(stubs) >= 3 and shm(prefix), "one stub per model instance, with their shared memory"
    # A stub that does not notice its server died (as they linger for seconds after a SIGKILL).
    os.kill(stubs[0], signal.SIGSTOP)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not supervisor.status().up, 10, "the supervisor notices")
    assert "exited with code -9" in supervisor.status().detail
    wait_for(lambda: supervisor.status().up, 120, "the restart")
    assert supervisor.server is not first and supervisor.restarts == 1
    assert [p for p in stubs if alive(p)] == [], "the dead run's stubs are gone, the stopped one too"
    assert shm(prefix) == [], "and its shared memory"
    assert supervisor.server.shm_prefix != prefix and shm(supervisor.server.shm_prefix)
    assert "restarting it in 0 s (attempt 1)" in caplog.text and "restarted and ready" in caplog.text
    client = PipelineClient(supervisor.server.grpc_url)
    try:
        assert len(client.infer(photo_bytes["t1.jpg"])) == 6
    finally:
        client.close()


def test_failed_restarts_back_off_until_one_succeeds(supervisor: Supervisor) -> None:
    repository = supervisor.template.model_repository
    hidden = repository.with_name("hidden")
    repository.rename(hidden)  # the next starts fail: "no model repository"
    first = supervisor.server
    assert first is not None and first.pid is not None
    os.kill(first.pid, signal.SIGKILL)
    wait_for(lambda: "attempt 3" in supervisor.status().detail, 30, "three attempts")
    assert "failed to restart (no model repository" in supervisor.status().detail
    assert not supervisor.status().up
    hidden.rename(repository)
    wait_for(lambda: supervisor.status().up, 120, "the restart once the repository is back")
    assert supervisor.restarts == 1


# --- python -m service: the gateway keeps running while its Triton is restarted -------------------------

def tritonserver_child(parent: int) -> int | None:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            name, rest = stat[stat.index("(") + 1: stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
            if name == "tritonserver" and int(rest[1]) == parent and rest[0] not in ("Z", "X"):
                return int(entry.name)
    return None


@dataclass
class LocalStack:
    """A running ``python -m service``: its process, base URL and admin headers, and its log file."""

    process: subprocess.Popen[bytes]
    base: str
    headers: dict[str, str]
    log: Path


@contextmanager
def local_stack(repository: Path, tmp_path: Path, **env: str) -> Iterator[LocalStack]:
    """``python -m service`` on free ports with a fresh SQLite gallery (``env``: more settings), its output
    in ``tmp_path/service.log``; SIGTERM at the end (SIGKILL if it does not exit within a minute)."""
    port, *triton = free_ports(4)
    settings = {**os.environ, "FACEREC_SECURITY__ADMIN_KEY": "k" * 32,
                "FACEREC_DATABASE__URL": f"sqlite:///{tmp_path / 'gallery.db'}",
                "FACEREC_GALLERY__SNAPSHOT_DIR": str(tmp_path / "index"), **env}
    command = [sys.executable, "-m", "service", "--port", str(port), "--triton-ports", *map(str, triton),
               "--model-repository", str(repository), "--admin-key-file", str(tmp_path / "admin_key")]
    log = tmp_path / "service.log"
    with log.open("w") as output:
        process = subprocess.Popen(command, cwd=ROOT, env=settings, stdout=output, stderr=subprocess.STDOUT)
        try:
            yield LocalStack(process, f"http://127.0.0.1:{port}", {"X-API-Key": "k" * 32}, log)
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            finally:
                if process.poll() is None:
                    process.kill()


def test_the_local_stack_heals_itself(cpu_repository: Path, tmp_path: Path,
                                      photo_bytes: dict[str, bytes]) -> None:
    with local_stack(cpu_repository, tmp_path) as stack:
        service, base, headers = stack.process, stack.base, stack.headers

        def detect() -> httpx.Response:
            return httpx.post(f"{base}/v1/detect", headers=headers, timeout=30,
                              files={"image": ("t1.jpg", photo_bytes["t1.jpg"], "image/jpeg")})

        def ready() -> httpx.Response:
            return httpx.get(f"{base}/health/ready", timeout=10)

        wait_for(lambda: _status(ready) == 200, 180, "the stack is ready")
        assert len(detect().json()["faces"]) == 6
        server = tritonserver_child(service.pid)
        assert server is not None
        os.kill(server, signal.SIGKILL)

        unavailable = detect()
        assert unavailable.status_code == 503, unavailable.text
        assert unavailable.json()["code"] == "triton_unavailable"
        assert unavailable.headers["retry-after"].isdigit()

        def says_restarting() -> bool:
            down = ready()
            assert down.status_code == 503 and down.json()["checks"]["triton"] is False, down.text
            return "tritonserver exited with code -9; restart attempt 1" in down.json()["details"]["triton"]

        wait_for(says_restarting, 10, "/health/ready says Triton is being restarted")

        took = wait_for(lambda: _status(detect) == 200, 120, "recognition after the restart")
        assert len(detect().json()["faces"]) == 6
        # a probe that failed while the new run's channel reconnected is reused for up to RETRY_S
        wait_for(lambda: ready().json()["ready"] is True, RETRY_S + PROBE_TIMEOUT_S, "ready again")
        assert service.poll() is None, "the gateway itself was not restarted"
        restarted = tritonserver_child(service.pid)
        assert restarted is not None and restarted != server
        restarts = httpx.get(f"{base}/metrics", timeout=10).text
        assert 'facerec_triton_restarts_total{reason="exited"} 1.0' in restarts
        print(f"recognition back {took:.1f} s after the SIGKILL")
    log = stack.log.read_text()
    assert "tritonserver exited with code -9" in log and "restarted and ready" in log


def _status(call: Callable[[], httpx.Response]) -> int:
    try:
        return call().status_code
    except httpx.HTTPError:
        return 0


@dataclass
class SleepingServer:
    """A stand-in for TritonServer around a real child process (``sleep``), for the supervisor's watch."""

    shm_prefix: str = "facerec_test_"
    process: subprocess.Popen[bytes] | None = None

    def start(self, _timeout: float, _stop: threading.Event | None = None) -> SleepingServer:
        return replace(self, process=subprocess.Popen(["sleep", "60"]))

    def exit_code(self) -> int | None:
        assert self.process is not None
        return self.process.poll()

    def healthy(self, _timeout: float) -> bool:
        return True

    def kill(self) -> int | None:
        return self.stop()

    def reap(self) -> list[int]:
        return []

    def stop(self) -> int | None:
        if self.process is not None:
            self.process.kill()
            return self.process.wait()
        return None


def test_the_watch_of_a_running_server_sleeps_between_looks() -> None:
    """It wakes about twice a second (Popen.wait(0.5) woke ~20 times: 3 ms of CPU per second in every
    ``python -m service``), and still notices a death within a look."""
    supervisor = Supervisor(SleepingServer(), steps=(60.0,)).start()  # type: ignore[arg-type]
    try:
        assert supervisor._thread is not None and supervisor._thread.native_id is not None
        status = Path(f"/proc/self/task/{supervisor._thread.native_id}/status")

        def switches() -> int:
            return int(next(line.split()[1] for line in status.read_text().splitlines()
                            if line.startswith("voluntary_ctxt_switches")))

        before = switches()
        time.sleep(2.0)
        assert switches() - before <= 8, "the watch woke more than about every WATCH_S"
        assert supervisor.server is not None and supervisor.server.process is not None
        supervisor.server.process.kill()
        waited = wait_for(lambda: not supervisor.status().up, 5, "the supervisor notices")
        assert waited < 2 * WATCH_S + 0.5 and "exited with code -9" in supervisor.status().detail
    finally:
        supervisor.stop()


@dataclass
class NeverReadyServer(TritonServer):
    """A TritonServer whose process (``sleep``) never becomes ready; each run writes its pid to pid_file."""

    pid_file: Path = Path("/nonexistent")

    def command(self) -> list[str]:
        return ["sh", "-c", f"echo $$ > {self.pid_file}.tmp && mv {self.pid_file}.tmp {self.pid_file}; "
                "exec sleep 60"]


def test_stop_during_a_restart_cancels_it(tmp_path: Path) -> None:
    """SIGTERM while a restarted run loads its models: stop() returns at once, and that run is stopped
    (it waited out the start timeout, and a run that outlived the join was left running)."""
    supervisor = Supervisor(SleepingServer(), steps=(0.1,), start_timeout_s=20).start()  # type: ignore[arg-type]
    pid_file = tmp_path / "pid"
    supervisor.template = NeverReadyServer(tmp_path, TritonPorts.free(), pid_file=pid_file)
    pid = 0
    try:
        assert supervisor.server is not None and supervisor.server.process is not None
        supervisor.server.process.kill()
        wait_for(pid_file.exists, 10, "a restart starts a run")
        pid = int(pid_file.read_text())
        assert alive(pid) and "restart attempt 1 starting" in supervisor.status().detail
        began = time.monotonic()
        supervisor.stop()
        took = time.monotonic() - began
    finally:
        supervisor.stop()
        if pid and alive(pid):
            os.kill(pid, signal.SIGKILL)
    assert took < 5, f"stop() took {took:.1f} s"
    assert not alive(pid), "the half-started run is stopped"
