"""A typed stand-in for Triton's ``triton_python_backend_utils``, for unit tests of ``model.py`` files.

BLS calls (``InferenceRequest.exec``) are answered by the handlers in ``BLS_HANDLERS`` and
recorded in ``BLS_CALLS``; tests set both through the ``fake_pb_utils`` fixture.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from numpy.typing import NDArray

Array = NDArray[Any]
BLS_HANDLERS: dict[str, Callable[[dict[str, Array]], dict[str, Array]]] = {}
BLS_CALLS: list[tuple[str, dict[str, Array]]] = []


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


@dataclass(frozen=True)
class Tensor:
    _name: str
    _array: Array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> Array:
        return self._array


class InferenceResponse:
    def __init__(self, output_tensors: list[Tensor] | None = None, error: TritonError | None = None) -> None:
        self.output_tensors = output_tensors or []
        self._error = error

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def output(self, name: str) -> Array:
        """Test helper: the named output array."""
        tensor = get_output_tensor_by_name(self, name)
        if tensor is None:
            raise KeyError(name)
        return tensor.as_numpy()


@dataclass
class InferenceRequest:
    inputs: list[Tensor]
    requested_output_names: list[str] = field(default_factory=list)
    model_name: str = ""

    def exec(self) -> InferenceResponse:
        arrays = {t.name(): t.as_numpy() for t in self.inputs}
        BLS_CALLS.append((self.model_name, arrays))
        try:
            outputs = BLS_HANDLERS[self.model_name](arrays)
        except Exception as exc:
            return InferenceResponse(error=TritonError(f"{type(exc).__name__}: {exc}"))
        return InferenceResponse([Tensor(n, outputs[n]) for n in self.requested_output_names])


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    return next((t for t in request.inputs if t.name() == name), None)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors if t.name() == name), None)
