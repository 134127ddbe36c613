"""Model repositories written by ``export``: both profiles' configs, versions, roll-out and roll-back."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from export.__main__ import main as export_main
from export.defaults import DefaultModels
from export.profiles import Profile, ProfileTuning
from export.repository import RepositoryPlan, pin_version, write_repository
from facecore.client import PipelineClient
from facecore.pipeline import PipelineSettings
from facecore.triton_config import parameters
from service.launcher import TritonPorts, TritonServer
from tests.conftest import free_ports

MODELS = ("face_detector", "face_embedder", "face_pipeline")


def read_config(repository: Path, model: str) -> mc.ModelConfig:
    return text_format.Parse((repository / model / "config.pbtxt").read_text(), mc.ModelConfig())


def write(profile: Profile, models: DefaultModels, out: Path, version: int = 1) -> Path:
    plan = RepositoryPlan(profile, models.detector, models.embedder, version=version)
    return write_repository(plan, out, models.detector_file, models.embedder_file)


def test_cpu_profile(cpu_repository: Path) -> None:
    for name in MODELS:
        config = read_config(cpu_repository, name)
        assert config.backend == "python" and config.max_batch_size > 0
        assert config.HasField("dynamic_batching") and config.dynamic_batching.preferred_batch_size
        tuned = ProfileTuning.default(Profile.CPU)
        batching = {"face_detector": tuned.detector, "face_embedder": tuned.embedder,
                    "face_pipeline": tuned.pipeline}[name]
        assert config.dynamic_batching.max_queue_delay_microseconds == batching.queue_delay_us
        assert config.instance_group[0].count == batching.instances
        assert config.instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU
        assert config.version_policy.latest.num_versions == 1
        assert (cpu_repository / name / "1" / "model.py").is_file()
    detector = read_config(cpu_repository, "face_detector")
    assert detector.parameters["intra_op_spinning"].string_value in ("true", "false")
    # uint8 NHWC BGR in, the normalization inside the graph (export), any size
    assert list(detector.input[0].dims) == [-1, -1, 3] and detector.input[0].data_type == mc.TYPE_UINT8
    assert detector.parameters["runtime"].string_value == ProfileTuning.default(Profile.CPU).runtime
    assert detector.parameters["precision"].string_value in ("f32", "bf16")
    assert "MobileNet-0.25" in detector.parameters["architecture"].string_value
    assert detector.model_warmup[0].inputs["input"].random_data
    embedder = read_config(cpu_repository, "face_embedder")
    assert "SFace" in embedder.parameters["architecture"].string_value
    assert list(embedder.output[0].dims) == [128]
    pipeline = read_config(cpu_repository, "face_pipeline")
    settings = PipelineSettings.from_parameters({k: v.string_value for k, v in pipeline.parameters.items()})
    assert settings.embedder.embedding_dim == 128 and settings.detector.input_size == (640, 640)
    assert {i.name for i in pipeline.input if i.optional} == {"SCORE_THRESHOLD", "MAX_FACES", "MIN_FACE_SIZE",
                                                               "RETURN_CROPS"}


def test_gpu_profile(default_models: DefaultModels, tmp_path: Path) -> None:
    repository = write(Profile.GPU, default_models, tmp_path / "gpu")
    for name in ("face_detector", "face_embedder"):
        config = read_config(repository, name)
        assert config.platform == "tensorrt_plan" and not config.backend
        assert config.instance_group[0].kind == mc.ModelInstanceGroup.KIND_GPU
        assert (repository / name / "1" / "model.onnx").is_file()
        assert not (repository / name / "1" / "model.py").exists()
    assert list(read_config(repository, "face_detector").input[0].dims) == [640, 640, 3]
    pipeline = read_config(repository, "face_pipeline")
    assert pipeline.backend == "python" and pipeline.instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU
    strings = {k: {"string_value": v.string_value} for k, v in pipeline.parameters.items()}
    assert parameters({"parameters": strings})


def test_a_model_with_other_tensors_cannot_be_added_as_a_version(
    default_models: DefaultModels, tmp_path: Path
) -> None:
    repository = write(Profile.CPU, default_models, tmp_path / "cpu")
    wider = replace(default_models.embedder, embedding_dim=512)
    plan = RepositoryPlan(Profile.CPU, default_models.detector, wider, version=2)
    with pytest.raises(ValueError, match="differ"):
        write_repository(plan, repository, default_models.detector_file, default_models.embedder_file)
    assert not (repository / "face_embedder" / "2").exists()


def test_pin_refuses_a_missing_version(default_models: DefaultModels, tmp_path: Path) -> None:
    repository = write(Profile.CPU, default_models, tmp_path / "cpu")
    with pytest.raises(ValueError, match="no version 7"):
        pin_version(repository, "face_embedder", 7)
    assert export_main(["pin", "--repository", str(repository), "--model", "nope", "--latest"]) == 1


@pytest.mark.triton
def test_roll_out_and_roll_back_on_a_live_server(
    default_models: DefaultModels, tmp_path: Path, photo_bytes: dict[str, bytes]
) -> None:
    repository = write(Profile.CPU, default_models, tmp_path / "cpu")
    server = TritonServer(
        repository, TritonPorts(*free_ports(3)), explicit=True, log_file=tmp_path / "triton.log"
    )
    with server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        pipeline = PipelineClient(server.grpc_url)
        assert client.is_model_ready("face_embedder", "1")

        write(Profile.CPU, default_models, repository, version=2)  # roll out version 2
        client.load_model("face_embedder")
        assert client.is_model_ready("face_embedder", "2") and not client.is_model_ready("face_embedder", "1")
        assert len(pipeline.infer(photo_bytes["obama.jpg"])) == 1

        assert export_main(["pin", "--repository", str(repository), "--model", "face_embedder",
                            "--version", "1"]) == 0  # roll back
        client.load_model("face_embedder")
        assert client.is_model_ready("face_embedder", "1") and not client.is_model_ready("face_embedder", "2")
        assert len(pipeline.infer(photo_bytes["obama.jpg"])) == 1

        pin_version(repository, "face_embedder", None)  # latest again
        client.load_model("face_embedder")
        assert client.is_model_ready("face_embedder", "2")
        pipeline.close()


def test_tuning_round_trips_through_json() -> None:
    tuning = ProfileTuning.default(Profile.CPU)
    assert ProfileTuning.from_json(tuning.to_json()) == tuning
    gpu = ProfileTuning.builtin(Profile.GPU)
    assert ProfileTuning.from_json(gpu.to_json()) == gpu


def test_the_embedder_sub_batch_reaches_both_places_the_embedder_runs(default_models: DefaultModels,
                                                                      tmp_path: Path) -> None:
    """``embedder_sub_batch`` is written for face_embedder (BLS layout, re-embedding) and for face_pipeline's
    own copy (in_process layout); the detector keeps whole batches, and 0 writes nothing for face_embedder."""
    tuning = replace(ProfileTuning.default(Profile.CPU), layout="in_process", embedder_sub_batch=3)
    plan = RepositoryPlan(Profile.CPU, default_models.detector, default_models.embedder, tuning=tuning)
    repository = write_repository(plan, tmp_path / "cpu", default_models.detector_file,
                                  default_models.embedder_file)
    assert read_config(repository, "face_embedder").parameters["sub_batch"].string_value == "3"
    assert "sub_batch" not in read_config(repository, "face_detector").parameters
    pipeline = read_config(repository, "face_pipeline").parameters
    sub_batches = (pipeline["embedder_sub_batch"].string_value, pipeline["detector_sub_batch"].string_value)
    assert sub_batches == ("3", "0")
    whole = replace(plan, tuning=replace(tuning, embedder_sub_batch=0))
    repository = write_repository(whole, tmp_path / "whole", default_models.detector_file,
                                  default_models.embedder_file)
    assert "sub_batch" not in read_config(repository, "face_embedder").parameters
    assert read_config(repository, "face_pipeline").parameters["embedder_sub_batch"].string_value == "0"


#: Triton's OpenVINO backend: the parameter keys its README documents (and its source reads).
OPENVINO_BACKEND_KEYS = {"PERFORMANCE_HINT", "NUM_STREAMS", "INFERENCE_NUM_THREADS", "HINT_BF16",
                         "COMPILATION_NUM_THREADS", "CPU_EXTENSION_PATH", "SKIP_OV_DYNAMIC_BATCHSIZE",
                         "ENABLE_BATCH_PADDING", "RESHAPE_IO_LAYERS", "TARGET_DEVICE"}


def test_ngc_cpu_profile_puts_bf16_networks_on_the_native_openvino_backend(
    default_models: DefaultModels, tmp_path: Path
) -> None:
    """The NGC image without a GPU: a network checked at bf16 on the OpenVINO backend (only documented keys,
    HINT_BF16 YES); one checked at f32 a Python-backend model with OpenVINO f32, since the backend's keys
    cannot forbid bf16."""
    repository = write(Profile.NGC_CPU, default_models, tmp_path / "ngc-cpu")
    for name in ("face_detector", "face_embedder"):
        config = read_config(repository, name)
        params = {k: v.string_value for k, v in config.parameters.items()}
        assert config.instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU
        assert (repository / name / "1" / "model.onnx").is_file()
        if params["precision"] == "bf16":
            assert config.backend == "openvino" and config.default_model_filename == "model.onnx"
            assert {k for k in params if k.isupper()} <= OPENVINO_BACKEND_KEYS
            assert params["HINT_BF16"] == "YES" and params["NUM_STREAMS"] == "1"
            assert not (repository / name / "1" / "model.py").exists()
        else:
            assert config.backend == "python" and params["runtime"] == "openvino"
            assert (repository / name / "1" / "model.py").is_file()
    detector = read_config(repository, "face_detector")
    assert list(detector.input[0].dims) == [-1, -1, 3]  # sized to each image, as on the bundled server
    precisions = {n: read_config(repository, n).parameters["precision"].string_value
                  for n in ("face_detector", "face_embedder")}
    cpu = write(Profile.CPU, default_models, tmp_path / "cpu")
    assert precisions == {n: read_config(cpu, n).parameters["precision"].string_value
                          for n in ("face_detector", "face_embedder")}, "the same checked precisions"
