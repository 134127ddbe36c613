"""The launcher: start, readiness, clean stop (exit code, /dev/shm), failure reporting."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from service.launcher import TritonPorts, TritonServer, TritonStartError
from tests.conftest import ROOT, free_ports

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
