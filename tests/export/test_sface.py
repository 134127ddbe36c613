"""``export/sface.py``: the plain SFace conversion (PReLU kept) and the same-network check, on the real
pinned weights and real aligned faces."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from export.defaults import DefaultModels, aligned_test_faces
from export.sface import (
    SHIPPED_FILE,
    TOLERANCE,
    check_same_network,
    convert_plain_sface,
    embedding_difference,
    prelu_nodes,
)
from facecore.processing import ImageArray


@pytest.fixture(scope="module")
def plain(default_models: DefaultModels, tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("sface") / "plain.onnx"
    assert convert_plain_sface(default_models.embedder_file.parent / SHIPPED_FILE, target)
    return target


@pytest.fixture(scope="module")
def crops(default_models: DefaultModels, photos: dict[str, Path]) -> ImageArray:
    return aligned_test_faces(photos, default_models.detector, default_models.detector_file)


def test_the_plain_conversion_keeps_prelu_and_is_reused(plain: Path, default_models: DefaultModels) -> None:
    assert prelu_nodes(plain) > 0 and prelu_nodes(default_models.embedder_file) == 0
    modified = plain.stat().st_mtime_ns
    assert not convert_plain_sface(default_models.embedder_file.parent / SHIPPED_FILE, plain)
    assert plain.stat().st_mtime_ns == modified


def test_a_missing_source_says_how_to_get_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="export defaults"):
        convert_plain_sface(tmp_path / "missing.onnx", tmp_path / "plain.onnx")


def test_plain_and_served_are_the_same_network(plain: Path, crops: ImageArray,
                                               default_models: DefaultModels) -> None:
    assert len(crops) >= 10
    difference = check_same_network(default_models.embedder_file, plain, crops, default_models.embedder)
    assert 0 <= difference <= TOLERANCE
    mirrored = np.ascontiguousarray(crops[:, :, ::-1])
    assert embedding_difference(default_models.embedder_file, plain, mirrored,
                                default_models.embedder) <= TOLERANCE


def test_a_changed_weight_is_another_network(plain: Path, crops: ImageArray, default_models: DefaultModels,
                                             tmp_path: Path) -> None:
    model = onnx.load(str(plain))
    slopes = next(i for i in model.graph.initializer if numpy_helper.to_array(i).ndim >= 1
                  and any(n.op_type == "PRelu" and n.input[1] == i.name for n in model.graph.node))
    changed = numpy_helper.to_array(slopes) + np.float32(0.5)
    slopes.CopyFrom(numpy_helper.from_array(changed, slopes.name))
    other = tmp_path / "other.onnx"
    onnx.save(model, str(other))
    with pytest.raises(ValueError, match="not the same network"):
        check_same_network(default_models.embedder_file, other, crops, default_models.embedder)
    with pytest.raises(ValueError, match="no face"):
        check_same_network(default_models.embedder_file, plain, crops[:0], default_models.embedder)
