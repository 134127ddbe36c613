"""The GPU benchmark (``bench/gpu.py``) on the CPU: the figures themselves need a GPU host
(docs/gpu-plan.md); here the same code runs on tiny sizes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu
from export.defaults import DefaultModels
from export.profiles import Profile
from tests.conftest import ARTIFACTS, ROOT, exported


@pytest.fixture(scope="module")
def gpu_repository(default_models: DefaultModels, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return exported(Profile.GPU, default_models, tmp_path_factory)


@pytest.fixture(scope="module")
def bundle(gpu_repository: Path, photos: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gpu.bundle(gpu_repository, ARTIFACTS / "photos", tmp_path_factory.mktemp("bundle"))


def test_the_bundle_holds_what_the_gpu_host_needs(bundle: Path) -> None:
    settings = gpu.load_settings(bundle)
    assert not settings.dynamic_input and settings.detector.input_size == (640, 640)
    assert (bundle / gpu.DETECTOR_FILE).stat().st_size > 10**6 and (bundle / gpu.EMBEDDER_FILE).exists()
    assert {"obama.jpg", "t1.jpg"} <= {p.name for p in (bundle / gpu.PHOTOS).iterdir()}


def test_a_tiny_run_on_the_cpu_measures_every_part(bundle: Path, tmp_path: Path) -> None:
    """The command line, in its own process (PyTorch's threads and memory stay out of the test process)."""
    out = tmp_path / "gpu.json"
    command = [sys.executable, "-m", "bench.gpu", "run", "--bundle", str(bundle), "--device", "cpu", "--tiny",
               "--json", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = gpu.Report(**json.loads(out.read_text()))
    assert report.errors == [] and report.machine["cpus"]
    assert {(r["network"], r["batch"]) for r in report.networks} == {("detector", 1), ("embedder", 1),
                                                                      ("embedder", 2)}
    assert all(r["per_second"] > 0 for r in report.networks)
    # the same float32 arithmetic as ONNX Runtime: the TensorRT plan check passes on every face
    assert [(r["network"], r["passed"]) for r in report.precision] == [("detector", True), ("embedder", True)]
    assert all(r["faces"] > 10 and r["worst_cosine"] > 0.9999 for r in report.precision)
    detector = report.precision[0]
    assert detector["changed"] == [] and 0 <= detector["largest_change"]["blur"] < 0.01
    assert set(detector["largest_change"]) == {"face_size", "blur", "yaw", "pitch", "roll", "detection_score",
                                               "pair_cosine_absolute"}
    reduced = {r["decoded"] for r in report.decode if r["photo"] == "obama3.jpg"}
    assert reduced == {"1434x2333", "717x1167"}  # full size, and at 1/2 (decode_min_side 640)
    assert all(r["per_second_all_cores"] > 0 for r in report.decode)
    assert [(r["photo"], r["faces"], r["processes"], r["networks"]) for r in report.pipeline] == [
        ("obama.jpg", 1, 2, "eager"), ("t1.jpg", 6, 2, "eager")]
    assert all(r["photos_per_second"] > 0 for r in report.pipeline)
    assert {r["block"] for r in report.gallery} == {1, 4}
    assert all(0.5 <= r["recall_at_10_vs_float32"] <= 1.0 for r in report.gallery)


def test_a_failing_part_is_recorded_and_the_others_still_run(bundle: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in (gpu.SETTINGS, gpu.EMBEDDER_FILE):
        (broken / name).write_bytes((bundle / name).read_bytes())
    (broken / gpu.DETECTOR_FILE).write_bytes(b"not onnx")
    report = gpu.run(broken, "cpu", gpu.Sizes.tiny(), ["networks", "gallery"], tmp_path / "out.json")
    assert len(report.errors) == 1 and report.errors[0].startswith("networks:")
    assert report.gallery
    assert json.loads((tmp_path / "out.json").read_text())["errors"] == report.errors


def test_missing_inputs_are_named_with_the_command_that_makes_them(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"python -m export defaults"):
        gpu.main(["bundle", "--repository", str(tmp_path / "none"), "--out", str(tmp_path / "b")])
    with pytest.raises(SystemExit, match=r"python -m bench\.gpu bundle"):
        gpu.main(["run", "--bundle", str(tmp_path), "--device", "cpu"])
