"""Model descriptions (``facecore.spec``) and the pipeline settings built from them."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from facecore.pipeline import PipelineSettings, validate_options
from facecore.processing import DetectOptions
from facecore.spec import ColorOrder, ModelSpec, Role, load_spec, spec_from_dict
from tests import ROOT

SPECS = ROOT / "export" / "specs"


def detector_values(**changes: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "name": "det",
        "role": "detector",
        "architecture": "RetinaFace",
        "license": "MIT",
        "source": "test",
        "input_name": "input",
        "output_names": ["loc", "conf", "landmarks"],
        "color_order": "BGR",
        "mean": [104, 117, 123],
        "std": [1, 1, 1],
        "input_size": [640, 640],
    }
    values.update(changes)
    return values


def embedder_values(**changes: Any) -> dict[str, Any]:
    values = detector_values(
        name="emb",
        role="embedder",
        output_names=["fc1"],
        color_order="RGB",
        input_size=[112, 112],
        embedding_dim=128,
        match_threshold=0.363,
    )
    values.update(changes)
    return values


def write_toml(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


# --------------------------------------------------------------------------------------------
# The shipped descriptions


def test_retinaface_spec() -> None:
    spec = load_spec(SPECS / "retinaface_mnet025.toml")
    assert spec.name == "retinaface_mnet025"
    assert spec.role is Role.DETECTOR
    assert spec.color_order is ColorOrder.BGR
    assert spec.swap_rb is False
    assert spec.input_name == "input"
    assert spec.output_names == ("loc", "conf", "landmarks")
    assert spec.mean == (104.0, 117.0, 123.0)
    assert spec.std == (1.0, 1.0, 1.0)
    assert spec.input_size == (640, 640)
    assert spec.embedding_dim == 0
    assert spec.conf_softmax is True
    assert spec.onnx == ""


def test_sface_spec() -> None:
    spec = load_spec(SPECS / "sface_2021dec.toml")
    assert spec.name == "sface_2021dec"
    assert spec.role is Role.EMBEDDER
    assert spec.color_order is ColorOrder.RGB
    assert spec.swap_rb is True
    assert spec.input_name == "data"
    assert spec.output_names == ("fc1",)
    assert spec.mean == (0.0, 0.0, 0.0)
    assert spec.std == (1.0, 1.0, 1.0)
    assert spec.input_size == (112, 112)
    assert spec.embedding_dim == 128
    assert spec.match_threshold == pytest.approx(0.363)


def test_arcface_example_spec() -> None:
    spec = load_spec(str(SPECS / "arcface_r50_example.toml"))  # str paths work too
    assert spec.name == "arcface_r50"
    assert spec.role is Role.EMBEDDER
    assert spec.color_order is ColorOrder.RGB
    assert spec.swap_rb is True
    assert spec.input_name == "input.1"
    assert spec.output_names == ("683",)
    assert spec.mean == (127.5, 127.5, 127.5)
    assert spec.std == (127.5, 127.5, 127.5)
    assert spec.input_size == (112, 112)
    assert spec.embedding_dim == 512
    assert spec.match_threshold == pytest.approx(0.28)
    assert spec.onnx == "/path/to/w600k_r50.onnx"  # absolute: left as written


# --------------------------------------------------------------------------------------------
# Errors and paths


def test_unknown_keys_are_named(tmp_path: Path) -> None:
    path = write_toml(
        tmp_path / "bad.toml",
        '[model]\nname = "x"\nrole = "detector"\ncolour_order = "RGB"\nembedding_size = 3\n',
    )
    with pytest.raises(ValueError, match="unknown model description keys: colour_order, embedding_size"):
        load_spec(path)


def test_embedder_without_embedding_dim() -> None:
    values = embedder_values()
    del values["embedding_dim"]
    with pytest.raises(ValueError, match="emb: an embedder needs embedding_dim > 0"):
        spec_from_dict(values)
    with pytest.raises(ValueError, match="embedding_dim"):
        spec_from_dict(embedder_values(embedding_dim=0))


def test_embedder_with_two_outputs() -> None:
    with pytest.raises(ValueError, match="exactly one output"):
        spec_from_dict(embedder_values(output_names=["a", "b"]))


@pytest.mark.parametrize("outputs", [["loc", "conf"], ["a", "b", "c", "d"], []])
def test_detector_needs_three_outputs(outputs: list[str]) -> None:
    with pytest.raises(ValueError, match="det: a RetinaFace detector has 3 outputs"):
        spec_from_dict(detector_values(output_names=outputs))


@pytest.mark.parametrize(
    ("mean", "std"),
    [([0, 0, 0], [1, 0, 1]), ([0, 0, 0], [0.0, 0.0, 0.0]), ([0, 0], [1, 1, 1]), ([0, 0, 0], [1, 1])],
)
def test_bad_mean_or_std(mean: list[float], std: list[float]) -> None:
    with pytest.raises(ValueError, match="mean and std need 3 values each, std non-zero"):
        spec_from_dict(detector_values(mean=mean, std=std))


def test_std_zero_in_toml(tmp_path: Path) -> None:
    original = (SPECS / "retinaface_mnet025.toml").read_text()
    text = original.replace("std = [1.0, 1.0, 1.0]", "std = [1.0, 0, 1.0]")
    assert "std = [1.0, 0, 1.0]" in text
    with pytest.raises(ValueError, match="std non-zero"):
        load_spec(write_toml(tmp_path / "zero_std.toml", text))


def test_missing_required_field() -> None:
    values = detector_values()
    del values["input_name"]
    with pytest.raises(ValueError, match=r"incomplete model description.*input_name"):
        spec_from_dict(values)


def test_bad_enum_values() -> None:
    with pytest.raises(ValueError, match="classifier"):
        spec_from_dict(detector_values(role="classifier"))
    with pytest.raises(ValueError, match="RBG"):
        spec_from_dict(detector_values(color_order="RBG"))


def test_relative_onnx_path_is_resolved_against_the_toml_folder(tmp_path: Path) -> None:
    text = (SPECS / "sface_2021dec.toml").read_text() + '\nonnx = "../weights/sface.onnx"\n'
    path = write_toml(tmp_path / "descriptions" / "mine.toml", text)
    spec = load_spec(path)
    assert spec.onnx == str((tmp_path / "weights" / "sface.onnx").resolve())
    assert Path(spec.onnx).is_absolute()


def test_absolute_onnx_path_and_no_base_dir_are_kept(tmp_path: Path) -> None:
    absolute = str(tmp_path / "x.onnx")
    assert spec_from_dict(embedder_values(onnx=absolute), base_dir=Path("/elsewhere")).onnx == absolute
    assert spec_from_dict(embedder_values(onnx="rel/x.onnx")).onnx == "rel/x.onnx"


def test_toml_without_model_table(tmp_path: Path) -> None:
    text = (SPECS / "retinaface_mnet025.toml").read_text().replace("[model]\n", "")
    spec = load_spec(write_toml(tmp_path / "flat.toml", text))
    assert spec == load_spec(SPECS / "retinaface_mnet025.toml")


# --------------------------------------------------------------------------------------------
# PipelineSettings


@pytest.fixture
def settings() -> PipelineSettings:
    return PipelineSettings(
        detector=load_spec(SPECS / "retinaface_mnet025.toml"),
        embedder=dataclasses.replace(load_spec(SPECS / "sface_2021dec.toml"), onnx="/models/sface.onnx"),
        detector_max_batch=4,
        embedder_max_batch=32,
        score_threshold=0.6,
        nms_iou=0.35,
        max_faces=20,
        min_face_size=12.5,
        max_pixels=1_000_000,
        detector_model="det",
        embedder_model="emb",
    )


def test_settings_round_trip(settings: PipelineSettings) -> None:
    parameters = settings.to_parameters()
    assert all(isinstance(value, str) for value in parameters.values())
    assert parameters["max_faces"] == "20"
    assert PipelineSettings.from_parameters(parameters) == settings


def test_settings_defaults_and_unknown_keys(settings: PipelineSettings) -> None:
    full = settings.to_parameters()
    parameters = {"detector": full["detector"], "embedder": full["embedder"]}
    parameters["something_else"] = "ignored"
    loaded = PipelineSettings.from_parameters(parameters)
    assert loaded.max_faces == 100
    assert loaded.score_threshold == 0.5
    assert loaded.detector == settings.detector
    assert loaded.embedder.onnx == "/models/sface.onnx"


@pytest.mark.parametrize(
    ("name", "value"), [("max_faces", "abc"), ("score_threshold", "high"), ("detector_max_batch", "1.5")]
)
def test_settings_bad_value_names_the_parameter(settings: PipelineSettings, name: str, value: str) -> None:
    parameters = settings.to_parameters()
    parameters[name] = value
    with pytest.raises(ValueError, match=f"parameter {name}={value!r} is not a valid"):
        PipelineSettings.from_parameters(parameters)


@pytest.mark.parametrize("missing", ["detector", "embedder"])
def test_settings_missing_model(settings: PipelineSettings, missing: str) -> None:
    parameters = settings.to_parameters()
    del parameters[missing]
    with pytest.raises(ValueError, match="'detector' and 'embedder'"):
        PipelineSettings.from_parameters(parameters)


def test_settings_checks_roles_and_ranges(settings: PipelineSettings) -> None:
    with pytest.raises(ValueError, match="wrong roles"):
        dataclasses.replace(settings, detector=settings.embedder, embedder=settings.detector)
    with pytest.raises(ValueError, match="positive"):
        dataclasses.replace(settings, max_faces=0)
    with pytest.raises(ValueError, match="score_threshold"):
        dataclasses.replace(settings, score_threshold=1.5)
    with pytest.raises(ValueError, match="nms_iou"):
        dataclasses.replace(settings, nms_iou=0.0)


def test_validate_options_defaults(settings: PipelineSettings) -> None:
    options = validate_options(settings)
    assert options == settings.default_options == DetectOptions(0.6, 0.35, 20, 12.5)
    assert validate_options(settings, None, None, None) == options


def test_validate_options_merges_over_defaults(settings: PipelineSettings) -> None:
    assert validate_options(settings, score_threshold=0.9) == DetectOptions(0.9, 0.35, 20, 12.5)
    assert validate_options(settings, max_faces=3) == DetectOptions(0.6, 0.35, 3, 12.5)
    assert validate_options(settings, min_face_size=0) == DetectOptions(0.6, 0.35, 20, 0.0)
    assert validate_options(settings, 0.0, 20, 40.0) == DetectOptions(0.0, 0.35, 20, 40.0)
    assert validate_options(settings, score_threshold=1.0).score_threshold == 1.0


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"score_threshold": 1.5}, r"score_threshold must be in \[0, 1\], got 1.5"),
        ({"score_threshold": -0.1}, "score_threshold"),
        ({"max_faces": 0}, r"max_faces must be in \[1, 20\], got 0"),
        ({"max_faces": 21}, r"max_faces must be in \[1, 20\], got 21"),
        ({"min_face_size": -1.0}, r"min_face_size must be in \[0, 100000\] pixels, got -1.0"),
    ],
)
def test_validate_options_rejects(settings: PipelineSettings, changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_options(settings, **changes)


def test_model_spec_is_immutable() -> None:
    spec = load_spec(SPECS / "sface_2021dec.toml")
    assert isinstance(spec, ModelSpec)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "other"  # type: ignore[misc]


def test_detector_input_follows_the_image_and_the_minimum_face(settings: PipelineSettings) -> None:
    from dataclasses import replace as dc_replace

    from facecore.pipeline import detector_input_size

    dynamic = dc_replace(settings, dynamic_input=True, detectable_face=32.0)
    assert detector_input_size((1280, 886), dynamic, 0) == (640, 448)  # aspect kept, multiples of 32
    assert detector_input_size((910, 1137), dynamic, 0) == (512, 640)
    assert detector_input_size((100, 80), dynamic, 0) == (640, 512)  # small images are scaled up to fit
    assert detector_input_size((1280, 886), dynamic, 128) == (320, 224)  # a 128 px face lands at 32 px
    assert detector_input_size((40, 4000), dynamic, 0) == (32, 640)  # never below 32
    fixed = dc_replace(settings, dynamic_input=False)
    assert detector_input_size((1280, 886), fixed, 128) == (640, 640)


def test_boolean_parameters(settings: PipelineSettings) -> None:
    params = settings.to_parameters()
    assert PipelineSettings.from_parameters({**params, "dynamic_input": "false"}).dynamic_input is False
    assert PipelineSettings.from_parameters({**params, "dynamic_input": "True"}).dynamic_input is True
    with pytest.raises(ValueError, match="dynamic_input"):
        PipelineSettings.from_parameters({**params, "dynamic_input": "maybe"})
