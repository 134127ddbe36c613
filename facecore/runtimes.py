"""Which runtime runs a network on CPU, at which precision: one place that builds them all.

Used by the CPU profile's Triton models (``model_repository/onnx_model``, and ``face_pipeline`` in its
in-process layout), the export's precision checks and the benchmarks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np

from facecore.onnx_runtime import create_session
from facecore.pipeline import Detector, Embedder, NetworkInput
from facecore.processing import FloatArray
from facecore.spec import ModelSpec

#: A network as a function: one input batch -> its outputs in ``output_names`` order.
Runner = Callable[[np.ndarray[Any, Any]], list[FloatArray]]


class Runtime(StrEnum):
    OPENVINO = "openvino"
    ONNXRUNTIME = "onnxruntime"


@dataclass(frozen=True)
class RuntimeChoice:
    runtime: Runtime = Runtime.OPENVINO
    #: ``f32`` or ``bf16`` (OpenVINO only; ONNX Runtime always runs f32).
    precision: str = "f32"
    threads: int = 0  # 0: one per core
    spinning: bool = True  # ONNX Runtime: idle worker threads busy-wait


def runner(path: str | Path, output_names: Sequence[str], choice: RuntimeChoice) -> Runner:
    if choice.runtime is Runtime.OPENVINO:
        from facecore.openvino_runtime import Network, Precision, compile_model, usable_precision

        compiled = compile_model(path, usable_precision(Precision(choice.precision)), choice.threads)
        names = [output.get_any_name() for output in compiled.outputs]
        order = [names.index(name) for name in output_names]
        network = Network(compiled)

        def run(batch: np.ndarray[Any, Any]) -> list[FloatArray]:
            outputs = network(batch)  # one inference, its outputs in ``output_names`` order
            return [outputs[i] for i in order]

        return run
    session = create_session(path, intra_op_threads=choice.threads, spinning=choice.spinning)
    input_name = session.get_inputs()[0].name
    names = list(output_names)
    return lambda batch: [np.asarray(o, dtype=np.float32) for o in session.run(names, {input_name: batch})]


def detector(spec: ModelSpec, path: str | Path, choice: RuntimeChoice) -> Detector:
    """A ``facecore.pipeline.Detector`` on the chosen runtime."""
    run = runner(path, spec.output_names, choice)

    def detect(batch: NetworkInput) -> tuple[FloatArray, FloatArray, FloatArray]:
        loc, conf, landmarks = run(batch)
        return loc, conf, landmarks

    return detect


def embedder(spec: ModelSpec, path: str | Path, choice: RuntimeChoice) -> Embedder:
    """A ``facecore.pipeline.Embedder`` on the chosen runtime."""
    run = runner(path, spec.output_names, choice)

    def embed(batch: NetworkInput) -> FloatArray:
        return run(batch)[0]

    return embed
