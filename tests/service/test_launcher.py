"""The launcher: start, readiness, clean stop (exit code, /dev/shm), failure reporting."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import grpc
import pytest

from facecore.client import channel_options
from service.launcher import (
    TritonPorts,
    TritonServer,
    TritonStartError,
    http_status,
    stop_process,
    stopped,
)
from tests import ROOT
from tests.conftest import free_ports
from tests.service.test_supervisor import alive, wait_for

pytestmark = pytest.mark.triton


def test_start_ready_and_clean_stop(cpu_repository: Path, tmp_path: Path) -> None:
    server = TritonServer(cpu_repository, TritonPorts(*free_ports(3)), log_file=tmp_path / "log")
    server.start()
    try:
        assert server.models_ready() == {"face_detector": True, "face_embedder": True, "face_pipeline": True}
        assert list(Path("/dev/shm").glob(f"{server.shm_prefix}*")), "the Python backend uses shared memory"
        metrics = f"http://127.0.0.1:{server.ports.metrics}/metrics"
        with urllib.request.urlopen(metrics, timeout=5) as response:
            assert b"nv_inference_request_success" in response.read()
    finally:
        code = server.stop()
    assert code == 0
    assert not list(Path("/dev/shm").glob(f"{server.shm_prefix}*"))


def test_ready_waits_for_the_metrics_endpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Models ready is not enough: start() returns once /metrics answers too (Triton starts it last)."""
    import service.launcher as launcher

    metrics_answers = iter([0, 0, 200])
    asked: list[str] = []

    def status(url: str, timeout: float = 2.0) -> int:
        asked.append(url)
        return next(metrics_answers) if url.endswith("/metrics") else 200

    monkeypatch.setattr(launcher, "http_status", status)
    server = TritonServer(tmp_path, TritonPorts(1, 2, 3))
    server.wait_ready(timeout=5)
    assert [url for url in asked if url.endswith("/metrics")] == ["http://127.0.0.1:3/metrics"] * 3
    metrics_answers = iter([0] * 100)
    with pytest.raises(TritonStartError, match="not ready"):
        server.wait_ready(timeout=0.3)


def test_missing_repository_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TritonStartError, match="export defaults"):
        TritonServer(tmp_path / "nothing").start()


def test_a_broken_model_fails_the_start_and_cleans_up(cpu_repository: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    (broken / "face_pipeline" / "1").mkdir(parents=True)
    (broken / "face_pipeline" / "config.pbtxt").write_text('backend: "python"\nmax_batch_size: 1\n')
    (broken / "face_pipeline" / "1" / "model.py").write_text("raise RuntimeError('boom')\n")
    server = TritonServer(
        broken, TritonPorts(*free_ports(3)), models=("face_pipeline",), log_file=tmp_path / "log"
    )
    with pytest.raises(TritonStartError):
        server.start(timeout=60)
    assert not server.running
    assert not list(Path("/dev/shm").glob(f"{server.shm_prefix}*"))


def test_command_line_runs_until_sigterm(cpu_repository: Path, tmp_path: Path) -> None:
    http, grpc, metrics = free_ports(3)
    command = [sys.executable, "-m", "service.launcher", "--model-repository", str(cpu_repository),
               "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        ready = False
        while time.monotonic() < deadline and process.poll() is None and not ready:
            try:
                url = f"http://127.0.0.1:{http}/v2/models/face_pipeline/ready"
                with urllib.request.urlopen(url, timeout=2) as r:
                    ready = r.status == 200
            except OSError:
                time.sleep(0.5)
        assert ready
        os.kill(process.pid, signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output
    assert "tritonserver stopped (exit code 0)" in output


def test_the_server_reports_its_process_and_version(cpu_repository: Path, tmp_path: Path) -> None:
    server = TritonServer(cpu_repository, TritonPorts.free(), log_file=tmp_path / "log")
    assert server.pid is None
    with server:
        pid = server.pid
        assert pid is not None
        assert Path(f"/proc/{pid}/comm").read_text().strip() == "tritonserver"
        assert f"shm-region-prefix-name={server.shm_prefix}" in Path(f"/proc/{pid}/cmdline").read_text()
        assert server.version() == "2.51.0"
    assert server.pid is None and server.version() == "unknown"


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = TritonPorts.free()
    values = [ports.http, ports.grpc, ports.metrics]
    assert len(set(values)) == 3 and all(port > 1024 for port in values)
    for port in values:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_stop_process_kills_a_child_that_ignores_sigterm(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    script = f"trap '' TERM; touch {ready}; sleep 60 & wait; sleep 60"
    process = subprocess.Popen(["sh", "-c", script], start_new_session=True)
    deadline = time.monotonic() + 10
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    began = time.monotonic()
    assert stop_process(process, timeout=0.5) == -signal.SIGKILL
    assert time.monotonic() - began < 10


def test_stop_process_does_not_wait_for_a_stopped_child() -> None:
    """A stopped process (SIGSTOP, as a hung server is) acts on SIGTERM only once continued: SIGKILL at
    once rather than after the timeout."""
    process = subprocess.Popen(["sleep", "60"], start_new_session=True)
    os.kill(process.pid, signal.SIGSTOP)
    wait_for(lambda: stopped(process.pid), 5, "the child is stopped")
    began = time.monotonic()
    assert stop_process(process, timeout=20) == -signal.SIGKILL
    assert time.monotonic() - began < 2


def test_http_status_reports_what_answers(triton: TritonServer) -> None:
    assert http_status(f"{triton.http_url}/v2/health/ready") == 200
    assert http_status(f"{triton.http_url}/v2/models/no_such_model/ready") == 400
    assert http_status(f"http://127.0.0.1:{TritonPorts.free().http}/") == 0


def test_a_taken_port_is_refused_before_starting(tmp_path: Path) -> None:
    """Something listening on one of the ports (a leftover tritonserver, an NGC one) would answer the
    readiness checks for a run that cannot bind and exits: the start is refused, naming the port."""
    repository = tmp_path / "repository"
    repository.mkdir()
    ports = TritonPorts.free()
    server = TritonServer(repository, ports, log_file=tmp_path / "log")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", ports.metrics))
        holder.listen()
        began = time.monotonic()
        busy = rf"metrics port {ports.metrics} .*--triton-ports.*--triton-url"
        with pytest.raises(TritonStartError, match=busy):
            server.start(timeout=10)
    assert time.monotonic() - began < 2 and server.exit_code() is None, "nothing was started"


def test_ready_requires_the_run_still_running(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Answers that came while the run's own process exited were another server's: not ready."""
    import service.launcher as launcher

    process = subprocess.Popen(["sleep", "0.3"])

    def status(url: str, timeout: float = 2.0) -> int:
        process.wait()  # the run gave up (its bind failed) while the other server answered 200
        return 200

    monkeypatch.setattr(launcher, "http_status", status)
    server = TritonServer(tmp_path, TritonPorts(1, 2, 3))
    server._process = process
    with pytest.raises(TritonStartError, match="exited with code 0"):
        server.wait_ready(timeout=5)


PARENT = """
import sys, threading, time
from pathlib import Path
from service.launcher import TritonPorts, TritonServer

pid = sys.argv[2]

class StandIn(TritonServer):  # never ready: the parent waits for it until it is killed
    def command(self) -> list[str]:
        return ["sh", "-c", f"echo $$ > {pid}.tmp && mv {pid}.tmp {pid}; exec sleep 60"]

server = StandIn(Path(sys.argv[1]), TritonPorts.free())
if sys.argv[3] == "thread":  # as the supervisor's watcher restarts it, while other threads come and go
    threading.Thread(target=server.start, args=(60,)).start()
    threading.Thread(target=time.sleep, args=(0.1,)).start()
    time.sleep(60)
else:
    server.start(60)
"""


@pytest.mark.parametrize("starter", ["main", "thread"])
def test_the_server_dies_with_a_killed_parent(tmp_path: Path, starter: str) -> None:
    """A gateway killed without unwinding (SIGKILL, the OOM killer) does not leave its server running."""
    pid_file = tmp_path / "pid"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path), str(pid_file), starter], cwd=ROOT)
    child = 0
    try:
        wait_for(pid_file.exists, 30, "the stand-in server starts")
        child = int(pid_file.read_text())
        time.sleep(1.0)
        assert alive(child), "it runs while the thread that started it runs"
        parent.kill()
        parent.wait()
        wait_for(lambda: not alive(child), 5, "the server dies with its parent")
    finally:
        parent.kill()
        parent.wait()
        if child and alive(child):
            os.kill(child, signal.SIGKILL)


#: Triton's defaults for what ``keepalive_args`` sets: pings without calls 2 hours apart at least.
TRITON_DEFAULTS = ("--grpc-keepalive-permit-without-calls=0",
                   "--grpc-http2-min-recv-ping-interval-without-data=300000")


def test_keepalive_pings_are_welcome(cpu_repository: Path, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """An idle gateway channel pings every KEEPALIVE_TIME_MS; the server started with ``keepalive_args``
    takes them all, one with Triton's defaults (the same flags given again, later ones win) answers GOAWAY
    too_many_pings after three. Triton's gRPC core logs both with GRPC_TRACE=http_keepalive. Twenty
    seconds: ten pings, where three strikes are enough for a GOAWAY."""
    with ExitStack() as stack:
        with monkeypatch.context() as env:  # for tritonserver only, not this process's gRPC
            env.setenv("GRPC_VERBOSITY", "DEBUG")
            env.setenv("GRPC_TRACE", "http_keepalive")
            servers = [stack.enter_context(TritonServer(
                cpu_repository, TritonPorts.free(), models=("face_detector",), explicit=True,
                log_file=tmp_path / f"{name}.log", extra_args=extra)) for name, extra in
                (("flags", ()), ("defaults", TRITON_DEFAULTS))]
        seen: list[list[grpc.ChannelConnectivity]] = [[], []]
        for server, states in zip(servers, seen, strict=True):
            channel = grpc.insecure_channel(server.grpc_url, options=channel_options())
            stack.callback(channel.close)
            channel.subscribe(states.append, try_to_connect=True)
            grpc.channel_ready_future(channel).result(timeout=10)
        time.sleep(20)
    with_flags, with_defaults = ((tmp_path / f"{name}.log").read_text() for name in ("flags", "defaults"))
    assert with_flags.count("ping") >= 5, "the pings reached the server (and its log)"
    assert "too_many_pings" not in with_flags and seen[0][-1] == grpc.ChannelConnectivity.READY
    assert "too_many_pings" in with_defaults and seen[1][-1] == grpc.ChannelConnectivity.IDLE
