"""``facecore.pipeline`` in-process with the real ONNX models: what the model descriptions change."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from export.defaults import DefaultModels
from facecore.onnx_runtime import OnnxDetector, OnnxEmbedder, create_session
from facecore.pipeline import PipelineSettings, run_pipeline
from facecore.processing import FloatArray, decode_image


def test_detector_giving_logits_is_softmaxed_when_its_description_says_so(
    default_models: DefaultModels, photo_bytes: dict[str, bytes]
) -> None:
    """A RetinaFace export whose ``conf`` output is raw logits (``conf_softmax = false``) finds the same faces
    as the softmaxed one; without the flag the logits would be read as probabilities."""
    softmaxed = OnnxDetector(default_models.detector, create_session(default_models.detector_file))
    embedder = OnnxEmbedder(default_models.embedder, create_session(default_models.embedder_file))

    def logits(batch: FloatArray) -> tuple[FloatArray, FloatArray, FloatArray]:
        loc, conf, landmarks = softmaxed(batch)
        return loc, np.log(np.clip(conf, 1e-12, None)).astype(np.float32), landmarks

    settings = PipelineSettings(default_models.detector, default_models.embedder)
    raw = PipelineSettings(replace(default_models.detector, conf_softmax=False), default_models.embedder)
    image = decode_image(photo_bytes["t1.jpg"], settings.max_pixels)
    (expected,) = run_pipeline([image], [settings.default_options], settings, softmaxed, embedder)
    (found,) = run_pipeline([image], [raw.default_options], raw, logits, embedder)
    assert len(expected) == len(found) == 6
    np.testing.assert_allclose(found.scores, expected.scores, atol=1e-5)
    np.testing.assert_allclose(found.boxes, expected.boxes, atol=1e-3)
    (misread,) = run_pipeline([image], [settings.default_options], settings, logits, embedder)
    assert len(misread) != 6  # log-probabilities read as probabilities: the flag matters
