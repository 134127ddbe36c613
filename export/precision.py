"""Which precision each network may run at: checked against fp32 ONNX Runtime on real faces, at export.

The embedder alone, on the same aligned crops: cosine >= 0.999 on every face. The whole pipeline with
the served detector (uint8 input, the candidate runtime and precision) against the fp32 reference: the
same faces found, box IoU >= 0.95, embedding cosine >= 0.99 on every face, and identical decisions —
same/different between every pair of faces, the face that enrollment with ``face=largest`` takes in
every image, and the quality gate's verdict on every face. A decision whose measure sits on its threshold
in the reference may come out either way (a pair's cosine within ``PAIR_MARGIN`` of the match threshold, a
gate measure within ``GATE_MARGIN`` of its limit): on an H200, TF32 moved the blur of a 28-pixel face
across the gate's 40 (``python -m bench.gpu``, docs/gpu-plan.md), so without those margins a correct plan
was refused by chance. The test photos are checked as they are and downscaled (0.5x, 0.3x), so that small
faces — where reduced precision moves landmarks most — are part of it. A precision that fails is not
used; the export logs why and records every check beside the model.

With ``auto``, bf16 must also be faster: some CPUs report bfloat16 and run it slower than f32 (a Xeon
without AMX: docs/benchmarks/tuning.md, "bf16 where it is faster"), so both precisions are timed on this
CPU, interleaved, and bf16 is tried only when it is at least ``BF16_SPEEDUP`` times faster than f32 on
one thread (how each network runs under load).
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from facecore.contract import Faces
from facecore.onnx_runtime import OnnxDetector, OnnxEmbedder, create_session
from facecore.pipeline import PipelineSettings, network_input, run_pipeline
from facecore.processing import ImageArray, decode_image, to_tensor
from facecore.quality import FaceQuality, QualityThresholds, Rejection, assess
from facecore.runtimes import Runtime, RuntimeChoice, cpu_model, detector, embedder
from facecore.spec import ModelSpec

log = logging.getLogger(__name__)

EMBEDDER_COSINE = 0.999
#: A pair whose reference cosine is within this of the match threshold may be decided either way: twice
#: the largest change float16 made on the test photos (0.0045; TF32 0.0031; on an H200, bench/gpu.py).
PAIR_MARGIN = 0.01
#: A quality-gate measure within this fraction of its limit in the reference (blur 40 +- 0.8, a face of
#: 40 +- 0.8 pixels, yaw 45 +- 0.9 degrees) may fall on either side: four times the largest relative change
#: float16 made to any of them (blur, 0.5 %).
GATE_MARGIN = 0.02
PIPELINE_COSINE = 0.99
BOX_IOU = 0.95
SCALES = (1.0, 0.5, 0.3)
#: ``auto`` tries bf16 only when it is at least this many times faster than f32 on this CPU.
BF16_SPEEDUP = 1.1
#: Faces per embedder call when the precisions are timed (the served batches: 1 to 16 faces).
TIMED_FACES = 8
#: Threads per call when the precisions are timed: how each network runs under load (every profile).
TIMED_THREADS = 1


@dataclass(frozen=True)
class PrecisionCheck:
    network: str  # "detector" or "embedder"
    runtime: str
    precision: str
    passed: bool
    faces: int
    worst_cosine: float
    worst_iou: float = 1.0
    same_faces: bool = True
    same_decisions: bool = True
    reason: str = ""
    #: Median ms per call on this CPU where the precisions were timed (``auto``), else 0.
    ms: float = 0.0

    def summary(self) -> str:
        verdict = "accepted" if self.passed else f"refused ({self.reason})"
        measured = [f"{self.faces} faces, worst cosine {self.worst_cosine:.5f}, worst box IoU "
                    f"{self.worst_iou:.4f}"] if self.faces else []
        measured += [f"{self.ms:.1f} ms per call"] if self.ms else []
        return f"{self.network} {self.runtime} {self.precision}: " + "; ".join([verdict, *measured])


def check_images(photos: dict[str, Path], decode_min_side: int = 0) -> list[ImageArray]:
    """The test photos (faceless ones too: no face must appear) at every scale of ``SCALES``, and, for
    JPEGs the pipeline decodes at reduced size (``decode_min_side``), as it decodes them."""
    data = [path.read_bytes() for name, path in sorted(photos.items())
            if name.endswith((".jpg", ".png")) and not name.startswith("Tom_Hanks")]
    images = [decode_image(d, 10**8) for d in data]
    scaled = [image if scale == 1.0 else
              np.asarray(cv2.resize(image, None, fx=scale, fy=scale, interpolation=cv2.INTER_AREA), np.uint8)
              for image in images for scale in SCALES]
    if not decode_min_side:
        return scaled
    served = [decode_image(d, 10**8, decode_min_side) for d in data]
    return scaled + [s for s, full in zip(served, images, strict=True) if s.shape != full.shape]


def _iou(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> float:
    x1, y1 = max(a[0], b[0]), max(a[1], b[1])
    x2, y2 = min(a[2], b[2]), min(a[3], b[3])
    inter = max(0.0, x2 - x1) * max(0.0, y2 - y1)
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return float(inter / union) if union > 0 else 0.0


def _near(value: float, limit: float) -> bool:
    return abs(value - limit) <= GATE_MARGIN * abs(limit)


def _borderline(quality: FaceQuality, reason: Rejection, gate: QualityThresholds) -> bool:
    """Whether the reference's measure behind ``reason`` sits within ``GATE_MARGIN`` of its limit."""
    if reason is Rejection.FACE_TOO_SMALL:
        return _near(quality.face_size, gate.min_face_size)
    if reason is Rejection.TOO_BLURRY:
        return _near(quality.blur, gate.min_blur)
    if reason is Rejection.POSE_TOO_FAR:
        return any(_near(abs(angle), limit) for angle, limit in (
            (quality.yaw, gate.max_yaw), (quality.pitch, gate.max_pitch), (quality.roll, gate.max_roll)))
    return _near(quality.detection_score, gate.min_detection_score)


def qualities(faces: Faces) -> list[FaceQuality]:
    """Each face's quality-gate measures."""
    return [assess(faces.boxes[i], faces.landmarks[i], float(faces.blur[i]), float(faces.scores[i]))
            for i in range(len(faces))]


def decision_changes(reference: Sequence[Faces], candidate: Sequence[Faces], threshold: float
                     ) -> list[dict[str, Any]]:
    """Every decision the candidate makes otherwise, with the values it was made from; the faces are those
    of the reference, in its order (``matched``), as many per image. ``borderline``: the reference's measure
    sits on the threshold (a pair's cosine within ``PAIR_MARGIN``, a gate measure within ``GATE_MARGIN`` of
    its limit), so either outcome is the same decision."""
    gate = QualityThresholds()
    changes: list[dict[str, Any]] = []
    for image, (r, c) in enumerate(zip(reference, candidate, strict=True)):
        if len(r) and int(np.argmax(r.areas())) != int(np.argmax(c.areas())):
            areas = np.sort(r.areas())[::-1]
            changes.append({"kind": "largest face", "image": image, "borderline": False,
                            "reference_ratio": float(areas[0] / areas[1])})
        for face, (ref, got) in enumerate(zip(qualities(r), qualities(c), strict=True)):
            changed = set(ref.rejections(gate)) ^ set(got.rejections(gate))
            if changed:
                changes.append({"kind": "quality gate", "image": image, "face": face,
                                "borderline": all(_borderline(ref, reason, gate) for reason in changed),
                                "reference": ref.as_dict(), "candidate": got.as_dict(),
                                "reference_rejections": [x.value for x in ref.rejections(gate)],
                                "candidate_rejections": [x.value for x in got.rejections(gate)]})
    ref_all = np.concatenate([r.embeddings for r in reference])
    got_all = np.concatenate([c.embeddings for c in candidate])
    ref_cos, got_cos = ref_all @ ref_all.T, got_all @ got_all.T
    for i, j in zip(*np.nonzero(np.triu((ref_cos >= threshold) != (got_cos >= threshold), 1)), strict=True):
        changes.append({"kind": "same/different", "faces": [int(i), int(j)],
                        "borderline": bool(abs(ref_cos[i, j] - threshold) <= PAIR_MARGIN),
                        "reference_cosine": float(ref_cos[i, j]), "candidate_cosine": float(got_cos[i, j])})
    return changes


def matched(reference: Faces, candidate: Faces) -> Faces:
    """``candidate``'s faces in the order of the reference faces they overlap most.

    Faces come best score first, and reduced precision turns near-equal scores (0.9996 and 0.9998) into
    ties, so the same faces can come in another order: ``compare_pipelines`` pairs them by overlap first."""
    if len(reference) != len(candidate) or len(reference) < 2:
        return candidate
    a, b = reference.boxes[:, None, :], candidate.boxes[None, :, :]
    inter = (np.clip(np.minimum(a[..., 2], b[..., 2]) - np.maximum(a[..., 0], b[..., 0]), 0, None)
             * np.clip(np.minimum(a[..., 3], b[..., 3]) - np.maximum(a[..., 1], b[..., 1]), 0, None))
    union = reference.areas()[:, None] + candidate.areas()[None, :] - inter
    order = np.argmax(inter / np.maximum(union, 1e-9), axis=1)
    if len(set(order.tolist())) != len(order):  # not one-to-one: leave it to the comparison to refuse
        return candidate
    return replace(candidate, boxes=candidate.boxes[order], scores=candidate.scores[order],
                   landmarks=candidate.landmarks[order], embeddings=candidate.embeddings[order],
                   blur=candidate.blur[order], crops=candidate.crops[order] if len(candidate.crops) else
                   candidate.crops)


def compare_pipelines(reference: Sequence[Faces], candidate: Sequence[Faces], threshold: float,
                      network: str, choice: RuntimeChoice) -> PrecisionCheck:
    candidate = [matched(r, c) for r, c in zip(reference, candidate, strict=True)]
    same_faces = all(len(r) == len(c) for r, c in zip(reference, candidate, strict=True))
    cosines, ious = [], []
    for r, c in zip(reference, candidate, strict=True):
        if len(r) == len(c):
            cosines += np.sum(r.embeddings * c.embeddings, axis=1).tolist()
            ious += [_iou(a, b) for a, b in zip(r.boxes, c.boxes, strict=True)]
    same_decisions = same_faces and all(change["borderline"] for change in
                                        decision_changes(reference, candidate, threshold))
    worst_cosine, worst_iou = min(cosines, default=0.0), min(ious, default=0.0)
    reasons = [text for failed, text in (
        (not same_faces, "other faces found"), (worst_iou < BOX_IOU, f"box IoU {worst_iou:.4f} < {BOX_IOU}"),
        (worst_cosine < PIPELINE_COSINE, f"cosine {worst_cosine:.5f} < {PIPELINE_COSINE}"),
        (not same_decisions, "a decision changed (same/different, largest face or quality gate)"))
        if failed]
    return PrecisionCheck(network, choice.runtime.value, choice.precision, not reasons, len(cosines),
                          worst_cosine, worst_iou, same_faces, same_decisions, "; ".join(reasons))


@dataclass(frozen=True)
class Reference:
    """The fp32 ONNX Runtime pipeline on the check images: what every candidate is compared with."""

    detector: ModelSpec
    embedder: ModelSpec
    embedder_file: Path
    images: list[ImageArray]
    faces: list[Faces]

    @classmethod
    def build(cls, detector: ModelSpec, detector_file: Path, embedder: ModelSpec, embedder_file: Path,
              images: list[ImageArray]) -> Reference:
        settings = PipelineSettings(detector, embedder)
        faces = run_pipeline(images, [settings.default_options] * len(images), settings,
                             OnnxDetector(detector, create_session(detector_file)),
                             OnnxEmbedder(embedder, create_session(embedder_file)))
        return cls(detector, embedder, embedder_file, images, faces)

    @property
    def crops(self) -> ImageArray:
        return np.concatenate([f.crops for f in self.faces])


def check_detector(reference: Reference, served: ModelSpec, served_file: Path, choice: RuntimeChoice
                   ) -> PrecisionCheck:
    """The whole pipeline with the served detector at ``choice`` (fp32 ORT embedder) vs the reference."""
    settings = PipelineSettings(served, reference.embedder)
    embed = OnnxEmbedder(reference.embedder, create_session(reference.embedder_file))
    got = run_pipeline(reference.images, [settings.default_options] * len(reference.images), settings,
                       detector(served, served_file, choice), embed)
    return compare_pipelines(reference.faces, got, reference.embedder.match_threshold, "detector", choice)


def check_embedder(reference: Reference, choice: RuntimeChoice) -> PrecisionCheck:
    """The embedder alone at ``choice`` vs fp32 ONNX Runtime on the same aligned crops."""
    spec, crops = reference.embedder, reference.crops
    batch = to_tensor(crops, spec.swap_rb, spec.mean, spec.std)
    expected = OnnxEmbedder(spec, create_session(reference.embedder_file))(batch)
    got = embedder(spec, reference.embedder_file, choice)(batch)
    norms = np.linalg.norm(expected, axis=1) * np.linalg.norm(got, axis=1)
    cosines = np.sum(expected * got, axis=1) / norms
    worst = float(cosines.min())
    passed = worst >= EMBEDDER_COSINE
    return PrecisionCheck("embedder", choice.runtime.value, choice.precision, passed, len(crops), worst,
                          reason="" if passed else f"cosine {worst:.5f} < {EMBEDDER_COSINE}")


def record(checks: Sequence[PrecisionCheck], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([asdict(c) for c in checks], indent=2) + "\n")


def first_passing(candidates: Sequence[str], check: Callable[[RuntimeChoice], PrecisionCheck],
                  base: RuntimeChoice) -> tuple[str, list[PrecisionCheck]]:
    """The first precision of ``candidates`` whose check passes (the last one must: f32)."""
    checks = []
    for precision in candidates:
        result = check(RuntimeChoice(Runtime(base.runtime), precision, base.threads, base.spinning))
        checks.append(result)
        log.info("precision check: %s", result.summary())
        if result.passed:
            return precision, checks
    raise RuntimeError("no precision passed the accuracy check: " + "; ".join(c.summary() for c in checks))


def time_precisions(path: Path, batch: np.ndarray[Any, Any], threads: int, precisions: Sequence[str],
                    rounds: int = 5, calls: int = 3) -> dict[str, float]:
    """Median ms per OpenVINO call of ``batch`` at each precision on this CPU, compiled as served. The
    precisions alternate round by round: the machine's speed drifts from one second to the next, and
    alternating gives each precision the same drift."""
    from facecore.openvino_runtime import Network, Precision, compile_model

    networks = {p: Network(compile_model(path, Precision(p), threads)) for p in precisions}
    for run in networks.values():
        run(batch)  # warm-up: first-call allocations
    times: dict[str, list[float]] = {p: [] for p in precisions}
    for _ in range(rounds):
        for precision, run in networks.items():
            began = time.perf_counter()
            for _ in range(calls):
                run(batch)
            times[precision].append(1000 * (time.perf_counter() - began) / calls)
    return {p: statistics.median(t) for p, t in times.items()}


def timed_input(spec: ModelSpec, count: int) -> np.ndarray[Any, Any]:
    """``count`` random images at ``spec``'s full input size, as the network takes them."""
    width, height = spec.input_size
    images = np.random.default_rng(0).integers(0, 256, (count, height, width, 3), dtype=np.uint8)
    return network_input(images, spec)


def by_speed(network: str, candidates: list[str], timings: dict[str, float]
             ) -> tuple[list[str], list[PrecisionCheck]]:
    """``candidates`` without bf16 when it is not ``BF16_SPEEDUP`` times faster than f32 here, and the
    refusal as a check record; the timings are kept on the records of the precisions left."""
    if "bf16" not in candidates or timings["bf16"] * BF16_SPEEDUP <= timings["f32"]:
        return candidates, []
    reason = (f"not faster on this CPU: {timings['bf16']:.1f} ms per call in bf16, {timings['f32']:.1f} "
              f"in f32 (bf16 must be {BF16_SPEEDUP}x faster)")
    refused = PrecisionCheck(network, "openvino", "bf16", False, 0, 0.0, 0.0, reason=reason,
                             ms=timings["bf16"])
    return [c for c in candidates if c != "bf16"], [refused]


def _timed(checks: list[PrecisionCheck], timings: dict[str, float]) -> list[PrecisionCheck]:
    return [c if c.ms or c.precision not in timings else replace(c, ms=timings[c.precision]) for c in checks]


CHECK_VERSION = 4
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"


def _wanted(setting: str) -> list[str]:
    """Precisions to try, best first: ``auto`` is bf16 where the CPU has it (then timed: ``by_speed``),
    then f32."""
    from facecore.openvino_runtime import bf16_supported

    if setting == "auto":
        return ["bf16", "f32"] if bf16_supported() else ["f32"]
    if setting not in ("f32", "bf16"):
        raise ValueError(f"precision must be auto, f32 or bf16, got {setting!r}")
    return [setting] if setting == "f32" else [setting, "f32"]


def _cache_key(*parts: str) -> str:
    import hashlib

    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def choose_precisions(reference_files: tuple[ModelSpec, Path, ModelSpec, Path], served_detector: Path,
                      served_spec: ModelSpec, choice: RuntimeChoice, detector_setting: str,
                      embedder_setting: str, decode_min_side: int = 0, artifacts: Path = ARTIFACTS
                      ) -> dict[str, PrecisionCheck]:
    """The precision each network will run at, by the checks above (cached under ``artifacts``)."""
    import openvino

    from export.fetch import fetch_photos
    from facecore.files import sha256_of

    det_spec, det_file, emb_spec, emb_file = reference_files
    key = _cache_key(str(CHECK_VERSION), sha256_of(served_detector), sha256_of(emb_file),
                     openvino.__version__, detector_setting, ",".join(_wanted(detector_setting)),
                     embedder_setting, ",".join(_wanted(embedder_setting)), choice.runtime,
                     str(decode_min_side), cpu_model())
    cached = artifacts / "precision" / f"{key}.json"
    if cached.exists():
        checks = [PrecisionCheck(**c) for c in json.loads(cached.read_text())]
    else:
        photos = fetch_photos(artifacts / "downloads", artifacts / "photos")
        reference = Reference.build(det_spec, det_file, emb_spec, emb_file,
                                    check_images(photos, decode_min_side))
        networks = {"detector": (detector_setting, served_detector, served_spec, 1,
                                 lambda c: check_detector(reference, served_spec, served_detector, c)),
                    "embedder": (embedder_setting, emb_file, emb_spec, TIMED_FACES,
                                 lambda c: check_embedder(reference, c))}
        checks = []
        for network, (setting, path, spec, count, accuracy) in networks.items():
            candidates, refused = _wanted(setting), list[PrecisionCheck]()
            timings: dict[str, float] = {}
            if setting == "auto" and "bf16" in candidates:
                timings = time_precisions(path, timed_input(spec, count), TIMED_THREADS, candidates)
                log.info("%s timed: %s", network, ", ".join(f"{p} {ms:.1f} ms" for p, ms in timings.items()))
                candidates, refused = by_speed(network, candidates, timings)
            _, passed = first_passing(candidates, accuracy, choice)
            checks += _timed([*refused, *passed], timings)
        record(checks, cached)
    for check in checks:
        if not check.passed:
            log.warning("precision refused: %s", check.summary())
    return {network: next(c for c in checks if c.network == network and c.passed)
            for network in ("detector", "embedder")}
