"""Triton Python-backend model that runs one ONNX file on CPU with OpenVINO or ONNX Runtime.

The bundled tritonserver has only the Python backend, so ``face_detector`` and ``face_embedder``
are this file plus a ``model.onnx`` in the version directory; the config's parameters choose the
runtime (``runtime``: openvino | onnxruntime), the precision the export checked (``precision``: f32 |
bf16; bf16 falls back to f32 on a CPU without native bfloat16), the threads and the ``sub_batch``
(``facecore.runtimes.RuntimeChoice``). Requests of one ``execute`` whose inputs share a shape are
concatenated into one call and split again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils
from numpy.typing import NDArray

from facecore.runtimes import Runtime, RuntimeChoice, runner
from facecore.triton_config import parameters, tensor_names


def _input(request: Any, name: str) -> NDArray[Any]:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:  # Triton checks required inputs before execute; this only narrows the type
        raise pb_utils.TritonModelException(f"missing input {name}")
    return tensor.as_numpy()


def _groups(arrays: list[NDArray[Any]]) -> dict[tuple[int, ...], list[int]]:
    """Request indices grouped by per-item shape (everything after the batch axis)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, array in enumerate(arrays):
        groups.setdefault(tuple(array.shape[1:]), []).append(index)
    return groups


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        config = json.loads(args["model_config"])
        params = parameters(config)
        version_dir = Path(args["model_repository"]) / args["model_version"]
        choice = RuntimeChoice(
            runtime=Runtime(params.get("runtime", Runtime.ONNXRUNTIME.value)),
            precision=params.get("precision", "f32"),
            threads=int(params.get("intra_op_threads", "0")),
            spinning=params.get("intra_op_spinning", "true").lower() == "true",
            sub_batch=int(params.get("sub_batch", "0")),
        )
        (self.input_name,) = tensor_names(config, "input")
        self.output_names = tensor_names(config, "output")
        self.run = runner(version_dir / params.get("onnx_file", "model.onnx"), self.output_names, choice)

    def execute(self, requests: list[Any]) -> list[Any]:
        inputs = [_input(r, self.input_name) for r in requests]
        responses: list[Any] = [None] * len(requests)
        for indices in _groups(inputs).values():
            batch = np.concatenate([inputs[i] for i in indices]) if len(indices) > 1 else inputs[indices[0]]
            try:
                outputs = self.run(batch)
            except Exception as exc:  # a runtime failure fails these requests, not the server
                error = pb_utils.TritonError(f"{self.input_name}: {exc}")
                for i in indices:
                    responses[i] = pb_utils.InferenceResponse(error=error)
                continue
            bounds = np.cumsum([0, *(inputs[i].shape[0] for i in indices)])
            for k, i in enumerate(indices):
                tensors = [
                    pb_utils.Tensor(name, np.ascontiguousarray(out[bounds[k] : bounds[k + 1]]))
                    for name, out in zip(self.output_names, outputs, strict=True)
                ]
                responses[i] = pb_utils.InferenceResponse(output_tensors=tensors)
        return responses
