"""deploy/triton/healthcheck.py, the Triton containers' healthcheck and liveness check, run here against the
bundled tritonserver: healthy, a stub stopped, the whole server frozen (SIGSTOP) and killed once it has been
hung for ``--kill-hung-after`` (the test names the server with ``--server-pid``: this machine runs others)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from types import ModuleType

import pytest

from facecore.probe import PROBE_FILE, ProbeResult
from service.launcher import TritonPorts, TritonServer
from tests.deploy.helpers import load_module
from tests.service.test_hung import stubs_of
from tests.service.test_supervisor import alive, shm, wait_for

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


@pytest.fixture(scope="module")
def health() -> ModuleType:
    return load_module(DEPLOY / "triton" / "healthcheck.py", "facerec_triton_healthcheck")


@pytest.mark.triton
def test_the_check_tells_healthy_broken_and_hung_and_ends_a_hung_server(
        health: ModuleType, cpu_repository: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    server = TritonServer(cpu_repository, TritonPorts.free(), log_file=tmp_path / "tritonserver.log").start()
    try:
        assert server.pid is not None
        pid, state = server.pid, tmp_path / "state.json"
        common = ["--image", str(cpu_repository / PROBE_FILE), "--url", server.grpc_url,
                  "--http", server.http_url]
        kill_mode = [*common, "--kill-hung-after", "2", "--state", str(state), "--server-pid", str(pid)]

        def check(*extra: str) -> int:
            code: int = health.main([*common, *extra])
            return code

        assert check() == 0 and check("--liveness") == 0
        assert health.main(kill_mode) == 0 and json.loads(state.read_text())["passed"] is True

        pipeline_stubs = stubs_of(pid, "face_pipeline")
        for stub in pipeline_stubs:
            os.kill(stub, signal.SIGSTOP)
        assert server.healthy(), "Triton's own health endpoint does not see a stopped stub"
        assert check() == 1 and check("--liveness") == 1, "but Triton says so when a request fails"
        assert "is not healthy" in capsys.readouterr().out
        for stub in pipeline_stubs:  # (still "not healthy" to Triton 30 s later: only a restart heals it)
            os.kill(stub, signal.SIGCONT)

        os.killpg(pid, signal.SIGSTOP)
        began = time.monotonic()
        assert check("--liveness") == 1
        assert health.main(kill_mode) == 1 and alive(pid), "hung, but not for 2 s yet"
        took = time.monotonic() - began
        time.sleep(max(0.0, 2.0 - took))
        assert health.main(kill_mode) == 1
        assert "killed, the container restarts" in capsys.readouterr().out
        wait_for(lambda: server.exit_code() is not None, 10, "the frozen server is killed")
        assert server.exit_code() == -signal.SIGKILL
        wait_for(lambda: not [p for p in pipeline_stubs if alive(p)], 10, "its stubs too")
        assert shm(server.shm_prefix) == [], "and its shared memory"
        print(f"one check against the frozen server took {took / 2:.1f} s")
    finally:
        server.stop()


def test_only_a_server_that_passed_the_probe_before_can_be_hung(health: ModuleType, tmp_path: Path) -> None:
    """A server still loading its models fails the probe and its health check too: never killed. And a
    new server (same state file, a container restarted) starts from scratch."""
    state = tmp_path / "state.json"
    failed, passed = ProbeResult(False, "connection refused", 0.0), ProbeResult(True, "1 face", 0.0)
    loading = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        assert health.track(state, failed, "no answer", 0.0, loading.pid) is None
        assert health.track(state, failed, "no answer", 0.0, loading.pid) is None
        assert loading.poll() is None, "never passed: loading, not hung"
        assert health.track(state, passed, None, 0.0, loading.pid) is None
        done = health.track(state, failed, "no answer", 0.0, loading.pid)
        assert done is not None and "killed" in done
        assert loading.wait(10) == -signal.SIGKILL
    finally:
        if loading.poll() is None:
            loading.kill()
    restarted = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        assert health.track(state, failed, "no answer", 0.0, restarted.pid) is None
        assert restarted.poll() is None and json.loads(state.read_text())["passed"] is False
    finally:
        restarted.kill()
        restarted.wait()
