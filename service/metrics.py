"""Prometheus metrics of the gateway (one registry per app, so tests and replicas stay separate)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from facecore.periodic import Periodic

if TYPE_CHECKING:
    from service.admission import Admission
    from service.readiness import RecognitionCheck

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10, 30)
#: How often the database's change-log head is read for ``facerec_gallery_changelog_head``: a few times per
#: scrape (15 s), and far less often than the follower polls (it asks only whether something is new).
HEAD_INTERVAL_S = 5.0


class GallerySizes(Collector):
    """``facerec_gallery_faces{collection}``, read from the live indexes at scrape time."""

    def __init__(self, sizes: Callable[[], dict[str, int]]) -> None:
        self._sizes = sizes

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily("facerec_gallery_faces", "faces in each collection's index",
                                   labels=["collection"])
        for name, size in sorted(self._sizes().items()):
            family.add_metric([name], size)
        yield family


class GallerySelections(Collector):
    """``facerec_gallery_index_reselecting`` and ``facerec_gallery_index_reselections_total{outcome}``: the
    indexes being chosen again in the background (``Gallery.reselection_state``), read at scrape time."""

    def __init__(self, state: Callable[[], tuple[int, dict[str, int]]]) -> None:
        self._state = state

    def collect(self) -> Iterable[Metric]:
        running, finished = self._state()
        yield GaugeMetricFamily("facerec_gallery_index_reselecting",
                                "collections whose index is being chosen again in the background now",
                                value=running)
        family = CounterMetricFamily("facerec_gallery_index_reselections",
                                     "background index selections finished, by outcome (chosen: the new "
                                     "index took over; outdated: thrown away; failed: retried later)",
                                     labels=["outcome"])
        for outcome, count in sorted(finished.items()):
            family.add_metric([outcome], count)
        yield family


class TritonRestarts(Collector):
    """``facerec_triton_restarts_total{reason}``: runs of ``python -m service``'s tritonserver that the
    supervisor ended and restarted, by reason (exited, hung), read from it at scrape time."""

    def __init__(self, counts: Callable[[], dict[str, int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily("facerec_triton_restarts", "tritonserver runs restarted by the "
                                     "supervisor of python -m service, by reason (exited, hung)",
                                     labels=["reason"])
        for reason, count in sorted(self._counts().items()):
            family.add_metric([reason], count)
        yield family


class AdmissionGauges(Collector):
    """``facerec_in_flight`` and ``facerec_shed_requests_total`` of the load shedding, read at scrape time."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission

    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily("facerec_in_flight", "recognition requests in the gateway now",
                                value=self._admission.in_flight)
        yield CounterMetricFamily("facerec_shed_requests", "requests refused with 503 overloaded",
                                  value=self._admission.refused)


class ProbeGauges(Collector):
    """``facerec_triton_ready``, ``facerec_recognition_probe_ok`` and
    ``facerec_recognition_probe_failures_total``: the gateway's background recognition check
    (``service.readiness``), read at scrape time."""

    def __init__(self, check: RecognitionCheck) -> None:
        self._check = check

    def collect(self) -> Iterable[Metric]:
        check = self._check
        ready = GaugeMetricFamily("facerec_triton_ready",
                                  "1 when Triton answered that face_pipeline is ready at the gateway's last "
                                  "recognition probe, 0 when it did not (or did not answer)")
        if check.triton_ready is not None:
            ready.add_metric([], float(check.triton_ready))
        yield ready
        yield GaugeMetricFamily("facerec_recognition_probe_ok",
                                "1 when the last recognition probe (a real photo through face_pipeline) "
                                "found the face and a unit embedding, else 0", value=float(check.last.ok))
        yield CounterMetricFamily("facerec_recognition_probe_failures",
                                  "recognition probes that failed (one every few seconds while it fails)",
                                  value=check.failures)


class ChangeLogPositions(Collector):
    """``facerec_gallery_changelog_head``: the newest change in the database's change log, read by a thread of
    its own every ``HEAD_INTERVAL_S`` (a scrape never waits for the database, and a follower stuck behind a
    lock does not stop it); ``facerec_gallery_changelog_applied``: the newest change this gateway's index
    includes. ``start``/``stop`` run the thread; ``refresh`` reads the head once."""

    def __init__(self, head: Callable[[], int], applied: Callable[[], int]) -> None:
        self._read_head, self._applied = head, applied
        self.head: int | None = None
        self._reader = Periodic("changelog-head", self.refresh, "reading the change log's head failed")

    def refresh(self) -> None:
        self.head = self._read_head()

    def start(self, interval_s: float | None = None) -> None:
        self._reader.start(HEAD_INTERVAL_S if interval_s is None else interval_s)

    def stop(self) -> None:
        self._reader.stop()

    def collect(self) -> Iterable[Metric]:
        head = GaugeMetricFamily("facerec_gallery_changelog_head", "position of the newest change in the "
                                 "database's change log (face_changes.seq), as last read")
        if self.head is not None:
            head.add_metric([], self.head)
        yield head
        yield GaugeMetricFamily("facerec_gallery_changelog_applied",
                                "position of the newest change this gateway's gallery index includes",
                                value=self._applied())


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("facerec_http_requests", "HTTP requests", ["method", "route", "status"],
                                registry=self.registry)
        self.latency = Histogram("facerec_http_request_duration_seconds", "HTTP request latency",
                                 ["method", "route"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.triton_latency = Histogram("facerec_triton_request_duration_seconds",
                                        "face_pipeline gRPC call latency", buckets=LATENCY_BUCKETS,
                                        registry=self.registry)
        self.faces = Histogram("facerec_faces_per_request", "faces detected per image",
                               buckets=(0, 1, 2, 3, 5, 10, 20, 50, 100), registry=self.registry)
        self.triton_failures = Counter("facerec_triton_request_failures",
                                       "face_pipeline gRPC calls that failed or timed out",
                                       registry=self.registry)
        self.snapshots = Counter("facerec_gallery_snapshots",
                                 "gallery snapshot passes that wrote index files (the periodic full ones, "
                                 "and those soon after deletions)", registry=self.registry)
        self.snapshot_failures = Counter("facerec_gallery_snapshot_failures",
                                         "gallery snapshot passes that failed (full disk, permissions): the "
                                         "index in memory is intact, a restart replays more of the log",
                                         registry=self.registry)
        self._changelog: ChangeLogPositions | None = None

    def observe_pipeline(self, seconds: float, faces: int | None) -> None:
        """One face_pipeline call: its latency, failed or not, and its faces (None: it failed)."""
        self.triton_latency.observe(seconds)
        if faces is None:
            self.triton_failures.inc()
        else:
            self.faces.observe(faces)

    def watch_admission(self, admission: Admission) -> None:
        self.registry.register(AdmissionGauges(admission))

    def watch_gallery(self, sizes: Callable[[], dict[str, int]],
                      selections: Callable[[], tuple[int, dict[str, int]]]) -> None:
        self.registry.register(GallerySizes(sizes))
        self.registry.register(GallerySelections(selections))

    def watch_probe(self, check: RecognitionCheck) -> None:
        self.registry.register(ProbeGauges(check))

    def watch_changelog(self, head: Callable[[], int], applied: Callable[[], int],
                        interval_s: float | None = None) -> None:
        """Export the change log's head (``head()`` is read in a thread every ``interval_s``, by default
        ``HEAD_INTERVAL_S``, until ``close``) beside the position the index applied."""
        self._changelog = ChangeLogPositions(head, applied)
        self.registry.register(self._changelog)
        self._changelog.start(interval_s)

    def close(self) -> None:
        """Stop the thread ``watch_changelog`` started."""
        if self._changelog is not None:
            self._changelog.stop()
