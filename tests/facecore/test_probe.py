"""``facecore.probe``: the recognition probe against the real Triton, a broken one, and no server."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from facecore.client import PipelineClient
from facecore.contract import Faces
from facecore.probe import PROBE_FILE, judge, main, probe, probe_image
from service.launcher import TritonServer
from tests.conftest import free_ports


def faces(count: int, dim: int = 128, norm: float = 1.0) -> Faces:
    embeddings = np.zeros((count, dim), np.float32)
    embeddings[:, 0] = norm
    return Faces(boxes=np.zeros((count, 4), np.float32), scores=np.ones(count, np.float32),
                 landmarks=np.zeros((count, 5, 2), np.float32), embeddings=embeddings,
                 blur=np.zeros(count, np.float32), crops=np.zeros((0, 112, 112, 3), np.uint8),
                 width=256, height=256)


def test_judge_wants_a_face_with_a_unit_embedding_of_the_announced_size() -> None:
    assert judge(faces(1), 128).ok
    assert "no face" in judge(faces(0), 128).detail
    assert "shape (1, 128), expected (1, 512)" in judge(faces(1), 512).detail
    assert "not unit vectors" in judge(faces(1, norm=0.0), 128).detail
    assert not judge(faces(1, norm=float("nan")), 128).ok


def test_the_exporter_writes_the_probe_photo(cpu_repository: Path) -> None:
    assert (cpu_repository / PROBE_FILE).read_bytes() == probe_image()
    assert probe_image()[:3] == b"\xff\xd8\xff"  # JPEG


@pytest.mark.triton
def test_probe_passes_on_the_real_pipeline(triton: TritonServer, cpu_repository: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    client = PipelineClient(triton.grpc_url)
    try:
        result = probe(client, probe_image())
    finally:
        client.close()
    assert result.ok and result.detail == "1 face, 128-d embedding"
    assert main(["--url", triton.grpc_url, "--image", str(cpu_repository / PROBE_FILE)]) == 0
    assert capsys.readouterr().out == "ok: 1 face, 128-d embedding\n"


@pytest.mark.triton
def test_probe_fails_where_models_are_ready_but_recognition_is_broken(
    broken_triton: TritonServer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert all(broken_triton.models_ready().values()), "is_model_ready says yes"
    assert main(["--url", broken_triton.grpc_url]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAILED: face_pipeline failed:") and "face_embedder" in out


def test_probe_fails_without_a_server(capsys: pytest.CaptureFixture[str]) -> None:
    (port,) = free_ports(1)
    assert main(["--url", f"127.0.0.1:{port}", "--timeout", "3"]) == 1
    assert capsys.readouterr().out.startswith("FAILED: face_pipeline failed:")
