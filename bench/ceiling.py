"""The in-process ceiling: what a perfect server could reach here.

The two networks run in this process with the files, settings, runtime and precisions ``face_pipeline``
serves, plus the work a perfect server still does (decode, pre- and post-processing); no RPC, no queues.
For each photo: batch sweeps of each network on 1 and 2 intra-op threads, a timer split of one image's
steps (its total: the *single image*), and decode + ``run_pipeline`` end to end with the best batch sizes
in each layout (processes x threads): the best is the *ceiling*. The same on ONNX Runtime f32.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any
from unittest import mock

import numpy as np

import facecore.pipeline as pipeline_module
from bench.core.inputs import ServedModels, photo_label
from facecore.contract import Faces
from facecore.pipeline import NetworkInput, PipelineSettings, detector_input_size, network_input, run_pipeline
from facecore.processing import FloatArray, ImageArray, align_faces, decode_sized, letterbox
from facecore.runtimes import Runner, Runtime, runner

log = logging.getLogger(__name__)

DETECTOR_BATCHES = (1, 2, 4, 8)
EMBEDDER_BATCHES = (1, 2, 4, 8, 16, 32, 64)
THREADS = (1, 2)
#: (processes, intra-op threads per process) tried end to end.
LAYOUTS = ((1, 1), (1, 2), (2, 1))
STAGES = ("decode", "letterbox+tensor", "detector", "postprocess+NMS", "align", "embedder", "normalize",
          "blur", "other")
MODEL_STAGES = ("detector", "embedder")


def decode(data: bytes, settings: PipelineSettings) -> tuple[ImageArray, tuple[int, int]]:
    """``face_pipeline``'s decode: the image and its original (width, height)."""
    return decode_sized(data, settings.max_pixels, settings.decode_min_side)


def process(payloads: Sequence[bytes], settings: PipelineSettings, detector: pipeline_module.Detector,
            embedder: pipeline_module.Embedder) -> list[Faces]:
    """What ``face_pipeline`` does for one execute of these images (decode + ``run_pipeline``)."""
    decoded = [decode(data, settings) for data in payloads]
    return run_pipeline([image for image, _ in decoded], [settings.default_options] * len(decoded), settings,
                        detector, embedder, [size for _, size in decoded])


def median_seconds(call: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``repeats`` calls after one warm-up call."""
    call()
    times = []
    for _ in range(max(repeats, 1)):
        began = time.perf_counter()
        call()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def detector_input(data: bytes, settings: PipelineSettings) -> tuple[NetworkInput, tuple[int, int]]:
    """The photo as the detector sees it (``network_input``) and the input (width, height)."""
    image, _ = decode(data, settings)
    spec = settings.detector
    size = detector_input_size((image.shape[1], image.shape[0]), settings, settings.min_face_size)
    fill = spec.mean[::-1] if spec.swap_rb else spec.mean
    canvas, _ = letterbox(image, size[0], size[1], fill)
    return network_input(canvas[None], spec), size


def face_crops(data: bytes, models: ServedModels, settings: PipelineSettings) -> ImageArray:
    """The photo's aligned faces (so the embedder sweep runs on real crops)."""
    detector = models.detector()
    image, _ = decode(data, settings)
    found = pipeline_module.detect([image], [settings.default_options], settings, detector)[0]
    return align_faces(image, found.landmarks, settings.embedder.input_size[0])


def sweep(run: Runner, tensor: NetworkInput, batches: Sequence[int], repeats: int) -> dict[int, float]:
    """Milliseconds per item at each batch size: ``tensor``'s items repeated to fill the batch."""
    inputs = {b: np.resize(tensor, (b, *tensor.shape[1:])) for b in batches}
    return {b: 1000 * median_seconds(partial(run, inputs[b]), repeats) / b for b in batches}


def best(per_item: dict[int, float]) -> int:
    """The batch size with the lowest time per item (ties: the smaller batch)."""
    return min(per_item, key=lambda b: (round(per_item[b], 3), b))


class StageTimer:
    """Accumulates wall time per stage of one ``run_pipeline`` call by wrapping the functions it calls."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = dict.fromkeys(STAGES, 0.0)
        self.detector_called = False

    def wrap(self, stage: str | Callable[[], str], function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            name = stage if isinstance(stage, str) else stage()
            began = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.ms[name] += 1000 * (time.perf_counter() - began)
        return timed

    def _tensor_stage(self) -> str:  # to_tensor serves both networks: first the detector's input
        return "normalize" if self.detector_called else "letterbox+tensor"

    @contextmanager
    def installed(self) -> Iterator[None]:
        """Time the steps ``facecore.pipeline`` looks up in its module namespace at call time."""
        wrapped: dict[str, str | Callable[[], str]] = {
            "letterbox": "letterbox+tensor", "to_tensor": self._tensor_stage,
            "postprocess_detections": "postprocess+NMS", "align_faces": "align", "l2_normalize": "normalize",
            "blur_scores": "blur"}
        with ExitStack() as stack:
            for name, stage in wrapped.items():
                stack.enter_context(mock.patch.object(pipeline_module, name,
                                                      self.wrap(stage, getattr(pipeline_module, name))))
            yield


@dataclass
class StageSplit:
    """Median milliseconds per stage for one image, one request at a time."""

    threads: int
    faces: int
    total_ms: float
    stages_ms: dict[str, float]

    @property
    def outside_models_ms(self) -> float:
        return self.total_ms - sum(self.stages_ms[s] for s in MODEL_STAGES)


def stage_split(models: ServedModels, settings: PipelineSettings, data: bytes, threads: int,
                repeats: int) -> StageSplit:
    """decode + ``run_pipeline`` for one image, with a timer around every step; medians over ``repeats``."""
    detector, embedder = models.detector(threads), models.embedder(threads)
    faces = len(process([data], settings, detector, embedder)[0])  # warm-up
    runs: list[tuple[float, dict[str, float]]] = []
    for _ in range(max(repeats, 1)):
        timer = StageTimer()

        def detect(batch: FloatArray, timer: StageTimer = timer) -> tuple[FloatArray, FloatArray, FloatArray]:
            timer.detector_called = True
            return detector(batch)

        began = time.perf_counter()
        with timer.installed():
            image, size = timer.wrap("decode", decode)(data, settings)
            run_pipeline([image], [settings.default_options], settings, timer.wrap("detector", detect),
                         timer.wrap("embedder", embedder), [size])
        total = 1000 * (time.perf_counter() - began)
        timer.ms["other"] = total - sum(v for k, v in timer.ms.items() if k != "other")
        runs.append((total, timer.ms))
    return StageSplit(threads, faces, statistics.median(t for t, _ in runs),
                      {s: statistics.median(ms[s] for _, ms in runs) for s in STAGES})


@dataclass(frozen=True)
class WorkerJob:
    data: bytes
    settings: PipelineSettings  # the served ones with the layout's batch sizes
    models: ServedModels
    threads: int
    images_per_call: int
    seconds: float


def _worker(job: WorkerJob, barrier: Any, results: Any) -> None:
    """One process of an end-to-end run: one warm-up call, wait for the others, then calls until
    ``job.seconds`` have passed."""
    detector, embedder = job.models.detector(job.threads), job.models.embedder(job.threads)
    payloads = [job.data] * job.images_per_call
    process(payloads, job.settings, detector, embedder)
    barrier.wait()
    began, cpu = time.perf_counter(), time.process_time()
    images, elapsed = 0, 0.0
    while elapsed < job.seconds or images == 0:
        process(payloads, job.settings, detector, embedder)
        images += len(payloads)
        elapsed = time.perf_counter() - began
    results.put((images, elapsed, time.process_time() - cpu))


def end_to_end(job: WorkerJob, processes: int) -> tuple[float, float]:
    """Images/s of ``processes`` processes running ``job`` at the same time (summed), and the CPU
    milliseconds they spent per image."""
    context = multiprocessing.get_context("spawn")
    results, barrier = context.Queue(), context.Barrier(processes)
    workers = [context.Process(target=_worker, args=(job, barrier, results), daemon=True)
               for _ in range(processes)]
    for worker in workers:
        worker.start()
    try:
        done = [results.get(timeout=job.seconds * 4 + 600) for _ in workers]
    finally:
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.terminate()
    images = sum(n for n, _, _ in done)
    return float(sum(n / elapsed for n, elapsed, _ in done)), 1000 * sum(cpu for _, _, cpu in done) / images


def run_layout(models: ServedModels, data: bytes, settings: PipelineSettings, layout: Layout,
               seconds: float) -> None:
    """``layout`` end to end with its batch sizes: its images/s and CPU per image."""
    job = WorkerJob(data, replace(settings, detector_max_batch=layout.detector_batch,
                                  embedder_max_batch=layout.embedder_batch),
                    models, layout.threads, layout.images_per_call, seconds)
    layout.images_per_s, layout.cpu_ms_per_image = end_to_end(job, layout.processes)


@dataclass
class Layout:
    processes: int
    threads: int
    detector_batch: int
    embedder_batch: int
    images_per_call: int
    images_per_s: float = 0.0
    cpu_ms_per_image: float = 0.0


@dataclass
class PhotoCeiling:
    photo: str
    label: str
    sizing: str  # "dynamic" (face_pipeline's CPU profile) or "fixed"
    input_size: tuple[int, int]
    faces: int
    detector_ms: dict[int, dict[int, float]] = field(default_factory=dict)  # threads -> batch -> ms/image
    embedder_ms: dict[int, dict[int, float]] = field(default_factory=dict)  # threads -> batch -> ms/face
    splits: list[StageSplit] = field(default_factory=list)
    layouts: list[Layout] = field(default_factory=list)
    #: "served" (what face_pipeline serves: settings, files, runtime and precisions) or "onnxruntime" (the
    #: same files and settings on ONNX Runtime f32); the recorded runs also hold "fixed" and "plain" rows
    variant: str = "served"
    runtime: str = "onnxruntime f32"  # ServedModels.runtime (results before OpenVINO: ONNX Runtime)

    @property
    def single_image_ms(self) -> float:
        return min(s.total_ms for s in self.splits)

    @property
    def best_split(self) -> StageSplit:
        return min(self.splits, key=lambda s: s.total_ms)

    @property
    def images_per_s(self) -> float:
        return max((layout.images_per_s for layout in self.layouts), default=float("nan"))


@dataclass(frozen=True)
class CeilingOptions:
    seconds: float = 10.0
    repeats: int = 5  # per sweep point
    split_repeats: int = 15
    detector_batches: Sequence[int] = DETECTOR_BATCHES
    embedder_batches: Sequence[int] = EMBEDDER_BATCHES
    threads: Sequence[int] = THREADS
    layouts: Sequence[tuple[int, int]] = LAYOUTS


def measure_photo(models: ServedModels, name: str, data: bytes, options: CeilingOptions,
                  embedder_ms: dict[int, dict[int, float]], variant: str = "served") -> PhotoCeiling:
    """Detector sweep, stage splits and end-to-end runs in every layout for one photo, on the runtime of
    ``models``; ``embedder_ms`` is the embedder sweep (per thread count), which does not depend on the
    photo."""
    settings = models.settings
    sizing = "dynamic" if settings.dynamic_input else "fixed"
    tensor, size = detector_input(data, settings)
    faces = len(face_crops(data, models, settings))
    result = PhotoCeiling(name, photo_label(name, data), sizing, size, faces, embedder_ms=embedder_ms,
                          variant=variant, runtime=models.runtime)
    for threads in options.threads:
        log.info("%s %s, %s: detector sweep and stage split with %d thread(s)", name, sizing, models.runtime,
                 threads)
        run = runner(models.detector_file, settings.detector.output_names, models.detector_choice(threads))
        result.detector_ms[threads] = sweep(run, tensor, options.detector_batches, options.repeats)
        result.splits.append(stage_split(models, settings, data, threads, options.split_repeats))
    for processes, threads in options.layouts:
        if threads not in result.detector_ms:
            continue
        det = best(result.detector_ms[threads])
        emb = best(result.embedder_ms[threads]) if threads in result.embedder_ms else 1
        # Enough images per call that the embedder gets its best batch; a multiple of the detector's.
        per_call = max(det, det * math.ceil(emb / max(faces, 1) / det))
        log.info("%s %s: end to end, %d x %d, detector batch %d, embedder batch %d", name, sizing, processes,
                 threads, det, emb)
        result.layouts.append(layout := Layout(processes, threads, det, emb, per_call))
        run_layout(models, data, settings, layout, options.seconds)
    return result


def _embedder_sweeps(models: ServedModels, crops: ImageArray, options: CeilingOptions, what: str
                     ) -> dict[int, dict[int, float]]:
    sweeps = {}
    for threads in options.threads:
        log.info("%s embedder sweep (%s) with %d thread(s) on %d real faces", what, models.runtime, threads,
                 len(crops))
        spec = models.settings.embedder
        run = runner(models.embedder_file, spec.output_names, models.embedder_choice(threads))
        sweeps[threads] = sweep(run, network_input(crops, spec), options.embedder_batches, options.repeats)
    return sweeps


def run(models: ServedModels, photos: dict[str, bytes], options: CeilingOptions) -> list[PhotoCeiling]:
    """Every photo with what ``face_pipeline`` serves (``served``: its sizing, files, runtime and
    precisions), then the same files and settings on ONNX Runtime f32 (``onnxruntime``; skipped when the
    repository serves ONNX Runtime already), each with every layout."""
    crops = np.concatenate([face_crops(data, models, models.settings) for data in photos.values()])
    out = []
    for variant, run_models in (("served", models), ("onnxruntime", models.on_runtime(Runtime.ONNXRUNTIME))):
        if variant == "onnxruntime" and run_models == models:
            continue
        embedder_ms = _embedder_sweeps(run_models, crops, options, variant)
        out += [measure_photo(run_models, name, data, options, embedder_ms, variant)
                for name, data in photos.items()]
    return out

