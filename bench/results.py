"""What one ``python -m bench`` run measured (``Results``), to and from ``results.json``, and the lookups
the report's ratios, targets and plots share."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from bench import ceiling as ceiling_part
from bench.ceiling import Layout, PhotoCeiling, StageSplit
from bench.core.load import LoadRow
from bench.latency import PairedLatency
from bench.stack import HoldCheck, MemoryRun

ONE_FACE, SIX_FACES = "obama.jpg", "t1.jpg"
TARGET_CONCURRENCY = 8
#: The concurrency the load targets look at beyond the target one, and the memory run's.
HIGH_CONCURRENCY = 16
#: The naive baselines (bench/plain.py): what face_pipeline serves (the same work as the stack, on the same
#: runtime), the same on ONNX Runtime f32, and the plain deployment of the same networks (ONNX Runtime, the
#: original float detector at fixed 640x640, SFace with PReLU).
NAIVE_SERVED, NAIVE_SERVED_ORT, NAIVE_PLAIN = "naive served", "naive served on ONNX Runtime", "naive plain"
#: Ceiling variants (bench/ceiling.py): the served runtime and ONNX Runtime f32 on the same files.
CEILING_SERVED, CEILING_ORT = "served", "onnxruntime"


@dataclass
class Results:
    """Everything one ``python -m bench`` run measured (JSON-ready through ``to_json``)."""

    command: str
    date: str
    machine: str
    settings: dict[str, Any]
    served: str = ""  # the model repository's configuration (instances, batching, threads)
    ceiling: list[PhotoCeiling] = field(default_factory=list)
    naive: list[LoadRow] = field(default_factory=list)  # the naive baseline with the served settings
    naive_plain: list[LoadRow] = field(default_factory=list)  # ... fixed 640x640, PReLU embedder
    naive_onnxruntime: list[LoadRow] = field(default_factory=list)  # the served files on ONNX Runtime f32
    plain_check: str = ""  # bench.plain: the plain embedder equals the served one (PlainModels.describe)
    stack: list[LoadRow] = field(default_factory=list)
    #: the ceiling's single image, gRPC and REST at concurrency 1, in turn (bench/latency.py)
    paired_latency: list[PairedLatency] = field(default_factory=list)
    #: REST identify at its best concurrency and at 16, alternating (bench/stack.py hold_check)
    hold: list[HoldCheck] = field(default_factory=list)
    memory: MemoryRun | None = None
    gallery: str = ""  # the gallery benchmark's Markdown tables
    enroll: str = ""
    errors: dict[str, str] = field(default_factory=dict)  # part -> why it failed
    seconds: dict[str, float] = field(default_factory=dict)  # wall time per part

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["ceiling"] = ceiling_part.to_json(self.ceiling)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Results:
        """The inverse of ``to_json`` (``results.json`` back into a ``Results``: re-render a report)."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}  # parts since removed are left out
        values["ceiling"] = [_ceiling(c) for c in data["ceiling"]]
        for name in ("naive", "naive_plain", "naive_onnxruntime", "stack"):
            values[name] = [LoadRow(**row) for row in data.get(name, [])]
        values["paired_latency"] = [PairedLatency(**row) for row in data.get("paired_latency", [])]
        values["hold"] = [HoldCheck(**row) for row in data.get("hold", [])]
        memory = data.get("memory")
        values["memory"] = MemoryRun(**{**memory, "load": LoadRow(**memory["load"])}) if memory else None
        return cls(**values)


def _ceiling(data: Mapping[str, Any]) -> PhotoCeiling:
    def sweep(values: Mapping[str, Mapping[str, float]]) -> dict[int, dict[int, float]]:
        return {int(t): {int(b): ms for b, ms in per.items()} for t, per in values.items()}

    derived = ("single_image_ms", "images_per_s", "outside_models_ms")
    values = {k: v for k, v in data.items() if k not in derived}
    return PhotoCeiling(**{**values, "input_size": tuple(data["input_size"]),
                           "detector_ms": sweep(data["detector_ms"]),
                           "embedder_ms": sweep(data["embedder_ms"]),
                           "splits": [StageSplit(**s) for s in data["splits"]],
                           "layouts": [Layout(**lay) for lay in data["layouts"]]})


# --- lookups ------------------------------------------------------------------------------------------


def find(rows: Sequence[LoadRow], target: str, photo: str, concurrency: int) -> LoadRow | None:
    return next((r for r in rows if r.target == target and r.photo == photo and r.concurrency == concurrency),
                None)


def best_naive(rows: Sequence[LoadRow], photo: str, concurrency: int | None) -> LoadRow | None:
    """The naive run with the highest throughput (at ``concurrency``, or at any)."""
    candidates = [r for r in rows
                  if r.photo == photo and (concurrency is None or r.concurrency == concurrency)]
    return max(candidates, key=lambda r: r.throughput, default=None)


def peak(rows: Sequence[LoadRow], target: str, photo: str) -> LoadRow | None:
    return max((r for r in rows if r.target == target and r.photo == photo), key=lambda r: r.throughput,
               default=None)


def served_ceiling(results: Results, photo: str) -> PhotoCeiling | None:
    return ceiling_of(results, photo, "served")


def ceiling_of(results: Results, photo: str, variant: str) -> PhotoCeiling | None:
    return next((c for c in results.ceiling if c.photo == photo and c.variant == variant), None)


def ort_ceiling(results: Results, photo: str) -> PhotoCeiling | None:
    """The ceiling on ONNX Runtime f32 with the served files and settings (the served one when the
    repository serves ONNX Runtime itself)."""
    ort = ceiling_of(results, photo, CEILING_ORT)
    served = served_ceiling(results, photo)
    return ort or (served if served and served.runtime.startswith("onnxruntime") else None)


def baselines(results: Results) -> tuple[tuple[str, list[LoadRow]], ...]:
    out = [(NAIVE_SERVED, results.naive), (NAIVE_PLAIN, results.naive_plain)]
    if results.naive_onnxruntime:
        out.insert(1, (NAIVE_SERVED_ORT, results.naive_onnxruntime))
    return tuple(out)
