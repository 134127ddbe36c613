"""The GPU benchmark's *precision* part (``bench/gpu.py``): float16 and float32 put through the check a
TensorRT plan must pass (``export.engine_check``: the same faces, box IoU, decisions; embedding cosine),
with PyTorch running the ONNX files in place of the plans; and for the detector, what moved."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from facecore.pipeline import PipelineSettings

log = logging.getLogger(__name__)

#: (name, reduced, TF32) of the precision checks on a GPU: float32 as cuDNN and cuBLAS run it by default
#: (TF32 tensor cores, as TensorRT's FP32 builds do by default), strict float32, float16.
GPU_PRECISIONS = (("float32 (tf32 allowed)", False, True), ("float32 (tf32 off)", False, False),
                  ("float16", True, False))
CPU_PRECISIONS = (("float32", False, False),)


def check(detector: Path, embedder: Path, photos: Path, settings: PipelineSettings, device: str
          ) -> list[dict[str, Any]]:
    """``export.engine_check``'s checks with the ONNX files run by PyTorch in place of TensorRT plans, and
    for the detector what moved: every decision that changed, and the largest change of each measure the
    decisions are made from."""
    import torch

    from export.engine_check import EngineChecker, _detector, _embedder, load_check_images, onnx_runner
    from export.onnx_torch import torch_runner
    from facecore.pipeline import run_pipeline

    rows = []
    images = load_check_images(photos)
    reference = EngineChecker(settings, images, onnx_runner).reference(detector, embedder)
    backends = torch.backends
    saved = (backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32)
    try:
        for precision, reduced, tf32 in GPU_PRECISIONS if device.startswith("cuda") else CPU_PRECISIONS:
            backends.cuda.matmul.allow_tf32 = backends.cudnn.allow_tf32 = tf32
            checker = EngineChecker(settings, images, partial(torch_runner, device=device, reduced=reduced))
            checker._references[(detector, embedder)] = reference  # computed once for every variant
            for check in (checker.check_detector(detector, detector, embedder, precision),
                          checker.check_embedder(embedder, embedder, detector, precision)):
                row = {**asdict(check), "runtime": f"pytorch {device}"}
                if check.network == "detector":
                    got = run_pipeline(images, [settings.default_options] * len(images), settings,
                                       _detector(torch_runner(detector, settings.detector.output_names,
                                                              device, reduced)),
                                       _embedder(onnx_runner(embedder, settings.embedder.output_names)))
                    row |= moved(reference, got, settings.embedder.match_threshold)
                rows.append(row)
                log.info("precision (PyTorch on %s): %s; changed: %s", device,
                         check.summary().replace("tensorrt ", ""), row.get("changed", []))
    finally:
        backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32 = saved
    return rows


def moved(reference: Sequence[Any], candidate: Sequence[Any], threshold: float) -> dict[str, Any]:
    """What a candidate pipeline changed against the reference: each changed decision with the values it
    was made from (``export.precision.decision_changes``), and the largest change of each measure."""
    from export.precision import decision_changes, matched, qualities

    pairs = [matched(r, c) for r, c in zip(reference, candidate, strict=True)]
    if any(len(r) != len(c) for r, c in zip(reference, pairs, strict=True)):
        return {"changed": [{"kind": "faces", "what": "another number of faces"}], "largest_change": {}}
    largest: dict[str, float] = {}
    for r, c in zip(reference, pairs, strict=True):
        for a, b in zip(qualities(r), qualities(c), strict=True):
            for key, value in asdict(a).items():
                relative = abs(asdict(b)[key] - value) / max(abs(value), 1e-9)
                largest[key] = max(largest.get(key, 0.0), relative)
    ref_all = np.concatenate([r.embeddings for r in reference])
    got_all = np.concatenate([c.embeddings for c in pairs])
    pair_change = np.abs(ref_all @ ref_all.T - got_all @ got_all.T)
    largest["pair_cosine_absolute"] = float(pair_change.max(initial=0.0))
    return {"changed": decision_changes(reference, pairs, threshold), "largest_change": largest}
