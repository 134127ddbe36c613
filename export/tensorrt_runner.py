"""Run a serialized TensorRT engine on one batch on the GPU: what ``export.engine_check`` compares with
the ONNX model at build time.

Device memory through the CUDA runtime by ``ctypes`` (``libcudart.so.12``): the NGC tritonserver image
has the CUDA runtime but neither PyCUDA nor cuda-python. Runs only where TensorRT and a GPU are; the
tests that use it are skipped elsewhere (tests/export/test_engine_cache.py says so).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from export.tensorrt_build import _tensorrt
from facecore.processing import FloatArray

_HOST_TO_DEVICE, _DEVICE_TO_HOST = 1, 2


def _cudart() -> ctypes.CDLL:
    names = ("libcudart.so.12", "libcudart.so", ctypes.util.find_library("cudart") or "")
    for name in filter(None, names):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError("the CUDA runtime (libcudart.so.12) is not loadable here")


class _Cuda:
    def __init__(self) -> None:
        self.lib = _cudart()
        self.lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        self.lib.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.lib.cudaFree.argtypes = [ctypes.c_void_p]
        self.lib.cudaStreamCreate.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        self.lib.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]

    def check(self, code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what} failed with CUDA error {code}")

    def malloc(self, size: int) -> int:
        pointer = ctypes.c_void_p()
        self.check(self.lib.cudaMalloc(ctypes.byref(pointer), max(size, 1)), "cudaMalloc")
        return int(pointer.value or 0)

    def copy(self, target: int, source: int, size: int, kind: int) -> None:
        self.check(self.lib.cudaMemcpy(target, source, size, kind), "cudaMemcpy")

    def stream(self) -> int:
        stream = ctypes.c_void_p()
        self.check(self.lib.cudaStreamCreate(ctypes.byref(stream)), "cudaStreamCreate")
        return int(stream.value or 0)


class PlanRunner:
    """``runner(batch) -> outputs in output_names order``, for an engine with one input."""

    def __init__(self, plan: Path, output_names: Sequence[str]) -> None:
        trt = _tensorrt()
        self.trt, self.cuda = trt, _Cuda()
        engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(Path(plan).read_bytes())
        if engine is None:
            raise RuntimeError(f"{plan}: TensorRT cannot deserialize this engine here")
        self.engine, self.context = engine, engine.create_execution_context()
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        (self.input_name,) = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.output_names, self.stream = list(output_names), self.cuda.stream()

    def _dtype(self, name: str) -> Any:
        return np.dtype(self.trt.nptype(self.engine.get_tensor_dtype(name)))

    def __call__(self, batch: np.ndarray[Any, Any]) -> list[FloatArray]:
        host_in = np.ascontiguousarray(batch, dtype=self._dtype(self.input_name))
        self.context.set_input_shape(self.input_name, host_in.shape)
        hosts = {name: np.empty(tuple(self.context.get_tensor_shape(name)), self._dtype(name))
                 for name in self.output_names}
        device: dict[str, int] = {}
        try:
            for name, array in ((self.input_name, host_in), *hosts.items()):
                device[name] = self.cuda.malloc(array.nbytes)
                self.context.set_tensor_address(name, device[name])
            self.cuda.copy(device[self.input_name], host_in.ctypes.data, host_in.nbytes, _HOST_TO_DEVICE)
            if not self.context.execute_async_v3(self.stream):
                raise RuntimeError("TensorRT failed to run the engine")
            self.cuda.check(self.cuda.lib.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")
            for name, array in hosts.items():
                self.cuda.copy(array.ctypes.data, device[name], array.nbytes, _DEVICE_TO_HOST)
        finally:
            for pointer in device.values():
                self.cuda.lib.cudaFree(pointer)
        return [np.asarray(hosts[name], dtype=np.float32) for name in self.output_names]
