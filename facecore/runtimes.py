"""Which runtime runs a network on CPU, at which precision: one place that builds them all.

Used by the CPU profile's Triton models (``model_repository/onnx_model``, and ``face_pipeline`` in its
in-process layout), the export's precision checks and the benchmarks.
"""

from __future__ import annotations

import itertools
import os
import platform
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
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
    #: Run a batch as calls of at most this many items, split evenly (0: one call). On one thread a few
    #: faces at a time run faster per face than many: their activations stay in the core's cache.
    sub_batch: int = 0


@dataclass(frozen=True)
class Solo:
    """A second copy of a network with more threads, for the calls made while ``alone()`` says no other
    instance is working (a lone request gets every core; requests side by side keep one thread each)."""

    threads: int
    alone: Callable[[], bool]


def runner(path: str | Path, output_names: Sequence[str], choice: RuntimeChoice, solo: Solo | None = None
           ) -> Runner:
    """The network at ``path`` on the chosen runtime; with ``solo`` (more threads than ``choice``), compiled
    twice — from one read of the file on OpenVINO — and each call runs the copy that fits the moment."""
    counts = [choice.threads] + ([solo.threads] if solo is not None and solo.threads > choice.threads else [])
    if choice.runtime is Runtime.OPENVINO:
        from facecore.openvino_runtime import Precision, compile_models, usable_precision

        compiled = compile_models(path, usable_precision(Precision(choice.precision)), counts)
        runs = [_openvino_runner(c, output_names) for c in compiled]
    else:
        runs = [_onnxruntime_runner(path, output_names, replace(choice, threads=n)) for n in counts]
    shared = sub_batched(runs[0], choice.sub_batch)
    if len(runs) == 1 or solo is None:
        return shared
    return either(solo.alone, runs[1], shared)  # the solo copy's threads share one batch: run it whole


def even_parts(count: int, most: int) -> list[slice]:
    """``count`` items as the fewest parts of at most ``most`` items, their sizes differing by one at most
    (10 by 4: 3, 3, 4 — not 4, 4, 2)."""
    parts = -(-count // most)
    bounds = [count * k // parts for k in range(parts + 1)]
    return [slice(start, stop) for start, stop in itertools.pairwise(bounds)]


def sub_batched(run: Runner, most: int) -> Runner:
    """``run`` taking a batch of any size as calls of at most ``most`` items (see ``RuntimeChoice``)."""
    if most <= 0:
        return run

    def split(batch: np.ndarray[Any, Any]) -> list[FloatArray]:
        if len(batch) <= most:
            return run(batch)
        results = [run(batch[part]) for part in even_parts(len(batch), most)]
        return [np.concatenate(outputs) for outputs in zip(*results, strict=True)]

    return split


def _openvino_runner(compiled: Any, output_names: Sequence[str]) -> Runner:
    from facecore.openvino_runtime import Network

    names = [output.get_any_name() for output in compiled.outputs]
    order = [names.index(name) for name in output_names]
    network = Network(compiled)

    def run(batch: np.ndarray[Any, Any]) -> list[FloatArray]:
        outputs = network(batch)  # one inference, its outputs in ``output_names`` order
        return [outputs[i] for i in order]

    return run


def _onnxruntime_runner(path: str | Path, output_names: Sequence[str], choice: RuntimeChoice) -> Runner:
    session = create_session(path, intra_op_threads=choice.threads, spinning=choice.spinning)
    input_name = session.get_inputs()[0].name
    names = list(output_names)
    return lambda batch: [np.asarray(o, dtype=np.float32) for o in session.run(names, {input_name: batch})]


def detector(spec: ModelSpec, path: str | Path, choice: RuntimeChoice, solo: Solo | None = None) -> Detector:
    """A ``facecore.pipeline.Detector`` on the chosen runtime (see ``runner`` for ``solo``)."""
    run = runner(path, spec.output_names, choice, solo)

    def detect(batch: NetworkInput) -> tuple[FloatArray, FloatArray, FloatArray]:
        loc, conf, landmarks = run(batch)
        return loc, conf, landmarks

    return detect


def embedder(spec: ModelSpec, path: str | Path, choice: RuntimeChoice, solo: Solo | None = None) -> Embedder:
    """A ``facecore.pipeline.Embedder`` on the chosen runtime (see ``runner`` for ``solo``)."""
    run = runner(path, spec.output_names, choice, solo)

    def embed(batch: NetworkInput) -> FloatArray:
        return run(batch)[0]

    return embed


def usable_cpus() -> int:
    """The CPUs this process may run on (a container's CPU set, not the host's count)."""
    return len(os.sched_getaffinity(0))


def cpu_model() -> str:
    """This CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows of it."""
    try:
        found = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
    except OSError:
        found = None
    return found.group(1).strip() if found else platform.processor() or platform.machine() or "unknown CPU"


def either(alone: Callable[[], bool], solo: Runner, shared: Runner) -> Runner:
    """``solo`` for a call made while ``alone()`` says no other instance is working, ``shared`` otherwise.
    Asked at every call, so a request's detector and embedder calls each follow the load of the moment."""

    def run(batch: np.ndarray[Any, Any]) -> list[FloatArray]:
        return (solo if alone() else shared)(batch)

    return run
