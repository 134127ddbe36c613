"""The *plain* SFace conversion and the check that two embedder files are the same network.

``python -m export defaults`` serves SFace converted with ``convert_sface``: weights folded to fp32, a
dynamic batch, and PReLU rewritten as ``Relu(x) - a * Relu(-x)`` (faster in ONNX Runtime, exact). The
plain conversion stops before the rewrite: what a straightforward deployment of the same network runs.
The work-reduction test and the benchmarks' plain baseline both use it, and ``check_same_network``
proves on real inputs that the rewrite changed no embedding.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx

from export.defaults import SFACE_TOLERANCE
from export.onnx_tools import fold_weight_dequantization, make_batch_dynamic, save_checked
from facecore.onnx_runtime import create_session
from facecore.pipeline import network_input
from facecore.processing import ImageArray
from facecore.spec import ModelSpec

log = logging.getLogger(__name__)

#: The pinned int8 SFace as ``prepare_default_models`` extracts it, and the plain conversion's file name.
SHIPPED_FILE = "sface_2021dec.int8bq.b1.112x112.onnx"
PLAIN_FILE = "sface_2021dec.fp32.bdyn.112x112.prelu.onnx"
#: Largest |difference| of raw embeddings allowed between two conversions of one network.
TOLERANCE = SFACE_TOLERANCE


def prelu_nodes(path: Path) -> int:
    """PRelu nodes in the graph of an ONNX file (0 once ``rewrite_prelu`` ran)."""
    model = onnx.load(str(path), load_external_data=False)
    return sum(node.op_type == "PRelu" for node in model.graph.node)


def convert_plain_sface(source: Path, target: Path) -> bool:
    """The shipped int8 SFace -> fp32 weights and a dynamic batch, PReLU kept. False when ``target``
    already exists (reused, not converted again)."""
    if target.exists():
        return False
    if not source.exists():
        raise FileNotFoundError(f"{source} is missing: run `python -m export defaults` first")
    log.info("converting %s -> %s (no PReLU rewrite)", source.name, target.name)
    save_checked(make_batch_dynamic(fold_weight_dequantization(onnx.load(str(source)))), target)
    return True


def embedding_difference(first: Path, second: Path, crops: ImageArray, spec: ModelSpec) -> float:
    """Largest |difference| of the raw embeddings two embedder files give for the same batch of
    aligned crops ([N, H, W, 3] BGR, preprocessed as ``spec`` says)."""
    batch = network_input(crops, spec)
    outputs = [create_session(path, 1).run([spec.output_names[0]], {spec.input_name: batch})[0]
               for path in (first, second)]
    return float(np.abs(outputs[0] - outputs[1]).max())


def check_same_network(served: Path, plain: Path, crops: ImageArray, spec: ModelSpec,
                       tolerance: float = TOLERANCE) -> float:
    """``embedding_difference`` of the two files, raising ``ValueError`` when there is nothing to compare
    or they differ by more than ``tolerance``: then they are not the same network."""
    if len(crops) == 0:
        raise ValueError("no face to compare the two embedders on")
    difference = embedding_difference(served, plain, crops, spec)
    if not difference <= tolerance:
        raise ValueError(f"{plain.name} differs from {served.name} by {difference:.2e} (> {tolerance:g}): "
                         "not the same network")
    return difference
