"""The GPU deployment: Triton healthchecks that run the recognition probe, the NGC entrypoint chain,
the engine lifecycle in the image's entrypoint, and the face_pipeline instance count sized to the host.

Static and offline, like tests/deploy/test_compose.py: nothing here builds an image or needs a GPU.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import dockerfile
import pytest
import yaml

from export import __main__ as cli
from export import engine_cache, engine_check
from export.engine_cache import engine_slots
from facecore.probe import PROBE_FILE
from facecore.settings import TritonSettings
from service.launcher import keepalive_args
from tests import ROOT
from tests.deploy.helpers import load_module
from tests.export.test_engine_cache import H100, L4, FakeTensorRT, trt_model

DEPLOY = ROOT / "deploy"
GPU_REPOSITORY = "/opt/facerec/model_repository/gpu"
CPU_REPOSITORY = "/opt/facerec/model_repository/ngc-cpu"


class _TaggedLoader(yaml.SafeLoader):  # type: ignore[misc]  # untyped without types-PyYAML
    """Compose's ``!reset`` / ``!override`` read as None (this file only reads the healthchecks)."""


for _tag in ("!reset", "!override"):
    _TaggedLoader.add_constructor(_tag, lambda _loader, _node: None)


def compose_service(path: Path, name: str) -> dict[str, Any]:
    service: dict[str, Any] = yaml.load(path.read_text(), Loader=_TaggedLoader)["services"][name]
    return service


def dockerfile_final(path: Path, cmd: str) -> list[list[str]]:
    """The values of every ``cmd`` instruction of the last stage."""
    commands = list(dockerfile.parse_file(str(path)))
    last = max(i for i, c in enumerate(commands) if c.cmd.upper() == "FROM")
    return [list(c.value) for c in commands[last:] if c.cmd.upper() == cmd]


HEALTHCHECK = "/opt/facerec/healthcheck.py"


def probe_image_of(command: list[str]) -> str:
    """The ``--image`` of a ``python3 /opt/facerec/healthcheck.py`` command line (Triton's default ports)."""
    assert command[:2] == ["python3", HEALTHCHECK] and "--url" not in command and "--http" not in command
    return command[command.index("--image") + 1]


def option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def seconds(duration: str) -> float:
    match = re.fullmatch(r"(\d+)(s|m)", duration)
    assert match, duration
    return int(match[1]) * (60 if match[2] == "m" else 1)


def test_every_triton_healthcheck_runs_the_recognition_probe_and_ends_a_hung_server() -> None:
    """Compose and the images: healthy = the probe passes; a server hung as long as python -m service's
    FACEREC_TRITON__HANG_TIMEOUT_S is killed by the check (Docker restarts exited containers only), and
    the check runs often enough, and may take long enough, to do it on time."""
    gpu_photo, cpu_photo = f"{GPU_REPOSITORY}/{PROBE_FILE}", f"{CPU_REPOSITORY}/{PROBE_FILE}"
    gpu = compose_service(ROOT / "docker-compose.yml", "triton")["healthcheck"]
    cpu = compose_service(ROOT / "docker-compose.cpu.yml", "triton")["healthcheck"]
    assert gpu["test"][0] == cpu["test"][0] == "CMD"
    assert probe_image_of(gpu["test"][1:]) == gpu_photo and probe_image_of(cpu["test"][1:]) == cpu_photo
    (gpu_image,) = dockerfile_final(DEPLOY / "triton" / "Dockerfile", "HEALTHCHECK")
    (cpu_image,) = dockerfile_final(DEPLOY / "cpu-triton" / "Dockerfile", "HEALTHCHECK")
    assert gpu_image[0] == cpu_image[0] == "CMD"
    assert gpu_image[1:] == gpu["test"][1:] and cpu_image[1:] == cpu["test"][1:], "image and compose agree"
    hang = TritonSettings().hang_timeout_s
    for test in (gpu["test"], cpu["test"]):
        assert float(option(test, "--kill-hung-after")) == hang
    interval, timeout = seconds(gpu["interval"]), seconds(gpu["timeout"])  # the CPU file keeps them
    assert interval <= hang / 3, "a hung server is killed within an interval of the hang timeout"
    assert timeout >= worst_check_s(), "a check against a frozen server is not cut short"
    for image in (DEPLOY / "triton" / "Dockerfile", DEPLOY / "cpu-triton" / "Dockerfile"):
        (copied,) = [c for c in dockerfile_final(image, "COPY") if "deploy/triton/healthcheck.py" in c[:-1]]
        assert copied[-1] == HEALTHCHECK, image


def worst_check_s() -> float:
    """How long the check takes against a frozen server at most: the interpreter and its imports, the
    probe's first call (it gives up on its first failure), the health check."""
    health = load_module(DEPLOY / "triton" / "healthcheck.py", "facerec_triton_healthcheck")
    return 3 + health.PROBE_TIMEOUT_S + health.HEALTH_TIMEOUT_S


def test_kubernetes_restarts_a_hung_triton() -> None:
    """Readiness = the probe; liveness = not hung, failing for as long as the hang timeout before the
    restart; SIGKILL soon after (a stopped process ignores the SIGTERM); the gateway's liveness does not
    depend on Triton (restarting gateways would not heal it)."""
    documents = {(d["kind"], d["metadata"]["name"]): d
                 for name in ("triton.yaml", "gateway.yaml")
                 for d in yaml.safe_load_all((DEPLOY / "k8s" / name).read_text())}
    triton = documents[("Deployment", "triton")]["spec"]["template"]["spec"]["containers"][0]
    readiness, liveness = triton["readinessProbe"], triton["livenessProbe"]
    gpu = compose_service(ROOT / "docker-compose.yml", "triton")["healthcheck"]["test"]
    assert readiness["exec"]["command"] == gpu[1:gpu.index("--kill-hung-after")]
    assert liveness["exec"]["command"] == [*readiness["exec"]["command"], "--liveness"]
    hang = TritonSettings().hang_timeout_s
    assert liveness["periodSeconds"] * liveness["failureThreshold"] == hang
    for probe in (readiness, liveness):
        assert probe["timeoutSeconds"] >= worst_check_s()
    assert liveness["terminationGracePeriodSeconds"] <= 10
    gateway = documents[("Deployment", "gateway")]["spec"]["template"]["spec"]["containers"][0]
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/health/live"


def test_every_triton_image_takes_the_gateways_keepalive_pings(triton_entry: ModuleType) -> None:
    """The flags python -m service's own tritonserver gets (service/launcher.py), in the GPU image's
    entrypoint and the CPU image's command: without them Triton answers the gateway's pings (every 2 s,
    also without calls) with GOAWAY too_many_pings (tests/service/test_launcher.py)."""
    (cpu,) = dockerfile_final(DEPLOY / "cpu-triton" / "Dockerfile", "CMD")
    gpu = triton_entry.server_command(Path("/models/gpu"), [], {})
    for command in (cpu, gpu):
        assert command[0] == "tritonserver"
        assert [a for a in command if a.startswith(("--grpc-keepalive", "--grpc-http2"))] == keepalive_args()


def test_the_entrypoint_removes_what_a_killed_run_left_in_shared_memory(
        triton_entry: ModuleType, tmp_path: Path, exporter: Exporter) -> None:
    image_repository(tmp_path)
    shm = tmp_path / "shm"
    shm.mkdir()
    for name in ("facerec_triton_1f2e3d", "facerec_triton_4c5b6a", "another_program"):
        (shm / name).write_bytes(b"region")
    start(triton_entry, tmp_path, exporter)
    assert [p.name for p in shm.iterdir()] == ["another_program"]


def test_the_probe_photo_is_in_the_repository_baked_into_each_image() -> None:
    """The images' repositories are written by ``python -m export defaults`` (which writes the photo)
    and copied to where the healthchecks look."""
    gpu = [c for c in dockerfile_final(DEPLOY / "triton" / "Dockerfile", "COPY") if c[-1] == GPU_REPOSITORY]
    assert gpu == [["/out/gpu", GPU_REPOSITORY]]
    copies = dockerfile_final(DEPLOY / "cpu-triton" / "Dockerfile", "COPY")
    assert [c for c in copies if c[-1] == CPU_REPOSITORY] == [["/out/ngc-cpu", CPU_REPOSITORY]]


def test_the_image_chains_to_the_ngc_entrypoint() -> None:
    """NGC's entrypoint sets up CUDA forward compatibility (older data-centre drivers) before ours runs."""
    (entrypoint,) = dockerfile_final(DEPLOY / "triton" / "Dockerfile", "ENTRYPOINT")
    assert entrypoint == ["/opt/nvidia/nvidia_entrypoint.sh", "python3", "/opt/facerec/entrypoint.py"]
    copies = dockerfile_final(DEPLOY / "triton" / "Dockerfile", "COPY")
    assert ["/out/check-photos", "/opt/facerec/check-photos"] in copies, "the photos new plans are checked on"


# --- the Triton entrypoint, run here with TensorRT faked -------------------------------------------------

@pytest.fixture(scope="module")
def triton_entry() -> ModuleType:
    return load_module(DEPLOY / "triton" / "entrypoint.py", "facerec_triton_entrypoint")


PIPELINE_CONFIG = """name: "face_pipeline"
backend: "python"
max_batch_size: 16
instance_group {
  count: 2
  kind: KIND_CPU
}
"""


def image_repository(root: Path, versions: tuple[int, ...] = (1,), detector_batch: int = 16) -> Path:
    repo = root / "image" / "gpu"
    trt_model(repo, "face_detector", "detector", versions, max_batch=detector_batch)
    trt_model(repo, "face_embedder", "embedder", versions)
    (repo / "face_pipeline" / "1").mkdir(parents=True, exist_ok=True)
    (repo / "face_pipeline" / "config.pbtxt").write_text(PIPELINE_CONFIG)
    (repo / "face_pipeline" / "1" / "model.py").write_text("# model\n")
    return repo


class Exporter:
    """The entrypoint's ``python -m export tensorrt ...``, run in this process with TensorRT faked
    (tests/export/test_engine_cache.py's FakeTensorRT: a plan says which ONNX, max batch and precision it
    is of)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.trt, self.commands = FakeTensorRT(), list[list[str]]()
        monkeypatch.setattr(engine_cache, "_build_with_tensorrt", self.trt.build)
        monkeypatch.setattr(engine_check, "plan_check", lambda *_args: self.trt.check)

    def __call__(self, command: Sequence[str]) -> None:
        assert list(command[1:4]) == ["-m", "export", "tensorrt"]
        self.commands.append(list(command))
        self.trt.built.clear()
        code = cli.main(list(command[3:]))
        if code:
            raise subprocess.CalledProcessError(code, list(command))


@pytest.fixture
def exporter(monkeypatch: pytest.MonkeyPatch) -> Exporter:
    return Exporter(monkeypatch)


def start(entry: ModuleType, tmp: Path, exporter: Exporter, gpu: str = H100,
          **extra: str) -> list[list[str]]:
    env = {"FACEREC_IMAGE_REPOSITORY": str(tmp / "image" / "gpu"),
           "FACEREC_MODEL_REPOSITORY": str(tmp / "models" / "gpu"),
           "FACEREC_ENGINE_CACHE": str(tmp / "engines"), "FACEREC_CHECK_PHOTOS": str(tmp / "photos"),
           "FACEREC_GPU_NAME": gpu,
           "FACEREC_TRT_VERSION": "10.5.0.18-1+cuda12.6", "FACEREC_PIPELINE_INSTANCES": "config", **extra}
    executed: list[list[str]] = []
    assert entry.main(["--log-verbose=1"], env, exporter, executed.append, tmp / "shm") == 0
    return executed


def built(exporter: Exporter) -> list[str]:
    return sorted(name for name, _ in exporter.trt.built)


def test_entrypoint_engines_per_key_and_version(triton_entry: ModuleType, tmp_path: Path,
                                                exporter: Exporter) -> None:
    image = image_repository(tmp_path, versions=(1, 2))
    served = tmp_path / "models" / "gpu"
    executed = start(triton_entry, tmp_path, exporter)
    assert built(exporter) == ["face_detector/1", "face_detector/2", "face_embedder/1", "face_embedder/2"]
    assert executed == [["tritonserver", f"--model-repository={served}", "--model-control-mode=none",
                         "--http-port=8000", "--grpc-port=8001", "--metrics-port=8002",
                         "--backend-config=python,shm-region-prefix-name=facerec_triton_",
                         *keepalive_args(), "--log-verbose=1"]]
    command = exporter.commands[0]
    assert command[command.index("--gpu-name") + 1] == H100
    assert command[command.index("--tensorrt-version") + 1] == "10.5.0.18-1+cuda12.6"
    assert command[command.index("--check-photos") + 1] == str(tmp_path / "photos")

    start(triton_entry, tmp_path, exporter)
    assert built(exporter) == [], "same key: the plans are kept"
    shutil.rmtree(served)
    start(triton_entry, tmp_path, exporter)
    assert built(exporter) == [], "a new models volume: restored from the engine cache"
    assert (served / "face_embedder" / "2" / "model.plan").read_text() == "face_embedder v2 16 fp16"

    start(triton_entry, tmp_path, exporter, FACEREC_ENGINE_FP32="1")
    assert len(built(exporter)) == 4, "FACEREC_ENGINE_FP32=1 after the first start is not ignored"
    assert (served / "face_embedder" / "1" / "model.plan").read_text().endswith("fp32")
    start(triton_entry, tmp_path, exporter, gpu=L4)
    assert len(built(exporter)) == 4, "another GPU: rebuilt"

    image_repository(tmp_path, versions=(1, 2), detector_batch=64)  # a new image after a re-tune
    start(triton_entry, tmp_path, exporter)
    assert built(exporter) == ["face_detector/1", "face_detector/2"], "a raised max_batch_size: rebuilt"
    assert (served / "face_detector" / "1" / "model.plan").read_text() == "face_detector v1 64 fp16"
    (image / "face_embedder" / "2" / "model.onnx").write_bytes(b"a new embedder")
    start(triton_entry, tmp_path, exporter)
    assert built(exporter) == ["face_embedder/2"], "a new ONNX: that version only"


def test_entrypoint_rollback_to_version_1(triton_entry: ModuleType, tmp_path: Path,
                                          exporter: Exporter) -> None:
    image_repository(tmp_path, versions=(1, 2))
    start(triton_entry, tmp_path, exporter)
    served = tmp_path / "models" / "gpu"
    assert cli.main(["pin", "--repository", str(served), "--model", "face_detector", "--version", "1"]) == 0
    start(triton_entry, tmp_path, exporter)
    assert built(exporter) == []
    version_1 = served / "face_detector" / "1"
    assert (version_1 / "model.plan").read_text() == "face_detector v1 16 fp16"
    key = json.loads((version_1 / "model.plan.json").read_text())["key"]
    assert key["onnx_sha256"] == hashlib.sha256(b"face_detector v1").hexdigest()


def test_entrypoint_keeps_an_operators_repository(triton_entry: ModuleType, tmp_path: Path,
                                                  exporter: Exporter) -> None:
    image_repository(tmp_path)
    own = tmp_path / "models" / "gpu"
    trt_model(own, "face_embedder", "embedder", versions=(3,))
    start(triton_entry, tmp_path, exporter, gpu="NVIDIA A100-SXM4-40GB")
    assert built(exporter) == ["face_embedder/3"] and not (own / "face_detector").exists()


def test_entrypoint_without_gpu(triton_entry: ModuleType, tmp_path: Path, exporter: Exporter,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    image_repository(tmp_path)

    def absent() -> list[str]:
        raise OSError("no driver")

    monkeypatch.setattr(triton_entry, "_nvidia_smi_names", absent)
    monkeypatch.setattr(triton_entry, "_libcuda_names", absent)
    env = {"FACEREC_IMAGE_REPOSITORY": str(tmp_path / "image" / "gpu"),
           "FACEREC_MODEL_REPOSITORY": str(tmp_path / "models" / "gpu"),
           "FACEREC_ENGINE_CACHE": str(tmp_path / "e"), "FACEREC_TRT_VERSION": "10.5"}
    executed: list[list[str]] = []
    assert triton_entry.main([], env, exporter, executed.append, tmp_path / "shm") == 1
    assert executed == [] and exporter.commands == []


def test_entrypoint_fails_when_a_plan_is_refused(triton_entry: ModuleType, tmp_path: Path,
                                                 exporter: Exporter) -> None:
    image_repository(tmp_path)
    exporter.trt.refuse = ("fp16", "fp32")
    env = {"FACEREC_IMAGE_REPOSITORY": str(tmp_path / "image" / "gpu"),
           "FACEREC_MODEL_REPOSITORY": str(tmp_path / "models" / "gpu"),
           "FACEREC_ENGINE_CACHE": str(tmp_path / "e"), "FACEREC_GPU_NAME": H100,
           "FACEREC_TRT_VERSION": "10.5"}
    executed: list[list[str]] = []
    assert triton_entry.main([], env, exporter, executed.append, tmp_path / "shm") == 1
    assert executed == [], "no server on plans that differ from their ONNX models"
    assert not list((tmp_path / "models" / "gpu").glob("*/*/model.plan"))


def test_entrypoint_reads_the_exporters_configs() -> None:
    repository = ROOT / "model_repository" / "gpu"
    if not (repository / "face_detector" / "config.pbtxt").is_file():
        pytest.skip("model_repository/gpu is not generated here (python -m export defaults)")
    slots = {slot.model: slot for slot in engine_slots(repository)}
    assert set(slots) == {"face_detector", "face_embedder"}
    assert slots["face_detector"].role == "detector" and slots["face_embedder"].role == "embedder"
    assert slots["face_detector"].profile.shape == (640, 640, 3), "the uint8 NHWC detector input"
    assert all(slot.plan.name == "model.plan" and slot.onnx.is_file() for slot in slots.values())


# --- face_pipeline sized to the host ---------------------------------------------------------------------

@pytest.mark.parametrize(("affinity", "cpu_max", "usable"), [
    (16, None, 16), (16, "max 100000\n", 16), (16, "400000 100000\n", 4), (16, "150000 100000", 2),
    (4, "800000 100000", 4), (1, None, 1),
])
def test_usable_cpus(triton_entry: ModuleType, affinity: int, cpu_max: str | None, usable: int) -> None:
    assert triton_entry.usable_cpus(affinity, cpu_max) == usable


def test_pipeline_instances(triton_entry: ModuleType) -> None:
    assert triton_entry.pipeline_instances({}, 16) == 14, "one per CPU, two left to tritonserver"
    assert triton_entry.pipeline_instances({}, 2) == 1
    assert triton_entry.pipeline_instances({"FACEREC_PIPELINE_INSTANCES": "6"}, 16) == 6
    assert triton_entry.pipeline_instances({"FACEREC_PIPELINE_INSTANCES": "config"}, 16) is None
    with pytest.raises(triton_entry.EntrypointError, match="FACEREC_PIPELINE_INSTANCES"):
        triton_entry.pipeline_instances({"FACEREC_PIPELINE_INSTANCES": "0"}, 16)


def test_the_entrypoint_writes_the_instance_count(triton_entry: ModuleType, tmp_path: Path,
                                                  exporter: Exporter) -> None:
    image_repository(tmp_path)
    start(triton_entry, tmp_path, exporter, FACEREC_PIPELINE_INSTANCES="6")
    config = (tmp_path / "models" / "gpu" / "face_pipeline" / "config.pbtxt").read_text()
    assert "instance_group {\n  count: 6\n  kind: KIND_CPU\n}" in config
    assert "count: 2" in (tmp_path / "image" / "gpu" / "face_pipeline" / "config.pbtxt").read_text()
    start(triton_entry, tmp_path, exporter, FACEREC_PIPELINE_INSTANCES="3")
    assert "count: 3" in (tmp_path / "models" / "gpu" / "face_pipeline" / "config.pbtxt").read_text()


def test_instance_count_in_the_exporters_config(triton_entry: ModuleType) -> None:
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    config = ROOT / "model_repository" / "gpu" / "face_pipeline" / "config.pbtxt"
    if not config.is_file():
        pytest.skip("model_repository/gpu is not generated here (python -m export defaults)")
    rewritten = text_format.Parse(triton_entry.with_instance_count(config.read_text(), 14), mc.ModelConfig())
    assert [(g.count, g.kind) for g in rewritten.instance_group] == [(14, mc.ModelInstanceGroup.KIND_CPU)]
    assert rewritten.parameters["decode_min_side"].string_value != "0", "reduced-size decode is on"
