"""Is a TensorRT plan still the model of the ONNX file it was built from? Checked at build, on real faces.

The criteria follow ``export.precision``'s (those the CPU runtimes' reduced precisions must meet), with
fp32 ONNX Runtime on the ONNX file beside the plan as the reference and ``face_pipeline``'s served
settings (the fixed 640x640 detector input of the gpu profile):

- detector plan: the whole pipeline with the plan as detector (and the ONNX embedder) against the
  reference on the test photos at 1, 0.5 and 0.3 scale: the same faces (box IoU >= 0.9, see
  ``DETECTION_IOU``) and the same same/different decisions between all of them;
- embedder plan: on the reference's aligned faces, embedding cosine >= 0.999 on every face.

How a plan is run is injected (``PlanRunner``): ``export.tensorrt_runner`` on a GPU, ONNX Runtime
standing in for it in the tests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from export.precision import ARTIFACTS, EMBEDDER_COSINE, PrecisionCheck, check_images, compare_pipelines
from facecore.contract import Faces
from facecore.pipeline import Detector, Embedder, PipelineSettings, network_input, run_pipeline
from facecore.processing import FloatArray, ImageArray
from facecore.runtimes import Runner, Runtime, RuntimeChoice, runner
from facecore.spec import ModelSpec

if TYPE_CHECKING:  # the checks themselves need no TensorRT tooling (bench/gpu.py runs them without it)
    from export.engine_cache import EngineSlot

#: Detector plans: the same faces, each box within this IoU of the reference's. Not the 0.95 box IoU and
#: 0.99 embedding cosine of ``export.precision``'s pipeline check: the detector's scores in float16 (the
#: best an FP16 engine can give) tie anchors whose scores differ by less than 0.0005, so NMS keeps another
#: anchor of the same face; measured on the test photos with the ONNX outputs rounded to float16: box IoU
#: down to 0.94 and that face's embedding cosine down to 0.966 (tests/export/test_engine_check.py).
DETECTION_IOU = 0.9

#: (plan file, output names) -> a function running that plan on one input batch.
PlanRunner = Callable[[Path, Sequence[str]], Runner]


def onnx_runner(path: Path, output_names: Sequence[str]) -> Runner:
    return runner(path, output_names, RuntimeChoice(Runtime.ONNXRUNTIME, "f32", threads=0))


def _detector(run: Runner) -> Detector:
    def detect(batch: np.ndarray) -> tuple[FloatArray, FloatArray, FloatArray]:  # type: ignore[type-arg]
        loc, conf, landmarks = run(batch)
        return loc, conf, landmarks

    return detect


def _embedder(run: Runner) -> Embedder:
    return lambda batch: run(batch)[0]


def served_settings(repository: Path) -> PipelineSettings:
    """``face_pipeline``'s settings as its config records them."""
    from export.served import read_config

    config = read_config(repository / "face_pipeline")
    return PipelineSettings.from_parameters({k: v.string_value for k, v in config.parameters.items()})


def load_check_images(photos: Path) -> list[ImageArray]:
    """The test photos in ``photos`` (``python -m export photos``), at every scale of the check."""
    found = {path.name: path for path in sorted(photos.glob("*")) if path.is_file()}
    if not any(name.endswith(".jpg") for name in found):
        raise FileNotFoundError(f"no test photos in {photos}: run `python -m export photos --out {photos}`")
    return check_images(found)


@dataclass
class EngineChecker:
    """Checks plans of one repository; the ONNX references are computed once per pair of files."""

    settings: PipelineSettings
    images: list[ImageArray]
    plan_runner: PlanRunner
    _references: dict[tuple[Path, Path], list[Faces]] = field(default_factory=dict)

    def reference(self, detector_onnx: Path, embedder_onnx: Path) -> list[Faces]:
        key = (detector_onnx, embedder_onnx)
        if key not in self._references:
            self._references[key] = self._run(_detector(self._onnx(detector_onnx, self.settings.detector)),
                                              _embedder(self._onnx(embedder_onnx, self.settings.embedder)))
        return self._references[key]

    def _onnx(self, path: Path, spec: ModelSpec) -> Runner:
        return onnx_runner(path, spec.output_names)

    def _run(self, detect: Detector, embed: Embedder) -> list[Faces]:
        options = [self.settings.default_options] * len(self.images)
        return run_pipeline(self.images, options, self.settings, detect, embed)

    def check_detector(self, onnx: Path, plan: Path, embedder_onnx: Path, precision: str) -> PrecisionCheck:
        reference = self.reference(onnx, embedder_onnx)
        plan_detector = _detector(self.plan_runner(plan, self.settings.detector.output_names))
        got = self._run(plan_detector, _embedder(self._onnx(embedder_onnx, self.settings.embedder)))
        found = compare_pipelines(reference, got, self.settings.embedder.match_threshold, "detector",
                                  RuntimeChoice())
        reasons = [text for failed, text in (
            (not found.same_faces, "other faces found"),
            (found.worst_iou < DETECTION_IOU, f"box IoU {found.worst_iou:.4f} < {DETECTION_IOU}"),
            (not found.same_decisions, "a same/different decision changed")) if failed]
        return replace(found, runtime="tensorrt", precision=precision, passed=not reasons,
                       reason="; ".join(reasons))

    def check_embedder(self, onnx: Path, plan: Path, detector_onnx: Path, precision: str) -> PrecisionCheck:
        spec = self.settings.embedder
        crops = np.concatenate([f.crops for f in self.reference(detector_onnx, onnx)])
        batch = network_input(crops, spec)
        reference, candidate = self._onnx(onnx, spec), self.plan_runner(plan, spec.output_names)
        expected = np.concatenate([reference(chunk)[0] for chunk in _chunks(batch)])
        got = np.concatenate([candidate(chunk)[0] for chunk in _chunks(batch)])
        norms = np.linalg.norm(expected, axis=1) * np.linalg.norm(got, axis=1)
        cosines = np.sum(expected * got, axis=1) / norms
        worst = float(cosines.min()) if len(cosines) else 0.0
        passed = len(cosines) > 0 and worst >= EMBEDDER_COSINE
        reason = "" if passed else (f"cosine {worst:.5f} < {EMBEDDER_COSINE}" if len(cosines) else "no faces")
        return PrecisionCheck("embedder", "tensorrt", precision, passed, len(cosines), worst, reason=reason)


def _chunks(batch: np.ndarray, size: int = 16) -> list[np.ndarray]:  # type: ignore[type-arg]
    """Batches no larger than the smallest max batch an engine profile is likely built for."""
    return [batch[i : i + size] for i in range(0, len(batch), size)]


def _newest(slots: Sequence[EngineSlot], role: str) -> Path:
    from export.engine_cache import EngineRefused

    found = [slot for slot in slots if slot.role == role]
    if not found:
        raise EngineRefused(f"no {role} among the TensorRT models: cannot check the plans against ONNX")
    return max(found, key=lambda slot: slot.version).onnx


def plan_check(repository: Path, slots: Sequence[EngineSlot], photos: Path | None,
               plan_runner: PlanRunner | None = None) -> Callable[[EngineSlot, str], PrecisionCheck]:
    """The check ``export.engine_cache`` runs on every new plan; the reference is computed at the first."""
    checker: list[EngineChecker] = []

    def check(slot: EngineSlot, precision: str) -> PrecisionCheck:
        if not checker:
            from export.tensorrt_runner import PlanRunner as TensorRTRunner

            images = load_check_images(photos or ARTIFACTS / "photos")
            checker.append(EngineChecker(served_settings(repository), images, plan_runner or TensorRTRunner))
        if slot.role == "detector":
            return checker[0].check_detector(slot.onnx, slot.plan, _newest(slots, "embedder"), precision)
        if slot.role == "embedder":
            return checker[0].check_embedder(slot.onnx, slot.plan, _newest(slots, "detector"), precision)
        from export.engine_cache import EngineRefused

        raise EngineRefused(f"{slot.name}: its config names no detector or embedder role: cannot check it")

    return check
