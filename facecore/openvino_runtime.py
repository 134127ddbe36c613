"""OpenVINO for the detector and embedder on CPU: the default CPU runtime (ONNX Runtime stays selectable).

OpenVINO reads the same ONNX files. Its inference precision is set explicitly per network: ``bf16`` only
where the CPU executes bfloat16 natively (AVX-512 BF16 or AMX; OpenVINO lists ``BF16`` among the CPU's
optimization capabilities), the export timed it faster than f32 there and its accuracy check accepted
it, ``f32`` otherwise (OpenVINO would otherwise pick bf16 by itself on such CPUs, unchecked and untimed).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Sequence
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov

from facecore.processing import FloatArray

log = logging.getLogger(__name__)

#: Entries of a compiled model's cache of shape-specific primitives (OpenVINO's
#: ``CPU_RUNTIME_CACHE_CAPACITY``, 5000 by default). The detector's input follows each image's aspect ratio,
#: and each new input shape compiles and keeps about 70 primitives, never released. With the default,
#: Triton's memory grew with every new shape (a request's ``min_face_size`` shrinks both sides: hundreds
#: are possible). 500 entries keep about seven shapes' worth: the common aspect ratios stay compiled, a
#: rare shape compiles its primitives again, and the memory stays bounded.
RUNTIME_CACHE_CAPACITY = 500


class Precision(StrEnum):
    F32 = "f32"
    BF16 = "bf16"


@functools.cache
def core() -> ov.Core:
    return ov.Core()


def bf16_supported() -> bool:
    """Whether this CPU runs bfloat16 natively (OpenVINO's own capability list)."""
    return "BF16" in core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")


def usable_precision(wanted: Precision) -> Precision:
    """``wanted``, or f32 where the CPU has no bfloat16 (a repository exported on another machine)."""
    if wanted is Precision.BF16 and not bf16_supported():
        log.warning("bf16 was chosen at export but this CPU has no native bfloat16: running f32")
        return Precision.F32
    return wanted


def compile_model(path: str | Path, precision: Precision, threads: int = 0) -> ov.CompiledModel:
    """A CPU compiled model: one stream (Triton runs instances in parallel), ``threads`` 0 = all cores,
    latency hint, the precision set explicitly and a bounded cache of shape-specific primitives."""
    return compile_models(path, precision, [threads])[0]


def compile_models(path: str | Path, precision: Precision, threads: Sequence[int]) -> list[ov.CompiledModel]:
    """The network compiled once per thread count, from one read of the file (the copies then hold only
    their compiled form, not another copy of the weights)."""
    model = core().read_model(str(path))
    compiled = []
    for count in threads:
        config: dict[str, Any] = {
            "INFERENCE_PRECISION_HINT": precision.value,
            "PERFORMANCE_HINT": "LATENCY",
            "NUM_STREAMS": 1,
            "ENABLE_CPU_PINNING": False,  # several processes share the cores: do not pin threads
            "CPU_RUNTIME_CACHE_CAPACITY": RUNTIME_CACHE_CAPACITY,  # bounded memory across input shapes
        }
        if count > 0:
            config["INFERENCE_NUM_THREADS"] = count
        compiled.append(core().compile_model(model, "CPU", config))
    return compiled


class Network:
    """One compiled model, one infer request per calling thread (an infer request is not thread-safe)."""

    def __init__(self, compiled: ov.CompiledModel) -> None:
        self._compiled = compiled
        self._local = threading.local()

    def __call__(self, batch: np.ndarray[Any, Any]) -> list[FloatArray]:
        return self.run(batch)

    def run(self, batch: np.ndarray[Any, Any]) -> list[FloatArray]:
        request = getattr(self._local, "request", None)
        if request is None:
            request = self._local.request = self._compiled.create_infer_request()
        request.infer({0: batch}, share_inputs=True)
        return [np.array(request.get_output_tensor(i).data, dtype=np.float32)
                for i in range(len(self._compiled.outputs))]
