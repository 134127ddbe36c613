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
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import onnx
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from export.onnx_tools import save_checked, split_output_weights, uint8_nhwc_input
from export.precision import PrecisionCheck, choose_precisions
from export.profiles import Batching, Profile, ProfileTuning
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
from facecore.runtimes import Runtime, RuntimeChoice
from facecore.spec import InputLayout, ModelSpec

log = logging.getLogger(__name__)

SOURCES = Path(__file__).resolve().parent.parent / "model_repository"
#: face_pipeline's queue is bounded: beyond it Triton refuses at once and gateways answer 503 overloaded
#: (each gateway also sheds beyond FACEREC_LIMITS__MAX_IN_FLIGHT).
PIPELINE_MAX_QUEUE = 64


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


def _input_tensor(spec: ModelSpec, fixed: bool) -> tuple[int, list[int], list[int]]:
    """(data type, config dims, warm-up dims) of a network's input, by its layout."""
    width, height = spec.input_size
    if spec.input_layout is InputLayout.NHWC_UINT8:
        return mc.TYPE_UINT8, ([height, width, 3] if fixed else [-1, -1, 3]), [height, width, 3]
    return mc.TYPE_FP32, ([3, height, width] if fixed else [3, -1, -1]), [3, height, width]


def native_openvino(plan: RepositoryPlan, runtime: dict[str, str]) -> bool:
    """The NGC CPU profile puts a network on the native OpenVINO backend when bf16 was checked for it."""
    return plan.profile is Profile.NGC_CPU and runtime.get("precision") == "bf16"


def _openvino_backend(config: mc.ModelConfig, runtime: dict[str, str]) -> dict[str, str]:
    """The network as a native OpenVINO-backend model: the same ONNX file, one stream, latency hint."""
    config.backend = "openvino"
    config.default_model_filename = "model.onnx"
    return {"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": "1", "HINT_BF16": "YES",
            "INFERENCE_NUM_THREADS": runtime["intra_op_threads"], "precision": runtime["precision"],
            "precision_check": runtime.get("precision_check", "")}


def _network_config(name: str, spec: ModelSpec, plan: RepositoryPlan, batching: Batching,
                    runtime: dict[str, str]) -> mc.ModelConfig:
    gpu = plan.profile is Profile.GPU
    kind = mc.ModelInstanceGroup.KIND_GPU if gpu else mc.ModelInstanceGroup.KIND_CPU
    config = _base_config(name, batching, kind)
    if gpu:
        config.platform = "tensorrt_plan"
    elif native_openvino(plan, runtime):
        runtime = _openvino_backend(config, runtime)
    else:
        config.backend = "python"
    data_type, input_dims, warmup_dims = _input_tensor(spec, gpu or spec.role == "embedder")
    config.input.add(name=spec.input_name, data_type=data_type, dims=input_dims)
    if spec.role == "detector":
        for output, last in zip(spec.output_names, (4, 2, 10), strict=True):
            config.output.add(name=output, data_type=mc.TYPE_FP32, dims=[-1, last])
    else:
        config.output.add(name=spec.output_names[0], data_type=mc.TYPE_FP32, dims=[spec.embedding_dim])
    warmup = config.model_warmup.add(name=f"{name}_warmup", batch_size=1)
    warmup.inputs[spec.input_name].data_type = data_type
    warmup.inputs[spec.input_name].dims.extend(warmup_dims)
    warmup.inputs[spec.input_name].random_data = True
    params = {"architecture": spec.architecture, "model_name": spec.name, "license": spec.license,
              "source": spec.source, "spec": json.dumps(asdict(spec))}
    _set_parameters(config, params if gpu else params | runtime)
    return config


def _config_type(tensor: TensorSpec) -> int:
    return int(mc.DataType.Value(tensor.dtype.config_name))


def _pipeline_config(plan: RepositoryPlan, settings: PipelineSettings) -> mc.ModelConfig:
    config = _base_config(PIPELINE_MODEL, plan.effective_tuning.pipeline, mc.ModelInstanceGroup.KIND_CPU)
    config.backend = "python"
    config.dynamic_batching.default_queue_policy.max_queue_size = PIPELINE_MAX_QUEUE
    config.dynamic_batching.default_queue_policy.timeout_action = mc.ModelQueuePolicy.REJECT
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


class IncompatibleVersion(ValueError):
    """A new version with other tensors than the versions already served beside it."""


def _check_compatible(model_dir: Path, config: mc.ModelConfig) -> None:
    """A new version must keep the tensors of the versions already served beside it."""
    existing_file = model_dir / "config.pbtxt"
    if not existing_file.exists():
        return
    existing = text_format.Parse(existing_file.read_text(), mc.ModelConfig())
    if list(existing.input) != list(config.input) or list(existing.output) != list(config.output):
        raise IncompatibleVersion(
            f"{model_dir.name}: the new model's inputs/outputs differ from the versions already in "
            f"{model_dir}; a model with other conventions needs a new repository (--out) "
            "or a gallery re-embed"
        )


def _runtime_parameters(plan: RepositoryPlan, role: str, precision: PrecisionCheck | None) -> dict[str, str]:
    """The CPU runtime of one network as config parameters (what onnx_model/model.py reads)."""
    tuning = plan.effective_tuning
    threads = tuning.detector_threads if role == "detector" else tuning.embedder_threads
    runtime = Runtime.OPENVINO.value if plan.profile is Profile.NGC_CPU else tuning.runtime
    params = {"onnx_file": "model.onnx", "runtime": runtime, "intra_op_threads": str(threads),
              "intra_op_spinning": str(tuning.spinning).lower(), "precision": "f32"}
    if precision is not None:
        params |= {"precision": precision.precision, "precision_check": precision.summary()}
    if role == "embedder" and plan.profile is Profile.CPU and tuning.embedder_sub_batch > 0:
        params["sub_batch"] = str(tuning.embedder_sub_batch)
    return params


def _in_process_parameters(detector: mc.ModelConfig, embedder: mc.ModelConfig, solo_threads: int
                           ) -> dict[str, str]:
    """face_pipeline's parameters for running the two networks itself, as their own configs say, and the
    threads a network gets for a request met while no other instance works (``solo_threads``)."""
    params = {"layout": "in_process", "solo_threads": str(solo_threads)}
    for role, config in (("detector", detector), ("embedder", embedder)):
        values = config.parameters
        params |= {f"{role}_runtime": values["runtime"].string_value,
                   f"{role}_precision": values["precision"].string_value,
                   f"{role}_threads": values["intra_op_threads"].string_value,
                   f"{role}_sub_batch": values["sub_batch"].string_value if "sub_batch" in values else "0",
                   "intra_op_spinning": values["intra_op_spinning"].string_value}
    return params


def served_detector(spec: ModelSpec, source: Path, target: Path, bf16_pairs: bool = False) -> ModelSpec:
    """Write the detector as served — uint8 NHWC input, the normalization inside the graph — to ``target``
    and return its description (a detector that already takes uint8 is copied as it is). ``bf16_pairs``
    (the CPU profiles, where OpenVINO may run it in bf16): its output layers' weights as bfloat16 pairs
    (``export.onnx_tools.split_output_weights``), which the precision check then judges."""
    if spec.input_layout is InputLayout.NHWC_UINT8 and not bf16_pairs:
        shutil.copyfile(source, target)
        return spec
    model = onnx.load(str(source))
    if spec.input_layout is not InputLayout.NHWC_UINT8:
        model = uint8_nhwc_input(model, spec.input_name, spec.swap_rb, spec.mean, spec.std)
    if bf16_pairs:
        model, split = split_output_weights(model)
        log.info("detector: %d output layer(s) carry their weights as bfloat16 pairs", split)
    save_checked(model, target)
    return replace(spec, input_layout=InputLayout.NHWC_UINT8)


def write_repository(plan: RepositoryPlan, out: Path, detector_file: Path, embedder_file: Path) -> Path:
    """Write (or add version ``plan.version`` to) the repository at ``out``; returns ``out``.

    CPU profile with OpenVINO: each network's precision is chosen by ``export.precision`` (checked
    against fp32 ONNX Runtime on the test photos) and recorded in its config parameters."""
    tuning = plan.effective_tuning
    with tempfile.TemporaryDirectory() as staging:
        served_file = Path(staging) / "detector.onnx"
        detector = served_detector(plan.detector, detector_file, served_file,
                                   bf16_pairs=plan.profile.on_cpu)
        checks: dict[str, PrecisionCheck] = {}
        if plan.profile is Profile.NGC_CPU or (plan.profile is Profile.CPU
                                                and tuning.runtime == Runtime.OPENVINO):
            reference = (plan.detector, detector_file, plan.embedder, embedder_file)
            choice = RuntimeChoice(Runtime.OPENVINO, "f32", tuning.detector_threads)
            decode_min_side = int(tuning.pipeline_options.get("decode_min_side", "0"))
            checks = choose_precisions(reference, served_file, detector, choice, tuning.detector_precision,
                                       tuning.embedder_precision, decode_min_side)
        base = PipelineSettings(
            detector=replace(detector, onnx=""), embedder=replace(plan.embedder, onnx=""),
            detector_max_batch=tuning.detector.max_batch_size,
            embedder_max_batch=tuning.embedder.max_batch_size,
            # TensorRT engines are built for one detector size; the CPU runtimes take any size.
            dynamic_input=plan.profile.on_cpu,
        )
        options = {**tuning.pipeline_options, **{k: str(v) for k, v in plan.pipeline_overrides.items()}}
        settings = PipelineSettings.from_parameters({**base.to_parameters(), **options})
        models = {
            DETECTOR_MODEL: (_network_config(DETECTOR_MODEL, settings.detector, plan, tuning.detector,
                                             _runtime_parameters(plan, "detector", checks.get("detector"))),
                             served_file),
            EMBEDDER_MODEL: (_network_config(EMBEDDER_MODEL, settings.embedder, plan, tuning.embedder,
                                             _runtime_parameters(plan, "embedder", checks.get("embedder"))),
                             embedder_file),
            PIPELINE_MODEL: (_pipeline_config(plan, settings), None),
        }
        in_process = plan.profile is Profile.CPU and tuning.layout == "in_process"
        if in_process:  # face_pipeline runs both networks itself (the models stay, for re-embedding)
            _set_parameters(models[PIPELINE_MODEL][0], _in_process_parameters(
                models[DETECTOR_MODEL][0], models[EMBEDDER_MODEL][0], tuning.solo_threads))
        for name, (config, _) in models.items():
            _check_compatible(out / name, config)
        for name, (config, onnx_file) in models.items():
            version_dir = out / name / str(plan.version)
            version_dir.mkdir(parents=True, exist_ok=True)
            if onnx_file is not None:
                shutil.copyfile(onnx_file, version_dir / "model.onnx")
                if config.backend == "python":
                    shutil.copyfile(SOURCES / "onnx_model" / "model.py", version_dir / "model.py")
                else:
                    (version_dir / "model.py").unlink(missing_ok=True)
            else:
                shutil.copyfile(SOURCES / "face_pipeline" / "model.py", version_dir / "model.py")
                for role, network in (("detector", served_file), ("embedder", embedder_file)):
                    target = version_dir / f"{role}.onnx"
                    if in_process:
                        shutil.copyfile(network, target)
                    else:
                        target.unlink(missing_ok=True)
            _write_config(out / name, config)
    write_probe_image(out)  # the readiness probe's photo (facecore.probe)
    for check in checks.values():
        log.info("%s", check.summary())
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
