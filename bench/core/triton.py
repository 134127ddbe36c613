"""The bundled Triton for a benchmark, started through ``service.launcher``, and its statistics."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.core.inputs import ARTIFACTS, REPOSITORY
from export.defaults import prepare_default_models
from export.profiles import Profile, ProfileTuning
from export.repository import RepositoryPlan, write_repository
from service.launcher import TritonPorts, TritonServer

TRITON_LOG = ARTIFACTS / "bench-tritonserver.log"


def bundled_triton(repository: Path = REPOSITORY, log_file: Path = TRITON_LOG) -> TritonServer:
    return TritonServer(repository, TritonPorts.free(), log_file=log_file)


@contextmanager
def served_tuning(tuning: ProfileTuning, folder: Path, log_file: Path) -> Iterator[TritonServer]:
    """A CPU model repository written for ``tuning`` into ``folder``, served for the block."""
    models = prepare_default_models(ARTIFACTS)
    repository = folder / "cpu"
    write_repository(RepositoryPlan(Profile.CPU, models.detector, models.embedder, tuning=tuning), repository,
                     models.detector_file, models.embedder_file)
    with bundled_triton(repository, log_file) as server:
        yield server


@contextmanager
def triton_url(url: str | None, repository: Path = REPOSITORY, log_file: Path = TRITON_LOG) -> Iterator[str]:
    """``url`` (a running Triton's gRPC address), or the bundled Triton started for the block."""
    if url is not None:
        yield url
        return
    with bundled_triton(repository, log_file) as server:
        yield server.grpc_url


MODELS = ("face_pipeline", "face_detector", "face_embedder")
_COMPUTE = ("compute_input", "compute_infer", "compute_output")


def model_statistics(url: str, models: Sequence[str] = MODELS) -> dict[str, dict[str, float]]:
    """Cumulative counters per model. ``request_ns`` and ``queue_ns`` add up per request (a request in a
    batch of 4 counts the whole execution); ``exec_compute_ns`` per execution: the time really computing."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    out: dict[str, dict[str, float]] = {}
    try:
        for name in models:
            stats = client.get_inference_statistics(name, as_json=True)["model_stats"][0]
            inference = stats["inference_stats"]

            def ns(section: Mapping[str, Any], key: str) -> float:
                return float(section.get(key, {}).get("ns", 0))

            out[name] = {
                "items": float(stats.get("inference_count", 0)),
                "executions": float(stats.get("execution_count", 0)),
                "requests": float(inference.get("success", {}).get("count", 0)),
                "request_ns": ns(inference, "success"),
                "queue_ns": ns(inference, "queue"),
                "exec_compute_ns": sum(ns(batch, k) for batch in stats.get("batch_stats", [])
                                       for k in _COMPUTE),
            }
    finally:
        client.close()
    return out


def statistics_delta(before: Mapping[str, Mapping[str, float]], after: Mapping[str, Mapping[str, float]]
                     ) -> dict[str, dict[str, float]]:
    """Per model over the interval: average batch, queue and request time per request, compute time per
    execution and per item; for ``face_pipeline`` in the BLS layout, its time outside the two networks
    per image (its compute time minus the networks' request times its calls waited for)."""
    d = {name: {k: after[name][k] - before[name].get(k, 0.0) for k in after[name]} for name in after}
    rows: dict[str, dict[str, float]] = {}
    for name, v in d.items():
        executions, requests, items = max(v["executions"], 1.0), max(v["requests"], 1.0), max(v["items"], 1.0)
        rows[name] = {
            "items": v["items"], "executions": v["executions"], "requests": v["requests"],
            "avg_batch": v["items"] / executions,
            "queue_ms_per_request": v["queue_ns"] / requests / 1e6,
            "request_ms": v["request_ns"] / requests / 1e6,
            "compute_ms_per_exec": v["exec_compute_ns"] / executions / 1e6,
            "compute_ms_per_item": v["exec_compute_ns"] / items / 1e6,
        }
    networks_called = {"face_detector", "face_embedder"} <= d.keys() and (
        d["face_detector"]["requests"] + d["face_embedder"]["requests"] > 0)  # not in the in_process layout
    if "face_pipeline" in d and networks_called:
        pipeline, det, emb = d["face_pipeline"], d["face_detector"], d["face_embedder"]
        images = max(pipeline["items"], 1.0)
        rows["face_pipeline"]["outside_models_ms_per_image"] = (
            pipeline["exec_compute_ns"] - det["request_ns"] - emb["request_ns"]) / images / 1e6
    return rows
