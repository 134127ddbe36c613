"""What one ``python -m bench`` run measured (to and from ``runs/results.json``), and the report's lookups."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar, cast

from bench.ceiling import Layout, PhotoCeiling, StageSplit
from bench.core.load import LoadRow
from bench.latency import PairedLatency
from bench.stack import HoldCheck, MemoryRun

ONE_FACE, SIX_FACES = "obama.jpg", "t1.jpg"
PHOTOS = (ONE_FACE, SIX_FACES)
#: The concurrency the throughput targets are read at, and the high one the load targets look at.
C, HIGH_CONCURRENCY = 8, 16
#: The naive baselines as the report names them -> their rows in ``Results``.
NAIVE = {"naive served": "naive", "naive plain": "naive_plain"}
T = TypeVar("T")


@dataclass
class Results:
    command: str
    date: str
    machine: str
    settings: dict[str, Any]
    served: str = ""  # the model repository's configuration (instances, batching, threads)
    ceiling: list[PhotoCeiling] = field(default_factory=list)
    naive: list[LoadRow] = field(default_factory=list)  # the naive app serving what face_pipeline serves
    naive_plain: list[LoadRow] = field(default_factory=list)  # ... the plain way
    plain_check: str = ""  # PlainModels.describe: the plain networks are the served ones
    stack: list[LoadRow] = field(default_factory=list)
    paired_latency: list[PairedLatency] = field(default_factory=list)
    hold: list[HoldCheck] = field(default_factory=list)
    memory: MemoryRun | None = None
    gallery: str = ""  # the gallery benchmark's command and table
    enroll: str = ""
    errors: dict[str, str] = field(default_factory=dict)  # part -> why it failed
    seconds: dict[str, float] = field(default_factory=dict)  # wall time per part

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["ceiling"] = [{**asdict(c), "single_image_ms": c.single_image_ms, "images_per_s": c.images_per_s,
                           "outside_models_ms": c.best_split.outside_models_ms} for c in self.ceiling]
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Results:
        """The inverse of ``to_json``."""
        values = {**data, "ceiling": [_ceiling(c) for c in data["ceiling"]]}
        for name in ("naive", "naive_plain", "stack"):
            values[name] = [read(LoadRow, row) for row in data.get(name, [])]
        values["paired_latency"] = [read(PairedLatency, row) for row in data.get("paired_latency", [])]
        values["hold"] = [read(HoldCheck, row) for row in data.get("hold", [])]
        if memory := data.get("memory"):
            values["memory"] = read(MemoryRun, {**memory, "load": read(LoadRow, memory["load"])})
        return read(cls, values)


def read(cls: type[T], data: Mapping[str, Any]) -> T:
    """``cls`` from its record in results.json: derived figures and fields since removed are read past."""
    names = {f.name for f in fields(cast(Any, cls))}
    return cls(**{k: v for k, v in data.items() if k in names})


def _ceiling(data: Mapping[str, Any]) -> PhotoCeiling:
    def sweep(values: Mapping[str, Mapping[str, float]]) -> dict[int, dict[int, float]]:
        return {int(t): {int(b): ms for b, ms in per.items()} for t, per in values.items()}

    return read(PhotoCeiling, {
        **data, "input_size": tuple(data["input_size"]),
        "detector_ms": sweep(data["detector_ms"]), "embedder_ms": sweep(data["embedder_ms"]),
        "splits": [read(StageSplit, s) for s in data["splits"]],
        "layouts": [read(Layout, lay) for lay in data["layouts"]]})


def find(rows: Sequence[LoadRow], target: str, photo: str, concurrency: int) -> LoadRow | None:
    return next((r for r in rows if (r.target, r.photo, r.concurrency) == (target, photo, concurrency)), None)


def peak(rows: Sequence[LoadRow], target: str, photo: str) -> LoadRow | None:
    """The row of ``target`` with the highest throughput on ``photo``, at any concurrency."""
    return max((r for r in rows if (r.target, r.photo) == (target, photo)), key=lambda r: r.throughput,
               default=None)


def ceiling_of(results: Results, photo: str, variant: str = "served") -> PhotoCeiling | None:
    return next((c for c in results.ceiling if (c.photo, c.variant) == (photo, variant)), None)


def load_row(results: Results, name: str, photo: str, concurrency: int = C) -> LoadRow | None:
    """REST identify's or gRPC face_pipeline's row, or a naive baseline's best at that concurrency."""
    if name not in NAIVE:
        return find(results.stack, name, photo, concurrency)
    return max((r for r in getattr(results, NAIVE[name]) if (r.photo, r.concurrency) == (photo, concurrency)),
               key=lambda r: r.throughput, default=None)
