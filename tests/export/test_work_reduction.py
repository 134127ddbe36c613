"""Doing less work must not change the answers: the CPU profile's work reductions (detector input
sized to each image, PReLU rewritten for ONNX Runtime) against the plain pipeline (fixed 640x640,
SFace as converted without the rewrite), on every face of the test photos."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import cv2
import numpy as np
import pytest

from export.defaults import DefaultModels
from export.sface import SHIPPED_FILE, TOLERANCE, convert_plain_sface, embedding_difference, prelu_nodes
from facecore.onnx_runtime import OnnxDetector, OnnxEmbedder, create_session
from facecore.pipeline import PipelineSettings, run_pipeline
from facecore.processing import FloatArray

PHOTOS = ["obama.jpg", "obama2.jpg", "obama3.jpg", "biden.jpg", "t1.jpg", "astronaut.png"]


def embeddings(settings: PipelineSettings, detector_file: Path, embedder_file: Path,
               photos: dict[str, Path]) -> list[FloatArray]:
    detector = OnnxDetector(settings.detector, create_session(detector_file, 1))
    embedder = OnnxEmbedder(settings.embedder, create_session(embedder_file, 1))
    images = [cv2.imread(str(photos[name]), cv2.IMREAD_COLOR) for name in PHOTOS]
    results = run_pipeline(images, [settings.default_options] * len(images), settings, detector, embedder)
    return [r.embeddings for r in results]


@pytest.fixture(scope="module")
def plain_embedder(default_models: DefaultModels, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SFace converted without the PReLU rewrite (``export.sface``, as the benchmark's plain baseline)."""
    shipped = default_models.embedder_file.parent / SHIPPED_FILE
    target = tmp_path_factory.mktemp("plain") / "sface_prelu.onnx"
    assert convert_plain_sface(shipped, target) and prelu_nodes(target) > 0
    return target


def test_reduced_work_keeps_every_decision(default_models: DefaultModels, plain_embedder: Path,
                                           photos: dict[str, Path]) -> None:
    served = PipelineSettings(default_models.detector, default_models.embedder, dynamic_input=True)
    plain = replace(served, dynamic_input=False)
    fast = embeddings(served, default_models.detector_file, default_models.embedder_file, photos)
    slow = embeddings(plain, default_models.detector_file, plain_embedder, photos)
    assert [len(f) for f in fast] == [len(s) for s in slow] == [1, 1, 1, 1, 6, 1]
    fast_all, slow_all = np.concatenate(fast), np.concatenate(slow)
    # the same faces, embedded (nearly) alike: detections differ by a few pixels at another input size
    assert np.min(np.sum(fast_all * slow_all, axis=1)) >= 0.99  # measured: 0.998 at worst
    threshold = default_models.embedder.match_threshold
    pairs = list(itertools.combinations(range(len(fast_all)), 2))
    decisions_fast = [bool(fast_all[i] @ fast_all[j] >= threshold) for i, j in pairs]
    decisions_slow = [bool(slow_all[i] @ slow_all[j] >= threshold) for i, j in pairs]
    assert decisions_fast == decisions_slow
    assert sum(decisions_fast) == 3  # the three photos of the same person, and nothing else


def test_prelu_rewrite_alone_is_exact(default_models: DefaultModels, plain_embedder: Path) -> None:
    crops = np.random.default_rng(0).integers(0, 256, (4, 112, 112, 3)).astype(np.uint8)
    difference = embedding_difference(default_models.embedder_file, plain_embedder, crops,
                                      default_models.embedder)
    assert difference <= TOLERANCE
