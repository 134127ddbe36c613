"""Triton Python-backend model that runs one ONNX file with ONNX Runtime (the CPU profile).

The bundled tritonserver has only the Python backend, so ``face_detector`` and ``face_embedder``
are this file plus a ``model.onnx`` in the version directory. Requests of one ``execute`` whose
inputs share a shape are concatenated into one ONNX Runtime call and split again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils
from numpy.typing import NDArray

from facecore.onnx_runtime import create_session
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
        self.session = create_session(
            version_dir / params.get("onnx_file", "model.onnx"),
            intra_op_threads=int(params.get("intra_op_threads", "0")),
            spinning=params.get("intra_op_spinning", "true").lower() == "true",
        )
        (self.input_name,) = tensor_names(config, "input")
        self.output_names = tensor_names(config, "output")

    def execute(self, requests: list[Any]) -> list[Any]:
        inputs = [_input(r, self.input_name) for r in requests]
        responses: list[Any] = [None] * len(requests)
        for indices in _groups(inputs).values():
            batch = np.concatenate([inputs[i] for i in indices]) if len(indices) > 1 else inputs[indices[0]]
            try:
                outputs = self.session.run(self.output_names, {self.input_name: batch})
            except Exception as exc:  # an ONNX Runtime failure fails these requests, not the server
                error = pb_utils.TritonError(f"onnxruntime: {exc}")
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
