"""ONNX -> TensorRT engine (``model.plan``) with TensorRT's Python API.

TensorRT is imported inside the functions only: this module loads (and its profile checks run)
where TensorRT is absent. Engines are specific to the GPU and TensorRT version that built them, so
they are built on the serving host (the NGC ``tritonserver`` image ships TensorRT).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

log = logging.getLogger(__name__)

DEFAULT_WORKSPACE_BYTES = 4 << 30
UNAVAILABLE_MESSAGE = (
    "TensorRT (the `tensorrt` Python package) is not installed here, and it cannot be installed "
    "from PyPI on a machine without NVIDIA's CUDA libraries and index. Build engines inside the NGC "
    "tritonserver image (nvcr.io/nvidia/tritonserver:<yy.mm>-py3 ships TensorRT) or on a GPU host "
    "after `pip install tensorrt` (see docs/models.md, 'PyTorch → ONNX → TensorRT')."
)


class TensorRTUnavailable(RuntimeError):
    """TensorRT's Python package cannot be imported on this machine."""


@dataclass(frozen=True)
class EngineProfile:
    """Batch range of the engine's one optimization profile, and the per-item input shape.

    ``shape`` is the per-item shape, three sizes (C, H, W; H, W, 3 for the uint8 NHWC detector); None
    takes it from the ONNX input, whose dimensions other than batch must then be fixed.
    """

    min_batch: int
    opt_batch: int
    max_batch: int
    shape: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        batches = (self.min_batch, self.opt_batch, self.max_batch)
        if not all(_positive(b) for b in batches):
            raise ValueError(f"batch sizes must be positive integers, got {batches}")
        if not 1 <= self.min_batch <= self.opt_batch <= self.max_batch:
            raise ValueError(f"need 1 <= min_batch <= opt_batch <= max_batch, got {batches}")
        if self.shape is not None and (len(self.shape) != 3 or any(not _positive(d) for d in self.shape)):
            raise ValueError(f"shape must be three positive sizes, got {self.shape}")


def _positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def item_shape(onnx_dims: Sequence[int], profile: EngineProfile) -> tuple[int, ...]:
    """Per-item input shape for ``profile``, checked against the ONNX input dims (-1 = dynamic)."""
    dims = tuple(int(d) for d in onnx_dims)
    if len(dims) < 2:
        raise ValueError(f"the ONNX input needs a batch axis and item axes, has dims {dims}")
    batch, item = dims[0], dims[1:]
    if batch != -1 and (profile.min_batch != batch or profile.max_batch != batch):
        raise ValueError(f"the ONNX input's batch axis is fixed at {batch}; export a dynamic batch axis")
    if profile.shape is None:
        if any(d < 1 for d in item):
            raise ValueError(f"the ONNX input has dynamic item dims {item}; give the item shape")
        return item
    shape = tuple(int(d) for d in profile.shape)
    if len(shape) != len(item) or any(d != s for d, s in zip(item, shape, strict=True) if d >= 1):
        raise ValueError(f"shape {shape} does not fit the ONNX input's item dims {item}")
    return shape


def tensorrt_available() -> bool:
    """Whether ``import tensorrt`` works here."""
    try:
        _tensorrt()
    except TensorRTUnavailable:
        return False
    return True


def _tensorrt() -> Any:
    try:
        import tensorrt
    except (ImportError, OSError) as exc:
        raise TensorRTUnavailable(UNAVAILABLE_MESSAGE) from exc
    return tensorrt


def _major(trt: Any) -> int:
    return int(str(trt.__version__).split(".")[0])


def _parse(trt: Any, builder: Any, onnx_path: Path, logger: Any) -> tuple[Any, Any]:
    """Network and parser for ``onnx_path`` (ValueError with the parser's errors)."""
    flags = 0 if _major(trt) >= 10 else 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise ValueError(f"{onnx_path}: TensorRT cannot parse the ONNX file:\n  " + "\n  ".join(errors))
    return network, parser


def _enable_fp16(trt: Any, builder: Any, config: Any) -> None:
    if not hasattr(trt.BuilderFlag, "FP16"):  # TensorRT 11 removed weak typing
        log.warning("TensorRT %s has no FP16 builder flag (strongly typed networks only): building in the "
                    "ONNX file's own precision; convert the ONNX to FP16 first for an FP16 engine",
                    trt.__version__)
    elif getattr(builder, "platform_has_fast_fp16", True):
        config.set_flag(trt.BuilderFlag.FP16)
    else:
        log.warning("this GPU has no fast FP16: building in FP32")


def _write_atomically(data: memoryview, out_path: Path) -> None:
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)


def build_engine(onnx_path: Path, out_path: Path, profile: EngineProfile, fp16: bool = True, *,
                 input_name: str | None = None, workspace_bytes: int = DEFAULT_WORKSPACE_BYTES) -> Path:
    """Build and serialize an engine for the ONNX file's single input; returns ``out_path``.

    ``input_name``, when given, must be the ONNX input's name (Triton binds tensors by name).
    """
    onnx_path, out_path = Path(onnx_path), Path(out_path)
    if not onnx_path.is_file():
        raise FileNotFoundError(f"ONNX file {onnx_path} not found")
    if workspace_bytes <= 0:
        raise ValueError(f"workspace_bytes must be positive, got {workspace_bytes}")
    trt = _tensorrt()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network, _parser = _parse(trt, builder, onnx_path, logger)
    if network.num_inputs != 1:
        raise ValueError(f"{onnx_path}: expected one input, found {network.num_inputs}")
    tensor = network.get_input(0)
    if input_name is not None and tensor.name != input_name:
        raise ValueError(f"{onnx_path}: input is named {tensor.name!r}, the model config says {input_name!r}")
    item = item_shape(tuple(tensor.shape), profile)
    optimization = builder.create_optimization_profile()
    optimization.set_shape(tensor.name, (profile.min_batch, *item), (profile.opt_batch, *item),
                           (profile.max_batch, *item))
    config = builder.create_builder_config()
    config.add_optimization_profile(optimization)
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    if fp16:
        _enable_fp16(trt, builder, config)
    log.info("building %s: input %s, batch %d/%d/%d, item %s, fp16=%s", onnx_path, tensor.name,
             profile.min_batch, profile.opt_batch, profile.max_batch, item, fp16)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"{onnx_path}: TensorRT failed to build an engine (see its log above)")
    _write_atomically(memoryview(serialized), out_path)
    log.info("wrote %s", out_path)
    return out_path


def read_config(path: Path) -> mc.ModelConfig:
    config = mc.ModelConfig()
    text_format.Parse(path.read_text(encoding="utf-8"), config)
    return config


def repository_profile(name: str, config: mc.ModelConfig) -> tuple[str, EngineProfile]:
    """Input name and profile from a model config: batch 1 .. max_batch_size, dims from the input."""
    max_batch = int(config.max_batch_size)
    inputs = list(config.input)
    if max_batch < 1:
        raise ValueError(f"{name}: max_batch_size must be >= 1 for an engine with a batch axis")
    if len(inputs) != 1:
        raise ValueError(f"{name}: expected one input in config.pbtxt, found {len(inputs)}")
    dims = tuple(int(d) for d in inputs[0].dims)
    if len(dims) != 3 or any(d < 1 for d in dims):
        raise ValueError(f"{name}: input dims must be three fixed sizes, got {dims}")
    shape = (dims[0], dims[1], dims[2])
    return str(inputs[0].name), EngineProfile(1, max(1, max_batch // 2), max_batch, shape)


def tensorrt_version() -> str:
    """The version of the TensorRT that builds here (its Python bindings)."""
    return str(_tensorrt().__version__)
