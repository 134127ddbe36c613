"""The plain baseline's models: what a straightforward deployment of the same two networks runs.

``face_pipeline`` (the *served* settings) does less work than the obvious approach, without changing its
decisions: the detector input follows each image's aspect ratio (``dynamic_input``: fewer pixels per
image than a 640x640 letterbox) and SFace's PReLU is rewritten as ``Relu(x) - a * Relu(-x)``
(``export.onnx_tools.rewrite_prelu``: fewer embedder ms per face in ONNX Runtime). The *plain* variant
undoes both: the fixed 640x640 letterbox (``dynamic_input=False``, full-size JPEG decode) and SFace
converted from the pinned int8 file with ``fold_weight_dequantization`` + ``make_batch_dynamic`` only
(``artifacts/onnx/sface_2021dec.fp32.bdyn.112x112.prelu.onnx``, built once and reused).

``prepare`` builds (or reuses) that file and proves it is the served network: its embeddings equal the
served embedder's within ``TOLERANCE`` on real aligned faces (and their mirror images).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx

from bench.common import ARTIFACTS, ServedModels
from export.onnx_tools import fold_weight_dequantization, make_batch_dynamic, save_checked
from facecore.onnx_runtime import OnnxDetector, create_session
from facecore.pipeline import PipelineSettings, detect
from facecore.processing import ImageArray, align_faces, decode_image, to_tensor

log = logging.getLogger(__name__)

#: The pinned int8 SFace (``python -m export defaults`` fetches it) and its conversion without the rewrite.
SHIPPED_SFACE = ARTIFACTS / "onnx" / "sface_2021dec.int8bq.b1.112x112.onnx"
PLAIN_EMBEDDER = ARTIFACTS / "onnx" / "sface_2021dec.fp32.bdyn.112x112.prelu.onnx"
#: Largest |difference| allowed between the plain and the served embedder (as export.defaults allows).
TOLERANCE = 1e-4
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


def prelu_nodes(path: Path) -> int:
    model = onnx.load(str(path), load_external_data=False)
    return sum(node.op_type == "PRelu" for node in model.graph.node)


def build_embedder(source: Path = SHIPPED_SFACE, target: Path = PLAIN_EMBEDDER) -> bool:
    """Convert the shipped int8 SFace to fp32 with a dynamic batch, PReLU kept; False when ``target``
    already exists (reused)."""
    if target.exists():
        return False
    if not source.exists():
        raise FileNotFoundError(f"{source} is missing: run `python -m export defaults` first")
    log.info("converting %s -> %s (no PReLU rewrite)", source.name, target.name)
    save_checked(make_batch_dynamic(fold_weight_dequantization(onnx.load(str(source)))), target)
    return True


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


def max_difference(served: Path, plain: Path, crops: ImageArray, settings: PipelineSettings) -> float:
    """Largest |difference| of the raw embeddings of the two files on the same batch."""
    spec = settings.embedder
    batch = to_tensor(crops, spec.swap_rb, spec.mean, spec.std)
    outputs = [create_session(path, 1).run([spec.output_names[0]], {spec.input_name: batch})[0]
               for path in (served, plain)]
    return float(np.abs(outputs[0] - outputs[1]).max())


def prepare(models: ServedModels, photos: Mapping[str, bytes], target: Path = PLAIN_EMBEDDER,
            source: Path = SHIPPED_SFACE) -> PlainModels:
    """Build (or reuse) the plain embedder and check it against the served one; raises when it is not
    the same network (no PReLU, or embeddings further apart than ``TOLERANCE``)."""
    built = build_embedder(source, target)
    count = prelu_nodes(target)
    if count == 0:
        raise RuntimeError(f"{target} has no PRelu node: not the plain SFace conversion")
    crops = aligned_faces(models, photos)
    if len(crops) == 0:
        raise RuntimeError("no face found to compare the plain and the served embedder on")
    difference = max_difference(models.embedder_file, target, crops, models.settings)
    log.info("plain embedder %s: %d PRelu nodes, max |diff| %.2e vs the served one on %d faces",
             target.name, count, difference, len(crops))
    if not difference <= TOLERANCE:
        raise RuntimeError(f"{target.name} differs from the served embedder {models.embedder_file} by "
                           f"{difference:.2e} (> {TOLERANCE:g}): not the same network")
    plain = replace(models, settings=plain_settings(models.settings), embedder_file=target,
                    summary=f"plain: fixed {'x'.join(map(str, models.settings.detector.input_size))} "
                            f"detector input, {target.name}")
    return PlainModels(plain, count, prelu_nodes(models.embedder_file), len(crops), difference, built)
