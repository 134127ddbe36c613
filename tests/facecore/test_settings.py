"""The settings sections that are plain dataclasses (limits, quality): read from the environment, bounded,
described, and importable where pydantic is not installed (the Triton images)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from facecore.limits import DEFAULT_LIMITS, PIPELINE_MAX_FACES, Limits
from facecore.quality import QualityThresholds
from facecore.settings import Settings, load_settings


def test_sections_are_the_dataclasses_with_their_defaults() -> None:
    settings = Settings()
    assert settings.limits == DEFAULT_LIMITS and type(settings.limits) is Limits
    assert settings.quality == QualityThresholds()


def test_environment_names_reach_the_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FACEREC_LIMITS__MAX_K", "7")
    monkeypatch.setenv("FACEREC_LIMITS__REQUEST_TIMEOUT_S", "2.5")
    monkeypatch.setenv("FACEREC_QUALITY__MIN_BLUR", "12")
    settings = Settings()
    assert (settings.limits.max_k, settings.limits.request_timeout_s) == (7, 2.5)
    assert settings.quality.min_blur == 12.0 and settings.quality.max_yaw == QualityThresholds.max_yaw


@pytest.mark.parametrize(("variable", "value", "message"), [
    ("FACEREC_LIMITS__MAX_K", "0", "limits.max_k: Input should be greater than 0"),
    ("FACEREC_LIMITS__MAX_FACES", str(PIPELINE_MAX_FACES + 1),
     f"limits.max_faces: Input should be less than or equal to {PIPELINE_MAX_FACES}"),
    ("FACEREC_QUALITY__MAX_YAW", "wide", "quality.max_yaw: Input should be a valid number"),
])
def test_bad_values_name_the_field(monkeypatch: pytest.MonkeyPatch, variable: str, value: str,
                                   message: str) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit, match=message):
        load_settings(Settings)


def test_descriptions_are_in_the_schema() -> None:
    limits, quality = (Settings.model_json_schema()["$defs"][name]["properties"]
                       for name in ("Limits", "QualityThresholds"))
    assert limits["max_in_flight"]["description"].startswith("recognition requests in the gateway")
    assert quality["max_roll"]["description"] == "degrees, from the eye line"


def test_pipeline_imports_them_without_pydantic() -> None:
    blocked = "import sys; sys.modules['pydantic'] = None; import facecore.pipeline, facecore.quality"
    subprocess.run([sys.executable, "-c", blocked], check=True)
