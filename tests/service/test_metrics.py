"""``service.metrics``: the collectors the alerting rules read (deploy/prometheus/alerts.yml), parsed as
Prometheus parses them. The gateway's request metrics are in tests/service/test_api_ops.py; every metric
against a live Prometheus in tests/deploy/test_alerts.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from facecore.probe import ProbeResult
from service.app import _snapshot_periodically
from service.metrics import Metrics


def scrape(metrics: Metrics) -> dict[str, float]:
    """The samples without labels, by name, as a scrape reads them."""
    text = generate_latest(metrics.registry).decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if not s.labels}


def wait_until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "not within the timeout"
        time.sleep(0.01)


@dataclass
class Check:
    """What ``ProbeGauges`` reads of a ``RecognitionCheck``."""

    triton_ready: bool | None
    last: ProbeResult
    failures: int


def test_probe_gauges_follow_the_recognition_check() -> None:
    metrics = Metrics()
    check = Check(None, ProbeResult(False, "not checked yet", float("-inf")), 0)
    metrics.watch_probe(check)  # type: ignore[arg-type]
    found = scrape(metrics)
    assert "facerec_triton_ready" not in found, "unknown before the first probe: no sample, not a 0"
    assert found["facerec_recognition_probe_ok"] == 0
    assert found["facerec_recognition_probe_failures_total"] == 0
    check.triton_ready, check.last = True, ProbeResult(True, "1 face", 1.0)
    found = scrape(metrics)
    assert (found["facerec_triton_ready"], found["facerec_recognition_probe_ok"]) == (1, 1)
    check.triton_ready, check.last, check.failures = False, ProbeResult(False, "not ready", 2.0), 3
    found = scrape(metrics)
    assert (found["facerec_triton_ready"], found["facerec_recognition_probe_ok"]) == (0, 0)
    assert found["facerec_recognition_probe_failures_total"] == 3


def test_changelog_head_is_read_in_a_thread_until_closed() -> None:
    metrics = Metrics()
    head, applied = [4], [3]

    def read_head() -> int:
        if head[0] < 0:
            raise ConnectionError("the database went away")
        return head[0]

    metrics.watch_changelog(read_head, lambda: applied[0], interval_s=0.01)
    try:
        wait_until(lambda: scrape(metrics).get("facerec_gallery_changelog_head") == 4)
        assert scrape(metrics)["facerec_gallery_changelog_applied"] == 3
        head[0], applied[0] = 9, 9
        wait_until(lambda: scrape(metrics).get("facerec_gallery_changelog_head") == 9)
        assert scrape(metrics)["facerec_gallery_changelog_applied"] == 9
        head[0] = -1  # a failed read keeps the last head (and the thread goes on)
        time.sleep(0.05)
        assert scrape(metrics)["facerec_gallery_changelog_head"] == 9
        head[0] = 12
        wait_until(lambda: scrape(metrics).get("facerec_gallery_changelog_head") == 12)
    finally:
        metrics.close()
    head[0] = 20
    time.sleep(0.05)
    assert scrape(metrics)["facerec_gallery_changelog_head"] == 12, "the thread stopped at close"


class FlakyGallery:
    """Erasure snapshots that fail (a full disk) until ``fail`` is cleared, then write one file each."""

    def __init__(self) -> None:
        self.fail = True

    def snapshot(self) -> list[Path]:
        raise AssertionError("no full snapshot within the test's interval")

    def snapshot_erasures(self) -> list[Path]:
        if self.fail:
            raise OSError(28, "No space left on device")
        return [Path("index/1.faiss")]


def test_snapshot_passes_are_counted_written_or_failed() -> None:
    metrics, gallery = Metrics(), FlakyGallery()

    async def scenario() -> None:
        task = asyncio.create_task(_snapshot_periodically(gallery, metrics, 3600, 0.01))  # type: ignore[arg-type]
        try:
            while scrape(metrics)["facerec_gallery_snapshot_failures_total"] < 2:
                await asyncio.sleep(0.01)
            assert scrape(metrics)["facerec_gallery_snapshots_total"] == 0
            gallery.fail = False
            while scrape(metrics)["facerec_gallery_snapshots_total"] < 1:
                await asyncio.sleep(0.01)
        finally:
            task.cancel()

    asyncio.run(asyncio.wait_for(scenario(), 5))
    assert scrape(metrics)["facerec_gallery_snapshot_failures_total"] >= 2
