"""``export.engine_cache``: keys, a plan for every servable version, the cache, the checked build.

TensorRT cannot be installed here: the build is a fake that writes what it was asked for, and the
check is faked too; ``tests/export/test_engine_check.py`` checks the comparison itself with ONNX Runtime
standing in for the engine, and the real build + check run only where TensorRT is installed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from export import engine_cache
from export.engine_cache import (
    KEY_FILE,
    EngineCache,
    EngineKey,
    EngineRefused,
    EngineSlot,
    build_checked,
    build_repository_engines,
    engine_key,
    engine_slots,
    is_current,
)
from export.precision import PrecisionCheck
from export.repository import pin_version
from export.tensorrt_build import EngineProfile

CONFIG = """name: "{name}"
platform: "tensorrt_plan"
max_batch_size: {max_batch}
input {{ name: "{input}" data_type: {dtype} dims: [{dims}] }}
output {{ name: "out" data_type: TYPE_FP32 dims: [-1, 4] }}
version_policy {{ latest {{ num_versions: 1 }} }}
parameters {{ key: "spec" value {{ string_value: '{{"role": "{role}"}}' }} }}
"""
H100, L4 = "NVIDIA H100 80GB HBM3", "NVIDIA L4"


def trt_model(repository: Path, name: str, role: str, versions: tuple[int, ...] = (1, 2),
              max_batch: int = 16) -> Path:
    model = repository / name
    dims, dtype, tensor = ("640, 640, 3", "TYPE_UINT8", "input") if role == "detector" else \
        ("3, 112, 112", "TYPE_FP32", "data")
    model.mkdir(parents=True, exist_ok=True)
    text = CONFIG.format(name=name, max_batch=max_batch, input=tensor, dtype=dtype, dims=dims, role=role)
    (model / "config.pbtxt").write_text(text)
    for version in versions:
        (model / str(version)).mkdir(exist_ok=True)
        (model / str(version) / "model.onnx").write_bytes(f"{name} v{version}".encode())
    return model


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    repo = tmp_path / "gpu"
    trt_model(repo, "face_detector", "detector")
    trt_model(repo, "face_embedder", "embedder")
    (repo / "face_pipeline" / "1").mkdir(parents=True)
    (repo / "face_pipeline" / "config.pbtxt").write_text('name: "face_pipeline"\nbackend: "python"\n')
    return repo


class FakeTensorRT:
    """Build: writes which ONNX, profile and precision the plan is of. Check: passes unless told which
    precisions to refuse."""

    def __init__(self, refuse: tuple[str, ...] = ()) -> None:
        self.built: list[tuple[str, str]] = []
        self.refuse = refuse

    def build(self, slot: EngineSlot, fp16: bool) -> None:
        precision = "fp16" if fp16 else "fp32"
        slot.plan.write_text(f"{slot.onnx.read_text()} {slot.profile.max_batch} {precision}")
        self.built.append((slot.name, precision))

    def check(self, slot: EngineSlot, precision: str) -> PrecisionCheck:
        passed = precision not in self.refuse
        return PrecisionCheck(slot.role, "tensorrt", precision, passed, 12, 0.9999 if passed else 0.97,
                              reason="" if passed else "cosine 0.97000 < 0.999")

    def run(self, repository: Path, precision: str = "fp16", gpu: str = H100, trt: str = "10.5.0",
            cache: Path | None = None) -> dict[str, str]:
        self.built.clear()
        return build_repository_engines(repository, precision, gpus=[gpu], tensorrt=trt, cache=cache,
                                        build=self.build, check=self.check)


PROFILE = EngineProfile(1, 8, 16, (640, 640, 3))


@pytest.mark.parametrize("change", ["onnx", "profile", "precision", "tensorrt", "gpu"])
def test_the_key_changes_with_each_of_its_parts(change: str) -> None:
    parts: dict[str, object] = {"onnx_sha256": "a" * 64, "profile": PROFILE, "precision": "fp16",
                                "tensorrt": "10.5.0", "gpus": [H100]}
    other = {"onnx": {"onnx_sha256": "b" * 64}, "precision": {"precision": "fp32"},
             "profile": {"profile": EngineProfile(1, 16, 32, (640, 640, 3))},
             "tensorrt": {"tensorrt": "10.6.0"}, "gpu": {"gpus": [L4]}}[change]
    first, second = engine_key(**parts), engine_key(**{**parts, **other})  # type: ignore[arg-type]
    assert first != second and first.digest != second.digest
    assert engine_key(**parts) == first, "the same parts give the same key"  # type: ignore[arg-type]


def test_the_key_is_complete_and_stable() -> None:
    key = engine_key("a" * 64, PROFILE, "fp16", "10.5.0", [H100, H100])
    assert key == EngineKey("a" * 64, (1, 8, 16), (640, 640, 3), "fp16", "10.5.0", (H100,))
    assert json.loads(json.dumps(key.as_dict())) == key.as_dict()
    with pytest.raises(ValueError, match="precision"):
        engine_key("a" * 64, PROFILE, "int8", "10.5.0", [H100])
    with pytest.raises(ValueError, match="GPU"):
        engine_key("a" * 64, PROFILE, "fp16", "10.5.0", [])


def test_every_version_directory_is_a_slot(repository: Path) -> None:
    slots = engine_slots(repository)
    assert [(s.name, s.role, s.input_name) for s in slots] == [
        ("face_detector/1", "detector", "input"), ("face_detector/2", "detector", "input"),
        ("face_embedder/1", "embedder", "data"), ("face_embedder/2", "embedder", "data")]
    assert slots[0].profile == EngineProfile(1, 8, 16, (640, 640, 3))
    assert all(s.plan == s.onnx.with_name("model.plan") for s in slots)


def test_plans_for_every_version_then_kept(repository: Path) -> None:
    trt = FakeTensorRT()
    assert set(trt.run(repository).values()) == {"built fp16"}
    models = ("face_detector", "face_embedder")
    assert sorted(trt.built) == [(f"{m}/{v}", "fp16") for m in models for v in (1, 2)]
    assert set(trt.run(repository).values()) == {"kept"} and trt.built == []


@pytest.mark.parametrize(("change", "rebuilt"), [
    ("max_batch", ["face_detector/1", "face_detector/2"]),
    ("fp32", ["face_detector/1", "face_detector/2", "face_embedder/1", "face_embedder/2"]),
    ("tensorrt", ["face_detector/1", "face_detector/2", "face_embedder/1", "face_embedder/2"]),
    ("gpu", ["face_detector/1", "face_detector/2", "face_embedder/1", "face_embedder/2"]),
    ("onnx", ["face_embedder/2"]),
])
def test_a_changed_part_of_the_key_rebuilds_exactly_its_plans(repository: Path, change: str,
                                                              rebuilt: list[str]) -> None:
    trt = FakeTensorRT()
    trt.run(repository)
    if change == "max_batch":  # a re-tune raised max_batch_size: the old plan would not load
        trt_model(repository, "face_detector", "detector", max_batch=32)
    if change == "onnx":
        (repository / "face_embedder" / "2" / "model.onnx").write_bytes(b"a new embedder")
    trt.run(repository, precision="fp32" if change == "fp32" else "fp16",
            trt="10.6.0" if change == "tensorrt" else "10.5.0", gpu=L4 if change == "gpu" else H100)
    assert sorted(name for name, _ in trt.built) == rebuilt
    if change == "max_batch":
        assert (repository / "face_detector" / "2" / "model.plan").read_text() == "face_detector v2 32 fp16"


def test_a_plan_without_its_key_is_rebuilt_however_new(repository: Path) -> None:
    """The old rule (a plan newer than its ONNX is kept) reused plans of another profile or precision."""
    plan = repository / "face_detector" / "1" / "model.plan"
    plan.write_text("some older build at max batch 8")
    assert FakeTensorRT().run(repository)["face_detector/1"] == "built fp16"
    assert plan.read_text() == "face_detector v1 16 fp16"
    assert json.loads(plan.with_name(KEY_FILE).read_text())["key"]["batches"] == [1, 8, 16]


def test_the_cache_serves_another_container_with_the_same_key(repository: Path, tmp_path: Path) -> None:
    cache = tmp_path / "engines"
    trt = FakeTensorRT()
    trt.run(repository, cache=cache)
    fresh = tmp_path / "fresh"
    shutil.copytree(repository, fresh, ignore=shutil.ignore_patterns("model.plan*"))
    assert set(trt.run(fresh, cache=cache).values()) == {"cached"} and trt.built == []
    assert (fresh / "face_embedder" / "1" / "model.plan").read_text() == "face_embedder v1 16 fp16"
    shutil.rmtree(fresh)
    shutil.copytree(repository, fresh, ignore=shutil.ignore_patterns("model.plan*"))
    assert set(trt.run(fresh, gpu=L4, cache=cache).values()) == {"built fp16"}, "another GPU: its own key"
    assert len(list((cache / "face_detector").iterdir())) == 4, "two versions x two GPUs"


def test_a_rollback_to_version_1_finds_its_plan(repository: Path) -> None:
    trt = FakeTensorRT()
    trt.run(repository)
    pin_version(repository, "face_detector", 1)
    version_1 = next(s for s in engine_slots(repository) if s.name == "face_detector/1")
    key = engine_key(engine_cache.sha256_of(version_1.onnx), version_1.profile, "fp16", "10.5.0", [H100])
    assert is_current(version_1, key), "the pinned version has a plan of its own ONNX"
    config = (repository / "face_detector" / "config.pbtxt").read_text()
    assert "version_policy {\n  specific {\n    versions: 1" in config
    assert set(trt.run(repository).values()) == {"kept"}


def test_a_refused_fp16_plan_is_replaced_by_fp32(repository: Path) -> None:
    trt = FakeTensorRT(refuse=("fp16",))
    outcome = trt.run(repository)
    assert set(outcome.values()) == {"built fp32 (fp16 refused)"}
    plan = repository / "face_detector" / "2" / "model.plan"
    assert plan.read_text().endswith("fp32")
    meta = json.loads(plan.with_name(KEY_FILE).read_text())
    assert meta["built_precision"] == "fp32" and meta["key"]["precision"] == "fp16"
    assert "refused (cosine 0.97000 < 0.999)" in meta["checks"][0]


def test_no_passing_precision_stops_the_build_and_leaves_no_plan(repository: Path) -> None:
    trt = FakeTensorRT(refuse=("fp16", "fp32"))
    slot = engine_slots(repository)[0]
    slot.plan.write_text("stale")
    with pytest.raises(EngineRefused, match="no TensorRT plan matches the ONNX model"):
        key = engine_key("a" * 64, slot.profile, "fp16", "10.5.0", [H100])
        build_checked(slot, key, trt.build, trt.check)
    assert not slot.plan.exists() and not slot.plan.with_name(KEY_FILE).exists()
    assert trt.built == [("face_detector/1", "fp16"), ("face_detector/1", "fp32")]


def test_cache_restores_only_its_own_key(repository: Path, tmp_path: Path) -> None:
    trt = FakeTensorRT()
    trt.run(repository, cache=tmp_path / "engines")
    slot = engine_slots(repository)[0]
    other = engine_key("c" * 64, slot.profile, "fp16", "10.5.0", [H100])
    assert not EngineCache(tmp_path / "engines").restore(slot, other)


def test_the_command_line_without_tensorrt_says_where_to_build(repository: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    from export import __main__ as cli
    from export.tensorrt_build import tensorrt_available

    if tensorrt_available():
        pytest.skip("TensorRT is installed here")
    assert cli.main(["tensorrt", "--repository", str(repository), "--gpu-name", H100]) == 1
    assert "NGC" in caplog.text
    assert not list(repository.glob("*/*/model.plan")), "nothing half-built"
