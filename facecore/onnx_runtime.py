"""ONNX Runtime sessions for the detector and embedder, in-process.

Used by the CPU profile's Triton models (``model_repository/onnx_model``), by the export checks and
by the benchmarks' ceiling and naive baseline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from numpy.typing import NDArray

from facecore.processing import FloatArray
from facecore.spec import ModelSpec


def create_session(
    path: str | Path, intra_op_threads: int = 0, inter_op_threads: int = 1, spinning: bool = True
) -> ort.InferenceSession:
    """A CPU session; 0 threads lets ONNX Runtime use one per core.

    ``spinning=False`` stops idle worker threads from busy-waiting for work: right when several
    processes (Triton's model instances) share few cores, where spinning threads burn the CPU the
    other models need.
    """
    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = inter_op_threads
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


class OnnxDetector:
    """``facecore.pipeline.Detector`` backed by an in-process ONNX Runtime session."""

    def __init__(self, spec: ModelSpec, session: ort.InferenceSession) -> None:
        self._spec, self._session = spec, session

    def __call__(self, batch: NDArray[Any]) -> tuple[FloatArray, FloatArray, FloatArray]:
        loc, conf, landms = self._session.run(list(self._spec.output_names), {self._spec.input_name: batch})
        return np.asarray(loc), np.asarray(conf), np.asarray(landms)


class OnnxEmbedder:
    """``facecore.pipeline.Embedder`` backed by an in-process ONNX Runtime session."""

    def __init__(self, spec: ModelSpec, session: ort.InferenceSession) -> None:
        self._spec, self._session = spec, session

    def __call__(self, batch: NDArray[Any]) -> FloatArray:
        (out,) = self._session.run(list(self._spec.output_names), {self._spec.input_name: batch})
        return np.asarray(out, dtype=np.float32)
