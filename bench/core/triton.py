"""The bundled Triton for a benchmark, started through ``service.launcher``, and its statistics."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

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
    """Cumulative counters per model: items, successful requests, ``request_ns`` (summed per request: a
    request in a batch of 4 counts the whole execution) and ``exec_compute_ns`` (per execution: the time
    really computing)."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    out: dict[str, dict[str, float]] = {}
    try:
        for name in models:
            stats = client.get_inference_statistics(name, as_json=True)["model_stats"][0]
            success = stats["inference_stats"].get("success", {})
            out[name] = {
                "items": float(stats.get("inference_count", 0)),
                "requests": float(success.get("count", 0)),
                "request_ns": float(success.get("ns", 0)),
                "exec_compute_ns": sum(float(batch.get(k, {}).get("ns", 0))
                                       for batch in stats.get("batch_stats", []) for k in _COMPUTE),
            }
    finally:
        client.close()
    return out


def statistics_delta(before: Mapping[str, Mapping[str, float]], after: Mapping[str, Mapping[str, float]]
                     ) -> dict[str, dict[str, float]]:
    """Each model's counters over the interval; for ``face_pipeline`` in the BLS layout also its time
    outside the two networks per image: its compute time minus the networks' request times its calls
    waited for. In the in_process layout the two models are never called: no split then."""
    d = {name: {k: after[name][k] - before[name].get(k, 0.0) for k in after[name]} for name in after}
    det, emb = d.get("face_detector"), d.get("face_embedder")
    if "face_pipeline" in d and det and emb and det["requests"] + emb["requests"] > 0:
        pipeline = d["face_pipeline"]
        outside_ns = pipeline["exec_compute_ns"] - det["request_ns"] - emb["request_ns"]
        pipeline["outside_models_ms_per_image"] = outside_ns / max(pipeline["items"], 1.0) / 1e6
    return d
