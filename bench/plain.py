"""The plain baseline's models: what a straightforward deployment of the same two networks runs.

``face_pipeline`` (the *served* settings) does less work than the obvious approach, without changing its
decisions: the detector input follows each image's aspect ratio (``dynamic_input``: fewer pixels per
image than a 640x640 letterbox) and SFace's PReLU is rewritten as ``Relu(x) - a * Relu(-x)``
(``export.onnx_tools.rewrite_prelu``: fewer embedder ms per face in ONNX Runtime). The *plain* variant
undoes both: the fixed 640x640 letterbox (``dynamic_input=False``, full-size JPEG decode) and SFace
converted from the pinned int8 file with ``fold_weight_dequantization`` + ``make_batch_dynamic`` only
(``export.sface.convert_plain_sface`` -> ``artifacts/onnx/sface_2021dec.fp32.bdyn.112x112.prelu.onnx``,
built once and reused).

``prepare`` builds (or reuses) that file and proves it is the served network
(``export.sface.check_same_network``): its embeddings equal the served embedder's within ``TOLERANCE``
on every face the served detector finds in the benchmark's photos (and their mirror images).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from bench.core.inputs import ARTIFACTS, ServedModels
from export.sface import (
    PLAIN_FILE,
    SHIPPED_FILE,
    TOLERANCE,
    check_same_network,
    convert_plain_sface,
    prelu_nodes,
)
from facecore.onnx_runtime import OnnxDetector, create_session
from facecore.pipeline import PipelineSettings, detect
from facecore.processing import ImageArray, align_faces, decode_image

log = logging.getLogger(__name__)

#: The pinned int8 SFace (``python -m export defaults`` fetches it) and its conversion without the rewrite.
SHIPPED_SFACE = ARTIFACTS / "onnx" / SHIPPED_FILE
PLAIN_EMBEDDER = ARTIFACTS / "onnx" / PLAIN_FILE
SERVED, PLAIN = "served", "plain"
VARIANTS = (SERVED, PLAIN)


@dataclass(frozen=True)
class PlainModels:
    """The plain variant's models and the check that its embedder is the served network."""

    models: ServedModels  # plain settings (fixed input, full decode), served detector, PReLU embedder
    prelu_nodes: int  # PRelu nodes in the plain embedder
    served_prelu_nodes: int  # ... and in the served one (0 once rewritten)
    faces: int  # aligned faces the two embedders were compared on
    max_abs_diff: float
    built: bool  # converted in this run (False: an existing file was reused)

    def describe(self) -> str:
        return (f"`{self.models.embedder_file.name}` ({self.prelu_nodes} PRelu nodes; the served embedder "
                f"has {self.served_prelu_nodes}) gives the served embeddings within {self.max_abs_diff:.1e} "
                f"(<= {TOLERANCE:g}) on {self.faces} aligned faces")


def plain_settings(settings: PipelineSettings) -> PipelineSettings:
    """The served settings without the work reductions: fixed detector input, full-size decode."""
    return replace(settings, dynamic_input=False, decode_min_side=0)


def aligned_faces(models: ServedModels, photos: Mapping[str, bytes]) -> ImageArray:
    """Every face the served detector finds in ``photos``, aligned, plus each mirrored."""
    settings = models.settings
    detector = OnnxDetector(settings.detector, create_session(models.detector_file, 1))
    images = [decode_image(data, settings.max_pixels) for data in photos.values()]
    found = detect(images, [settings.default_options] * len(images), settings, detector)
    size = settings.embedder.input_size[0]
    crops = np.concatenate([align_faces(image, faces.landmarks, size)
                            for image, faces in zip(images, found, strict=True)])
    return np.concatenate([crops, crops[:, :, ::-1]])


def prepare(models: ServedModels, photos: Mapping[str, bytes], target: Path = PLAIN_EMBEDDER,
            source: Path = SHIPPED_SFACE) -> PlainModels:
    """Build (or reuse) the plain embedder and check it against the served one; raises when it is not
    the same network (no PReLU, or embeddings further apart than ``TOLERANCE``)."""
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
    plain = replace(models, settings=plain_settings(models.settings), embedder_file=target,
                    summary=f"plain: fixed {'x'.join(map(str, models.settings.detector.input_size))} "
                            f"detector input, {target.name}")
    return PlainModels(plain, count, prelu_nodes(models.embedder_file), len(crops), difference, built)
