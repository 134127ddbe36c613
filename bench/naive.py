"""The naive baselines: ``bench/naive_app.py`` served by uvicorn in a subprocess, loaded with multipart
JPEG uploads in a closed loop (``measure_once``): *served* (the work ``face_pipeline`` does) and *plain*.

``face_pipeline`` does less work than the obvious approach without changing its decisions; *plain* undoes
all of it: ONNX Runtime f32, the original float NCHW detector, a fixed 640x640 letterbox, full-size
decode, and SFace converted from the pinned int8 file without the PReLU rewrite
(``export.sface.convert_plain_sface``). ``prepare`` proves the embedder is the served network (the
detector's uint8 edit is checked against this float file by tests/export/test_onnx_tools.py).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from bench.core.inputs import ARTIFACTS, ServedModels
from bench.core.load import LoadRow, MultipartSender, run_load
from bench.core.processes import Watched, free_port, start_server
from bench.naive_app import runtime_text
from export.sface import (
    PLAIN_FILE,
    SHIPPED_FILE,
    TOLERANCE,
    check_same_network,
    convert_plain_sface,
    prelu_nodes,
)
from facecore.pipeline import PipelineSettings, detect
from facecore.processing import ImageArray, align_faces, decode_image
from facecore.runtimes import Runtime, RuntimeChoice
from facecore.spec import InputLayout
from service.launcher import stop_process

log = logging.getLogger(__name__)

#: Intra-op threads per session: on the recorded 2-core run, 2 lost at every concurrency.
THREADS = 1
SERVED, PLAIN = "served", "plain"
VARIANTS = (SERVED, PLAIN)

#: The plain variant's networks: SFace without the PReLU rewrite, the detector before the uint8 edit.
SHIPPED_SFACE = ARTIFACTS / "onnx" / SHIPPED_FILE
PLAIN_EMBEDDER = ARTIFACTS / "onnx" / PLAIN_FILE
PLAIN_DETECTOR = ARTIFACTS / "onnx" / "retinaface_mnet025.fp32.bdyn.hwdyn.onnx"
ONNXRUNTIME = RuntimeChoice(Runtime.ONNXRUNTIME, "f32", 1)


@dataclass(frozen=True)
class PlainModels:
    """The plain variant's models and the check that its embedder is the served network."""

    models: ServedModels
    prelu_nodes: int  # PRelu nodes in the plain embedder
    served_prelu_nodes: int  # ... and in the served one (0 once rewritten)
    faces: int  # aligned faces the two embedders were compared on
    max_abs_diff: float
    built: bool  # converted in this run (False: an existing file was reused)

    def describe(self) -> str:
        return (f"`{self.models.embedder_file.name}` ({self.prelu_nodes} PRelu nodes; the served embedder "
                f"has {self.served_prelu_nodes}) gives the served embeddings within {self.max_abs_diff:.1e} "
                f"(<= {TOLERANCE:g}) on {self.faces} aligned faces; the detector: "
                f"`{self.models.detector_file.name}` (float NCHW)")


def plain_settings(settings: PipelineSettings) -> PipelineSettings:
    """The served settings without the work reductions."""
    return replace(settings, dynamic_input=False, decode_min_side=0,
                   detector=replace(settings.detector, input_layout=InputLayout.NCHW_FLOAT))


def plain_models(models: ServedModels, embedder_file: Path = PLAIN_EMBEDDER,
                 detector_file: Path = PLAIN_DETECTOR) -> ServedModels:
    """What the plain variant runs (``prepare`` checks it)."""
    size = "x".join(map(str, models.settings.detector.input_size))
    return replace(models, settings=plain_settings(models.settings), detector_file=detector_file,
                   embedder_file=embedder_file, detector_runtime=ONNXRUNTIME, embedder_runtime=ONNXRUNTIME,
                   summary=f"plain: ONNX Runtime f32, fixed {size} detector input, {detector_file.name}, "
                           f"{embedder_file.name}")


def aligned_faces(models: ServedModels, photos: Mapping[str, bytes]) -> ImageArray:
    """Every face the served detector finds in ``photos``, aligned, plus each mirrored."""
    settings = models.settings
    detector = models.detector(1)
    images = [decode_image(data, settings.max_pixels) for data in photos.values()]
    found = detect(images, [settings.default_options] * len(images), settings, detector)
    size = settings.embedder.input_size[0]
    crops = np.concatenate([align_faces(image, faces.landmarks, size)
                            for image, faces in zip(images, found, strict=True)])
    return np.concatenate([crops, crops[:, :, ::-1]])


def prepare(models: ServedModels, photos: Mapping[str, bytes], target: Path = PLAIN_EMBEDDER,
            source: Path = SHIPPED_SFACE, detector_file: Path = PLAIN_DETECTOR) -> PlainModels:
    """Build (or reuse) the plain embedder and check it against the served one on every face found and
    its mirror image; raises when it is not the same network."""
    if not detector_file.exists():
        raise FileNotFoundError(f"no original detector at {detector_file}: run `python -m export defaults`")
    built = convert_plain_sface(source, target)
    count = prelu_nodes(target)
    if count == 0:
        raise RuntimeError(f"{target} has no PRelu node: not the plain SFace conversion")
    crops = aligned_faces(models, photos)
    try:
        difference = check_same_network(models.embedder_file, target, crops, models.settings.embedder)
    except ValueError as exc:
        raise RuntimeError(f"the plain embedder is not the served network: {exc}") from exc
    log.info("plain embedder %s: %d PRelu nodes, max |diff| %.2e vs the served one on %d faces",
             target.name, count, difference, len(crops))
    return PlainModels(plain_models(models, target, detector_file), count, prelu_nodes(models.embedder_file),
                       len(crops), difference, built)


@dataclass(frozen=True)
class NaiveServer:
    url: str
    pid: int
    threads: int
    variant: str = SERVED


def target_name(threads: int, variant: str = SERVED) -> str:
    return f"naive {variant} /embed, {threads} intra-op thread{'s' if threads != 1 else ''}"


@contextmanager
def naive_server(models: ServedModels, threads: int, variant: str = SERVED,
                 log_file: Path = ARTIFACTS / "bench-naive.log") -> Iterator[NaiveServer]:
    """uvicorn serving ``bench.naive_app:app`` on a free port (one worker process). ``models``: what the
    variant runs (the served models, or ``prepare``'s plain ones)."""
    port = free_port()
    env = {**os.environ, "NAIVE_SETTINGS": json.dumps(models.settings.to_parameters()),
           "NAIVE_DETECTOR_ONNX": str(models.detector_file), "NAIVE_EMBEDDER_ONNX": str(models.embedder_file),
           "NAIVE_DETECTOR_RUNTIME": runtime_text(models.detector_runtime),
           "NAIVE_EMBEDDER_RUNTIME": runtime_text(models.embedder_runtime),
           "NAIVE_INTRA_OP_THREADS": str(threads), "NAIVE_VARIANT": variant}
    command = [sys.executable, "-m", "uvicorn", "bench.naive_app:app", "--host", "127.0.0.1", "--port",
               str(port), "--no-access-log", "--log-level", "warning"]
    url = f"http://127.0.0.1:{port}"
    process = start_server(command, env, log_file, f"{url}/health")
    try:
        yield NaiveServer(url, process.pid, threads, variant)
    finally:
        stop_process(process)


def measure_once(server: NaiveServer, name: str, data: bytes, concurrency: int, seconds: float) -> LoadRow:
    """One closed-loop run of multipart uploads against ``POST /embed``."""
    with MultipartSender(f"{server.url}/embed", "image", name, data) as sender:
        row = run_load(target_name(server.threads, server.variant), name, sender, concurrency, seconds,
                       [Watched("naive", server.pid, tree=False)])
    log.info("naive %s, %d thread(s), %s c=%d: %.1f images/s", server.variant, server.threads, name,
             concurrency, row.throughput)
    return row
