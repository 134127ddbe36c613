"""``export.engine_check``: a plan is compared with its ONNX model on the test photos before it is used.

TensorRT is not installable here, so ONNX Runtime stands in for the engine: running the ONNX file itself
as the "plan" must pass; its outputs rounded to float16 (what an FP16 engine's outputs are at best) must
pass; outputs moved a little (what a broken FP16 engine gives) must be refused. The real engine runs in
``test_real_plans_pass_their_check``, skipped where TensorRT is absent (here: always).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

from export.defaults import DefaultModels
from export.engine_cache import build_repository_engines, engine_slots
from export.engine_check import EngineChecker, load_check_images, onnx_runner, plan_check, served_settings
from export.profiles import Profile
from export.repository import RepositoryPlan, write_repository
from export.tensorrt_build import tensorrt_available
from facecore.runtimes import Runner
from tests.conftest import ARTIFACTS


@pytest.fixture(scope="module")
def gpu_repository(default_models: DefaultModels, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The exporter's gpu repository, with each model.onnx also standing as model.plan."""
    out = tmp_path_factory.mktemp("gpu") / "gpu"
    plan = RepositoryPlan(Profile.GPU, default_models.detector, default_models.embedder)
    write_repository(plan, out, default_models.detector_file, default_models.embedder_file)
    for slot in engine_slots(out):
        shutil.copyfile(slot.onnx, slot.plan)
    return out


@pytest.fixture(scope="module")
def checker(gpu_repository: Path, photos: dict[str, Path]) -> EngineChecker:
    """One checker for the module, so the ONNX reference is computed once; tests set its plan runner."""
    images = load_check_images(ARTIFACTS / "photos")
    return EngineChecker(served_settings(gpu_repository), images, onnx_runner)


Outputs = list[np.ndarray]  # type: ignore[type-arg]
MakeRunner = Callable[[Path, Sequence[str]], Runner]


def altered(change: Callable[[Outputs], Outputs]) -> MakeRunner:
    def make(path: Path, names: Sequence[str]) -> Runner:
        run = onnx_runner(path, names)
        return lambda batch: change(run(batch))

    return make


def as_fp16(outputs: Outputs) -> Outputs:
    return [o.astype(np.float16).astype(np.float32) for o in outputs]


def shifted_boxes(outputs: Outputs) -> Outputs:
    loc, conf, landmarks = outputs
    return [loc + 1.5, conf, landmarks]  # prior-relative offsets (variance 0.1): boxes move by ~0.15 prior


def noisy_embeddings(outputs: Outputs) -> Outputs:
    (embeddings,) = outputs
    noise = np.random.default_rng(0).normal(0, 0.08, embeddings.shape) * np.abs(embeddings).mean()
    return [embeddings + noise.astype(np.float32)]


def slots_of(repository: Path) -> dict[str, Path]:
    return {slot.model: slot.onnx for slot in engine_slots(repository)}


@pytest.mark.parametrize(("runner", "passes"), [
    (onnx_runner, True), (altered(as_fp16), True), (altered(shifted_boxes), False),
])
def test_detector_plans(gpu_repository: Path, checker: EngineChecker, runner: MakeRunner,
                        passes: bool) -> None:
    onnx = slots_of(gpu_repository)
    checker.plan_runner = runner
    result = checker.check_detector(onnx["face_detector"], onnx["face_detector"].with_name("model.plan"),
                                    onnx["face_embedder"], "fp16")
    assert result.passed is passes, result.summary()
    assert result.faces >= 30 and result.runtime == "tensorrt"
    if not passes:
        assert "box IoU" in result.reason and result.worst_iou < 0.9


@pytest.mark.parametrize(("runner", "passes"), [
    (onnx_runner, True), (altered(as_fp16), True), (altered(noisy_embeddings), False),
])
def test_embedder_plans(gpu_repository: Path, checker: EngineChecker, runner: MakeRunner,
                        passes: bool) -> None:
    onnx = slots_of(gpu_repository)
    checker.plan_runner = runner
    result = checker.check_embedder(onnx["face_embedder"], onnx["face_embedder"].with_name("model.plan"),
                                    onnx["face_detector"], "fp16")
    assert result.passed is passes, result.summary()
    assert result.faces >= 30
    assert (result.worst_cosine >= 0.999) is passes


def test_the_check_runs_on_the_served_settings(gpu_repository: Path) -> None:
    settings = served_settings(gpu_repository)
    assert not settings.dynamic_input, "the gpu profile letterboxes to the engines' fixed 640x640"
    assert settings.detector.input_layout.value == "nhwc_uint8"


def test_a_refused_fp16_build_falls_back_to_fp32_through_the_real_check(
    gpu_repository: Path, tmp_path: Path
) -> None:
    """engine_cache + engine_check together: the "fp16 plan" has shifted boxes, the "fp32" one is exact."""
    repository = Path(shutil.copytree(gpu_repository, tmp_path / "gpu"))
    built: dict[Path, bool] = {}

    def build(slot: object, fp16: bool) -> None:
        plan: Path = slot.plan  # type: ignore[attr-defined]
        shutil.copyfile(slot.onnx, plan)  # type: ignore[attr-defined]
        built[plan] = fp16

    def runner(path: Path, names: Sequence[str]) -> Runner:
        fp16_detector = built.get(path) and "detector" in str(path)
        return (altered(shifted_boxes) if fp16_detector else onnx_runner)(path, names)

    check = plan_check(repository, engine_slots(repository), ARTIFACTS / "photos", runner)
    outcome = build_repository_engines(repository, gpus=["NVIDIA H100"], tensorrt="10.5.0", build=build,
                                       check=check)
    assert outcome == {"face_detector/1": "built fp32 (fp16 refused)", "face_embedder/1": "built fp16"}


@pytest.mark.skipif(not tensorrt_available(), reason="TensorRT is not installed here (it cannot be installed "
                    "from PyPI on this machine); runs in the NGC image or on a GPU host")
def test_real_plans_pass_their_check(gpu_repository: Path, tmp_path: Path) -> None:
    repository = Path(shutil.copytree(gpu_repository, tmp_path / "gpu",
                                      ignore=shutil.ignore_patterns("model.plan")))
    outcome = build_repository_engines(repository, "fp16", photos=ARTIFACTS / "photos", cache=tmp_path / "e")
    assert set(outcome.values()) <= {"built fp16", "built fp32 (fp16 refused)"}
