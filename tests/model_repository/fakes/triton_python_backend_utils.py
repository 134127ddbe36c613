"""A typed stand-in for Triton's ``triton_python_backend_utils``, for unit tests of ``model.py`` files.

It follows the 24.10 python_backend API (``src/pb_stub.cc`` of r24.10): ``Tensor.as_numpy()`` raises
``TritonModelException("Tensor is stored in GPU and cannot be converted to NumPy.")`` for a tensor in
GPU memory, ``is_cpu()``, ``to_dlpack()`` / ``from_dlpack()``, ``InferenceRequest.inputs()``,
``InferenceResponse.output_tensors()``, and the optional ``preferred_memory=PreferredMemory(...)``
of a BLS request.

BLS calls (``InferenceRequest.exec``) are answered by the handlers in ``BLS_HANDLERS`` and
recorded in ``BLS_CALLS``; tests set both through the ``fake_pb_utils`` fixture. A model named in
``BLS_GPU_MODELS`` puts its outputs in GPU memory, as a TensorRT model does, unless the request
prefers CPU memory: what the real server does when ``preferred_memory`` is not given (outputs stay
where the producing model allocated them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np
from numpy.typing import NDArray

Array = NDArray[Any]

BLS_HANDLERS: dict[str, Callable[[dict[str, Array]], dict[str, Array]]] = {}
BLS_CALLS: list[tuple[str, dict[str, Array]]] = []
BLS_GPU_MODELS: set[str] = set()


class TritonModelException(Exception):
    pass


class TritonError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS = range(7)

    def __init__(self, message: str, code: int = 1) -> None:
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class MemoryType(IntEnum):
    TRITONSERVER_MEMORY_GPU = 0
    TRITONSERVER_MEMORY_CPU = 1


TRITONSERVER_MEMORY_GPU = MemoryType.TRITONSERVER_MEMORY_GPU
TRITONSERVER_MEMORY_CPU = MemoryType.TRITONSERVER_MEMORY_CPU


@dataclass(frozen=True)
class PreferredMemory:
    preferred_memory_type: MemoryType
    preferred_device_id: int = 0


class _Capsule:
    """Wraps a raw DLPack capsule so ``numpy.from_dlpack`` accepts it."""

    def __init__(self, capsule: Any) -> None:
        self._capsule = capsule

    def __dlpack__(self, stream: Any = None) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU


class Tensor:
    def __init__(self, name: str, array: Array) -> None:
        self._name, self._array, self._gpu = name, np.asarray(array), False

    def name(self) -> str:
        return self._name

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def is_cpu(self) -> bool:
        return not self._gpu

    def as_numpy(self) -> Array:
        if self._gpu:
            raise TritonModelException("Tensor is stored in GPU and cannot be converted to NumPy.")
        return self._array

    def to_dlpack(self) -> Any:
        return self._array.__dlpack__()

    @staticmethod
    def from_dlpack(name: str, tensor: Any) -> Tensor:
        """A fake tensor keeps its placement; anything else arrives in CPU memory."""
        if isinstance(tensor, Tensor):
            return _placed(name, tensor._array, gpu=tensor._gpu)
        source = tensor if hasattr(tensor, "__dlpack__") else _Capsule(tensor)
        return Tensor(name, np.from_dlpack(source))


def _placed(name: str, array: Array, *, gpu: bool) -> Tensor:
    tensor = Tensor(name, array)
    tensor._gpu = gpu
    return tensor


def gpu_tensor(name: str, array: Array) -> Tensor:
    """Test helper (not in the real module): a tensor that lives in GPU memory."""
    return _placed(name, array, gpu=True)


class InferenceResponse:
    def __init__(self, output_tensors: list[Tensor] | None = None, error: TritonError | None = None) -> None:
        self._output_tensors = list(output_tensors or [])
        self._error = error

    def output_tensors(self) -> list[Tensor]:
        return self._output_tensors

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def output(self, name: str) -> Array:
        """Test helper (not in the real module): the named output array."""
        tensor = get_output_tensor_by_name(self, name)
        if tensor is None:
            raise KeyError(name)
        return tensor.as_numpy()


class InferenceRequest:
    """Both the requests ``execute`` receives and BLS requests (``exec``)."""

    def __init__(self, inputs: list[Tensor], requested_output_names: list[str] | None = None,
                 model_name: str = "", model_version: int = -1,
                 preferred_memory: PreferredMemory | None = None) -> None:
        self._inputs = list(inputs)
        self._requested = list(requested_output_names or [])
        self.model_name, self.model_version = model_name, model_version
        self.preferred_memory = preferred_memory

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def requested_output_names(self) -> list[str]:
        return self._requested

    def _on_gpu(self) -> bool:
        if self.preferred_memory is None:
            return self.model_name in BLS_GPU_MODELS
        return self.preferred_memory.preferred_memory_type == TRITONSERVER_MEMORY_GPU

    def exec(self) -> InferenceResponse:
        arrays = {t.name(): t._array for t in self._inputs}  # Triton reads inputs wherever they are
        BLS_CALLS.append((self.model_name, arrays))
        try:
            outputs = BLS_HANDLERS[self.model_name](arrays)
        except Exception as exc:
            return InferenceResponse(error=TritonError(f"{type(exc).__name__}: {exc}"))
        gpu = self._on_gpu()
        return InferenceResponse([_placed(n, outputs[n], gpu=gpu) for n in self._requested])

    async def async_exec(self) -> InferenceResponse:
        return self.exec()


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    return next((t for t in request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors() if t.name() == name), None)
