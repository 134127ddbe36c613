"""Model descriptions: what a detector or embedder ONNX file expects, as data.

Colour order, normalization, tensor names, embedding size and licence are read from a small TOML
file (see ``export/specs/``), never written as constants in code, so that a user can plug in
another ONNX model (an ArcFace R50 of 512 dimensions, a RetinaFace R50) by writing its file.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any


class Role(StrEnum):
    DETECTOR = "detector"
    EMBEDDER = "embedder"


class ColorOrder(StrEnum):
    RGB = "RGB"
    BGR = "BGR"


class InputLayout(StrEnum):
    """What the network's input tensor holds."""

    #: float32 [N, 3, H, W], ``(x - mean) / std`` in ``color_order``: what exporters write.
    NCHW_FLOAT = "nchw_float"
    #: uint8 [N, H, W, 3], the BGR pixels as they are; colour order, mean, std and the transpose are
    #: inside the graph (``python -m export`` adds them), so the pipeline does no per-pixel work.
    NHWC_UINT8 = "nhwc_uint8"


@dataclass(frozen=True)
class ModelSpec:
    """One model's input/output conventions. Images are decoded as BGR; ``color_order`` is what
    the network wants. ``mean`` and ``std`` are in the network's channel order."""

    name: str
    role: Role
    architecture: str
    license: str
    source: str
    input_name: str
    output_names: tuple[str, ...]
    color_order: ColorOrder
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    #: Network input (width, height); 0 means free (a detector that takes any size).
    input_size: tuple[int, int]
    #: Embedders: vector size. Detectors: 0.
    embedding_dim: int = 0
    #: Embedders: cosine similarity at which two faces are called the same person.
    match_threshold: float = 0.0
    #: Detectors: whether the class output is already softmaxed.
    conf_softmax: bool = True
    input_layout: InputLayout = InputLayout.NCHW_FLOAT
    onnx: str = ""
    sha256: str = ""
    notes: str = ""
    extra: dict[str, str] = field(default_factory=dict)
    #: Embedders: score distributions measured on labelled faces (``facecore.scores``): ``impostor`` (a
    #: ``ScoreTail``'s dict), ``genuine`` (``mean``, ``sd``, ``pairs``) and ``measured`` (how, on what).
    #: Decisions calibrated to a false-positive identification rate start from it (docs/calibration.md).
    score_reference: dict[str, Any] = field(default_factory=dict)

    @property
    def swap_rb(self) -> bool:
        return self.color_order is ColorOrder.RGB

    def __post_init__(self) -> None:
        if self.role is Role.EMBEDDER and self.embedding_dim <= 0:
            raise ValueError(f"{self.name}: an embedder needs embedding_dim > 0")
        if self.role is Role.DETECTOR and len(self.output_names) != 3:
            raise ValueError(f"{self.name}: a RetinaFace detector has 3 outputs (loc, conf, landmarks)")
        if self.role is Role.EMBEDDER and len(self.output_names) != 1:
            raise ValueError(f"{self.name}: an embedder has exactly one output")
        if len(self.mean) != 3 or len(self.std) != 3 or any(s == 0 for s in self.std):
            raise ValueError(f"{self.name}: mean and std need 3 values each, std non-zero")


_CONVERTERS: dict[str, Any] = {
    "role": Role,
    "color_order": ColorOrder,
    "input_layout": InputLayout,
    "output_names": tuple,
    "mean": lambda v: tuple(float(x) for x in v),
    "std": lambda v: tuple(float(x) for x in v),
    "input_size": lambda v: (int(v[0]), int(v[1])),
}


def spec_from_dict(values: dict[str, Any], base_dir: Path | None = None) -> ModelSpec:
    known = {f.name for f in fields(ModelSpec)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown model description keys: {', '.join(unknown)}")
    converted = {k: _CONVERTERS.get(k, lambda v: v)(v) for k, v in values.items()}
    onnx = converted.get("onnx", "")
    if onnx and base_dir is not None and not Path(onnx).is_absolute():
        converted["onnx"] = str((base_dir / onnx).resolve())
    try:
        return ModelSpec(**converted)
    except TypeError as exc:
        raise ValueError(f"incomplete model description: {exc}") from exc


def load_spec(path: str | Path) -> ModelSpec:
    """Read a model description; a relative ``onnx`` path is relative to the TOML file. Its measured score
    distributions, when there are any, are in ``<stem>.scores.toml`` beside it (its ``score_reference``,
    written by ``python -m recognition evaluate --reference-out``)."""
    file = Path(path)
    with file.open("rb") as handle:
        data = tomllib.load(handle)
    values = dict(data.get("model", data))
    scores = file.with_name(file.stem + ".scores.toml")
    if scores.exists() and "score_reference" not in values:
        with scores.open("rb") as handle:
            values["score_reference"] = tomllib.load(handle)
    return spec_from_dict(values, base_dir=file.parent)
