"""Serving profiles and their tuning: batching, instances, runtime, precision, layout.

``bench.tune`` measures candidates and records the best in ``export/tuning/<profile>.json``, which is
then the default that ``write_repository`` uses.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path

TUNING_DIR = Path(__file__).resolve().parent / "tuning"


class Profile(StrEnum):
    #: The tritonserver bundled in nvidia-pytriton (Python backend only): every model is a Python-backend
    #: model; the networks run in OpenVINO (or ONNX Runtime) inside them.
    CPU = "cpu"
    #: The NGC tritonserver image on a GPU: TensorRT engines.
    GPU = "gpu"
    #: The NGC tritonserver image without a GPU: a network whose checked precision is bf16 runs on Triton's
    #: native OpenVINO backend; one checked at f32 stays a Python-backend model with OpenVINO f32, because
    #: the OpenVINO backend's keys can ask for bf16 but not forbid it (OpenVINO picks bf16 by itself on CPUs
    #: that have it).
    NGC_CPU = "ngc-cpu"

    @property
    def on_cpu(self) -> bool:
        return self is not Profile.GPU


@dataclass(frozen=True)
class Batching:
    """Dynamic-batching and instance choices of one model."""

    max_batch_size: int
    preferred: tuple[int, ...]
    queue_delay_us: int
    instances: int = 1


@dataclass(frozen=True)
class ProfileTuning:
    """Serving choices of one profile. ``bench.tune`` measures candidates and records the best in
    ``export/tuning/<profile>.json``, which then is the default."""

    detector: Batching
    embedder: Batching
    pipeline: Batching
    detector_threads: int = 2  # runtime threads per instance (CPU profile)
    embedder_threads: int = 2
    #: ONNX Runtime worker threads busy-wait for work (fast hand-over, but burns shared cores).
    spinning: bool = True
    #: CPU profile: ``openvino`` or ``onnxruntime`` for the two networks.
    runtime: str = "openvino"
    #: OpenVINO inference precision per network: ``auto`` (bf16 where the CPU has it, runs it faster than
    #: f32 and the export's accuracy check accepts it, else f32), ``f32`` or ``bf16`` (not timed, still
    #: checked; refused -> f32).
    detector_precision: str = "auto"
    embedder_precision: str = "auto"
    #: CPU profile: ``bls`` (face_pipeline calls the face_detector / face_embedder models) or
    #: ``in_process`` (face_pipeline runs both networks itself; the two models stay for re-embedding).
    layout: str = "bls"
    #: ``in_process`` layout: threads per network for a request met while no other face_pipeline instance
    #: is working (each network is then compiled twice: this many threads, capped at the usable CPUs, and
    #: its own count for calls side by side); 0: always the network's own count.
    solo_threads: int = 0
    #: CPU profile: the embedder runs a batch as calls of at most this many faces, split evenly, on the
    #: copies that run side by side (one thread each); 0: one call. A few faces at a time stay in a core's
    #: cache (``facecore.runtimes.RuntimeChoice.sub_batch``); a lone request's two-thread copy runs whole.
    embedder_sub_batch: int = 0
    #: face_pipeline parameters (PipelineSettings fields as strings), e.g. {"decode_min_side": "1280"}.
    pipeline_options: dict[str, str] = field(default_factory=dict)

    @staticmethod
    def builtin(profile: Profile) -> ProfileTuning:
        """Starting points before any measurement; ``export/tuning/<profile>.json``, when present, wins."""
        if profile is Profile.CPU:
            return ProfileTuning(
                detector=Batching(8, (4, 8), 1000),
                embedder=Batching(64, (16, 32, 64), 1000),
                pipeline=Batching(8, (4, 8), 2000),
                # JPEGs at least twice the detector input are decoded at 1/2, 1/4 or 1/8 scale; OpenCV's own
                # loops run on one thread in each instance (the instances already share the cores).
                pipeline_options={"decode_min_side": "640", "opencv_threads": "1"},
            )
        # GPU: larger batches amortize kernel launches. face_pipeline's Python work (decode, letterbox,
        # NMS, alignment) bounds this profile: the image's entrypoint sets its instance count from the
        # host's CPUs at start (deploy/triton/entrypoint.py; 2 is what a repository says elsewhere), and
        # big JPEGs are decoded at reduced size, as in the CPU profile (docs/gpu-plan.md). One instance per
        # CPU: OpenCV's own loops get one thread each, not a pool as large as the host in every instance.
        return ProfileTuning(
            detector=Batching(16, (8, 16), 500),
            embedder=Batching(128, (32, 64, 128), 500),
            pipeline=Batching(16, (8, 16), 1000, instances=2),
            pipeline_options={"decode_min_side": "640", "opencv_threads": "1"},
        )

    @staticmethod
    def default(profile: Profile) -> ProfileTuning:
        """The recorded tuning of this profile when there is one, else the built-in choice."""
        measured = Profile.CPU if profile.on_cpu else profile  # both CPU profiles share the CPU's tuning
        recorded = TUNING_DIR / f"{measured.value}.json"
        if recorded.exists():
            return ProfileTuning.from_json(recorded.read_text())
        return ProfileTuning.builtin(measured)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @staticmethod
    def from_json(text: str) -> ProfileTuning:
        data = json.loads(text)
        data.pop("note", None)
        batching = {k: Batching(v["max_batch_size"], tuple(v["preferred"]), v["queue_delay_us"],
                                v["instances"])
                    for k, v in data.items() if k in ("detector", "embedder", "pipeline")}
        return ProfileTuning(**{**data, **batching})
