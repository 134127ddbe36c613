"""Write a Triton model repository for one profile.

``cpu``: every model is a Python-backend model (the bundled tritonserver has no other backend);
``face_detector`` and ``face_embedder`` run their ONNX file with ONNX Runtime.
``gpu``: ``face_detector`` and ``face_embedder`` are ``tensorrt_plan`` models on ``KIND_GPU`` for the
NGC ``tritonserver:<yy.mm>-py3`` image; the engine (``model.plan``) is built on the target GPU from
the ``model.onnx`` placed beside it (``python -m export tensorrt``).
In both, ``face_pipeline`` is the Python-backend BLS orchestrator.

Versions: each call writes version ``N`` of every model and leaves other versions alone; the
``version_policy`` serves the latest unless a model is pinned (``python -m export pin``).
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from facecore.contract import (
    DETECTOR_MODEL,
    EMBEDDER_MODEL,
    PIPELINE_MODEL,
    TensorSpec,
    pipeline_inputs,
    pipeline_outputs,
)
from facecore.pipeline import PipelineSettings
from facecore.probe import write_probe_image
from facecore.spec import ModelSpec

log = logging.getLogger(__name__)

SOURCES = Path(__file__).resolve().parent.parent / "model_repository"


class Profile(StrEnum):
    CPU = "cpu"
    GPU = "gpu"


@dataclass(frozen=True)
class Batching:
    """Dynamic-batching and instance choices of one model."""

    max_batch_size: int
    preferred: tuple[int, ...]
    queue_delay_us: int
    instances: int = 1


TUNING_DIR = Path(__file__).resolve().parent / "tuning"


@dataclass(frozen=True)
class ProfileTuning:
    """Serving choices of one profile. ``bench.tune`` measures candidates and records the best in
    ``export/tuning/<profile>.json``, which then is the default."""

    detector: Batching
    embedder: Batching
    pipeline: Batching
    detector_threads: int = 2  # ONNX Runtime intra-op threads (CPU profile)
    embedder_threads: int = 2
    #: ONNX Runtime worker threads busy-wait for work (fast hand-over, but burns shared cores).
    spinning: bool = True
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
            )
        # GPU: larger batches amortize kernel launches; two BLS instances keep the GPU fed.
        return ProfileTuning(
            detector=Batching(16, (8, 16), 500),
            embedder=Batching(128, (32, 64, 128), 500),
            pipeline=Batching(16, (8, 16), 1000, instances=2),
        )

    @staticmethod
    def default(profile: Profile) -> ProfileTuning:
        """The recorded tuning of this profile when there is one, else the built-in choice."""
        recorded = TUNING_DIR / f"{profile.value}.json"
        if recorded.exists():
            return ProfileTuning.from_json(recorded.read_text())
        return ProfileTuning.builtin(profile)

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


@dataclass(frozen=True)
class RepositoryPlan:
    profile: Profile
    detector: ModelSpec
    embedder: ModelSpec
    version: int = 1
    tuning: ProfileTuning | None = None
    pipeline_overrides: dict[str, object] = field(default_factory=dict)

    @property
    def effective_tuning(self) -> ProfileTuning:
        return self.tuning or ProfileTuning.default(self.profile)


def _base_config(name: str, batching: Batching, kind: int) -> mc.ModelConfig:
    config = mc.ModelConfig(name=name, max_batch_size=batching.max_batch_size)
    config.dynamic_batching.preferred_batch_size.extend(batching.preferred)
    config.dynamic_batching.max_queue_delay_microseconds = batching.queue_delay_us
    config.instance_group.add(count=batching.instances, kind=kind)
    config.version_policy.latest.num_versions = 1
    return config


def _set_parameters(config: mc.ModelConfig, values: dict[str, str]) -> None:
    for key, value in values.items():
        config.parameters[key].string_value = value


def _network_config(name: str, spec: ModelSpec, plan: RepositoryPlan, batching: Batching) -> mc.ModelConfig:
    gpu = plan.profile is Profile.GPU
    kind = mc.ModelInstanceGroup.KIND_GPU if gpu else mc.ModelInstanceGroup.KIND_CPU
    config = _base_config(name, batching, kind)
    if gpu:
        config.platform = "tensorrt_plan"
    else:
        config.backend = "python"
    width, height = spec.input_size
    fixed = gpu or spec.role == "embedder"
    input_dims = [3, height, width] if fixed else [3, -1, -1]
    config.input.add(name=spec.input_name, data_type=mc.TYPE_FP32, dims=input_dims)
    if spec.role == "detector":
        for output, last in zip(spec.output_names, (4, 2, 10), strict=True):
            config.output.add(name=output, data_type=mc.TYPE_FP32, dims=[-1, last])
    else:
        config.output.add(name=spec.output_names[0], data_type=mc.TYPE_FP32, dims=[spec.embedding_dim])
    warmup = config.model_warmup.add(name=f"{name}_warmup", batch_size=1)
    warmup.inputs[spec.input_name].data_type = mc.TYPE_FP32
    warmup.inputs[spec.input_name].dims.extend([3, height, width])
    warmup.inputs[spec.input_name].random_data = True
    params = {"architecture": spec.architecture, "model_name": spec.name, "license": spec.license,
              "source": spec.source, "spec": json.dumps(asdict(spec))}
    if not gpu:
        tuning = plan.effective_tuning
        threads = tuning.detector_threads if spec.role == "detector" else tuning.embedder_threads
        params |= {"onnx_file": "model.onnx", "intra_op_threads": str(threads),
                   "intra_op_spinning": str(tuning.spinning).lower()}
    _set_parameters(config, params)
    return config


def _config_type(tensor: TensorSpec) -> int:
    return int(mc.DataType.Value(tensor.dtype.config_name))


def _pipeline_config(plan: RepositoryPlan, settings: PipelineSettings) -> mc.ModelConfig:
    config = _base_config(PIPELINE_MODEL, plan.effective_tuning.pipeline, mc.ModelInstanceGroup.KIND_CPU)
    config.backend = "python"
    for tensor in pipeline_inputs():
        config.input.add(name=tensor.name, data_type=_config_type(tensor), dims=tensor.dims,
                         optional=tensor.optional)
    crop = settings.embedder.input_size[0]
    for tensor in pipeline_outputs(settings.embedder.embedding_dim, crop):
        config.output.add(name=tensor.name, data_type=_config_type(tensor), dims=tensor.dims)
    # No model_warmup here: BLS calls are refused while the server is still loading models
    # ("Server not ready"). The networks warm up themselves; initialize() warms the Python side.
    _set_parameters(config, settings.to_parameters())
    return config


def _write_config(model_dir: Path, config: mc.ModelConfig) -> None:
    model_dir.mkdir(parents=True, exist_ok=True)
    text = text_format.MessageToString(config)
    header = "# Written by `python -m export`; edit the tuning there.\n"
    (model_dir / "config.pbtxt").write_text(f"{header}{text}")


def _check_compatible(model_dir: Path, config: mc.ModelConfig) -> None:
    """A new version must keep the tensors of the versions already served beside it."""
    existing_file = model_dir / "config.pbtxt"
    if not existing_file.exists():
        return
    existing = text_format.Parse(existing_file.read_text(), mc.ModelConfig())
    if list(existing.input) != list(config.input) or list(existing.output) != list(config.output):
        raise ValueError(
            f"{model_dir.name}: the new model's inputs/outputs differ from the versions already in "
            f"{model_dir}; a model with other conventions needs a new repository (--out) "
            "or a gallery re-embed"
        )


def write_repository(plan: RepositoryPlan, out: Path, detector_file: Path, embedder_file: Path) -> Path:
    """Write (or add version ``plan.version`` to) the repository at ``out``; returns ``out``."""
    tuning = plan.effective_tuning
    base = PipelineSettings(
        detector=replace(plan.detector, onnx=""), embedder=replace(plan.embedder, onnx=""),
        detector_max_batch=tuning.detector.max_batch_size, embedder_max_batch=tuning.embedder.max_batch_size,
        # TensorRT engines are built for one detector size; ONNX Runtime takes any size.
        dynamic_input=plan.profile is Profile.CPU,
    )
    options = {**tuning.pipeline_options, **{k: str(v) for k, v in plan.pipeline_overrides.items()}}
    settings = PipelineSettings.from_parameters({**base.to_parameters(), **options})
    models = {
        DETECTOR_MODEL: (_network_config(DETECTOR_MODEL, settings.detector, plan, tuning.detector),
                         detector_file),
        EMBEDDER_MODEL: (_network_config(EMBEDDER_MODEL, settings.embedder, plan, tuning.embedder),
                         embedder_file),
        PIPELINE_MODEL: (_pipeline_config(plan, settings), None),
    }
    for name, (config, _) in models.items():
        _check_compatible(out / name, config)
    for name, (config, onnx_file) in models.items():
        version_dir = out / name / str(plan.version)
        version_dir.mkdir(parents=True, exist_ok=True)
        if onnx_file is not None:
            shutil.copyfile(onnx_file, version_dir / "model.onnx")
            if plan.profile is Profile.CPU:
                shutil.copyfile(SOURCES / "onnx_model" / "model.py", version_dir / "model.py")
        else:
            shutil.copyfile(SOURCES / "face_pipeline" / "model.py", version_dir / "model.py")
        _write_config(out / name, config)
    write_probe_image(out)  # the readiness probe's photo (facecore.probe)
    log.info("wrote %s repository version %d to %s", plan.profile, plan.version, out)
    return out


def pin_version(out: Path, model: str, version: int | None) -> None:
    """Serve only ``version`` of ``model`` (roll back), or the latest again when ``version`` is None."""
    config_file = out / model / "config.pbtxt"
    if not config_file.exists():
        raise FileNotFoundError(f"no model {model!r} in {out}")
    config = text_format.Parse(config_file.read_text(), mc.ModelConfig())
    if version is not None and not (out / model / str(version)).is_dir():
        raise ValueError(f"{model} has no version {version} in {out}")
    config.ClearField("version_policy")
    if version is None:
        config.version_policy.latest.num_versions = 1
    else:
        config.version_policy.specific.versions.append(version)
    _write_config(out / model, config)
