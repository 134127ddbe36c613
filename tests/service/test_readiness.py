"""``service.readiness`` and ``/health/ready``: a pipeline whose models are loaded but which cannot
recognize a face is not ready; the probe's result is cached, and a failure is re-checked quickly."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from export.defaults import DefaultModels
from facecore.client import PipelineError
from facecore.contract import Faces
from facecore.spec import ModelSpec
from service import readiness
from service.launcher import TritonServer
from service.readiness import NOT_READY, RETRY_S, RecognitionCheck
from tests.facecore.test_probe import faces

if TYPE_CHECKING:
    from tests.service.fixtures import StartApi

pytest_plugins = ["tests.service.fixtures"]


class FakePipeline:
    """An ``AsyncPipeline`` that counts its calls and can be broken or slowed down."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec, self.calls, self.broken, self.delay = spec, 0, False, 0.0

    async def infer(self, image: bytes, **_: Any) -> Faces:
        self.calls += 1
        await asyncio.sleep(self.delay)
        if self.broken:
            raise PipelineError("face_pipeline: face_embedder failed", "StatusCode.INTERNAL")
        return faces(1, self.spec.embedding_dim)

    async def embedder(self) -> ModelSpec:
        return self.spec


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def fake(default_models: DefaultModels) -> FakePipeline:
    return FakePipeline(default_models.embedder)


def test_success_is_cached_for_the_interval(fake: FakePipeline) -> None:
    clock = Clock()
    check = RecognitionCheck(fake, b"jpeg", interval_s=30, clock=clock)

    async def scenario() -> list[bool]:
        seen = [(await check.result()).ok]
        clock.now += 29
        seen.append((await check.result()).ok)
        assert fake.calls == 1, "a fresh success is reused"
        fake.broken = True
        clock.now += 2
        seen.append((await check.result()).ok)
        return seen

    assert asyncio.run(scenario()) == [True, True, False]
    assert fake.calls == 2
    assert "face_embedder failed" in check.last.detail


def test_failure_is_rechecked_after_a_second(fake: FakePipeline) -> None:
    clock = Clock()
    check = RecognitionCheck(fake, b"jpeg", interval_s=30, clock=clock)
    fake.broken = True

    async def scenario() -> list[bool]:
        seen = [(await check.result()).ok]
        clock.now += RETRY_S / 2
        seen.append((await check.result()).ok)
        fake.broken = False
        clock.now += RETRY_S
        seen.append((await check.result()).ok)
        return seen

    assert asyncio.run(scenario()) == [False, False, True]
    assert fake.calls == 2


def test_concurrent_readiness_requests_share_one_probe(fake: FakePipeline) -> None:
    fake.delay = 0.2
    check = RecognitionCheck(fake, b"jpeg", interval_s=30)

    async def scenario() -> list[bool]:
        return [r.ok for r in await asyncio.gather(*(check.result() for _ in range(5)))]

    assert asyncio.run(scenario()) == [True] * 5
    assert fake.calls == 1


def test_a_hanging_pipeline_is_not_ready(fake: FakePipeline, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(readiness, "PROBE_TIMEOUT_S", 0.05)
    fake.delay = 5.0
    result = asyncio.run(RecognitionCheck(fake, b"jpeg", interval_s=30).refresh())
    assert not result.ok and "no answer to the probe within 0.05 s" in result.detail


def test_readiness_is_asked_before_the_probe_and_counted(fake: FakePipeline) -> None:
    """With ``ready``, a Triton that says "not ready" fails the probe without an inference, and the check
    tells that apart (``triton_ready``, read by the metrics) from a ready pipeline that fails."""
    answers: list[bool] = []

    async def ready(timeout: float) -> bool:
        assert timeout < readiness.PROBE_TIMEOUT_S  # answers before the probe's own timeout
        return answers.pop(0)

    check = RecognitionCheck(fake, b"jpeg", interval_s=30, ready=ready)
    assert check.triton_ready is None and check.failures == 0

    async def scenario() -> list[tuple[bool, bool | None, int, int]]:
        seen = []
        for ready_now, broken in ((False, False), (True, True), (True, False)):
            answers.append(ready_now)
            fake.broken = broken
            result = await check.refresh()
            seen.append((result.ok, check.triton_ready, check.failures, fake.calls))
        assert check.last.ok
        check.invalidate("Triton went away")
        return seen

    assert asyncio.run(scenario()) == [(False, False, 1, 0), (False, True, 2, 1), (True, True, 2, 2)]
    assert check.triton_ready is False
    answers.append(False)
    assert asyncio.run(check.refresh()).detail == NOT_READY


@pytest.mark.triton
def test_gateway_is_not_ready_when_recognition_fails(broken_triton: TritonServer,
                                                     start_api: StartApi) -> None:
    api = start_api(triton_url=broken_triton.grpc_url)
    response = api.client.get("/health/ready")
    assert response.status_code == 503
    body = response.json()
    assert body["checks"] == {"triton": True, "recognition": False, "database": True, "gallery": True}
    assert "face_embedder" in body["details"]["recognition"]


@pytest.mark.triton
def test_gateway_probes_at_start_up(start_api: StartApi, cpu_repository: Path) -> None:
    api = start_api()
    check: RecognitionCheck = api.app.state.recognition_check
    assert check.last.ok and check.last.detail == "1 face, 128-d embedding", "probed before the first request"
    assert api.ok(api.client.get("/health/ready"))["ready"] is True


def test_a_hung_triton_is_not_ready_within_the_probes_budget(start_api: StartApi,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A Triton that accepts connections and never answers (wedged, stopped) made /health/ready wait an
    inference's timeout (30 s), past every readiness probe's; now it is "not ready" within
    ``CHECK_TIMEOUT_S``."""
    import socket
    import time

    from service.routers import health

    monkeypatch.setattr(readiness, "PROBE_TIMEOUT_S", 0.5)  # the start-up probe meets the same silence
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen()  # the kernel completes the handshake; nothing is ever sent back
    try:
        api = start_api(triton_url=f"127.0.0.1:{hung.getsockname()[1]}", triton={"timeout_s": 60.0})
        started = time.monotonic()
        response = api.client.get("/health/ready")
        waited = time.monotonic() - started
    finally:
        hung.close()
    assert response.status_code == 503 and response.json()["checks"]["triton"] is False
    assert waited < health.CHECK_TIMEOUT_S + 10 < 60, waited  # not the inference's 60 s
