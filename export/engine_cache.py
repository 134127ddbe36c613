"""The TensorRT engines of a ``gpu`` repository: a plan for every servable version, keyed, checked, cached.

A plan is only valid for what built it, so it is identified by its ``EngineKey``: the sha256 of its ONNX
file, the optimization profile (batch range and item shape, from ``config.pbtxt``), the precision asked
for, the TensorRT version and the GPU model(s). The key sits beside the plan (``model.plan.json``); a
plan whose key differs from the one wanted now is rebuilt, never reused (a raised ``max_batch_size``, a
switch to FP32, a new TensorRT, another GPU).

Every version directory with a ``model.onnx`` gets its plan, not only the newest: ``python -m export pin
--version 1`` (a rollback) then finds one to load. Each new plan is compared with its ONNX model on real
faces (``export.engine_check``) before it is used; an FP16 plan that fails is replaced by an FP32 one,
and an FP32 plan that fails stops the build. With a cache directory (the ``engines`` volume), plans are
stored under ``<cache>/<model>/<key digest>/`` and restored from there at the next start.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

from export.precision import PrecisionCheck
from export.tensorrt_build import (
    EngineProfile,
    build_engine,
    read_config,
    repository_profile,
    tensorrt_version,
)
from facecore.files import sha256_of

log = logging.getLogger(__name__)

PLAN = "model.plan"
KEY_FILE = "model.plan.json"
PRECISIONS = ("fp16", "fp32")


class EngineRefused(RuntimeError):
    """A plan did not pass its comparison with the ONNX model."""


@dataclass(frozen=True)
class EngineKey:
    onnx_sha256: str
    batches: tuple[int, int, int]  # min, opt, max of the one optimization profile
    item_shape: tuple[int, ...]
    precision: str  # asked for: fp16 or fp32
    tensorrt: str
    gpus: tuple[str, ...]  # every distinct GPU name, sorted

    def as_dict(self) -> dict[str, object]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()[:20]


def engine_key(onnx_sha256: str, profile: EngineProfile, precision: str, tensorrt: str,
               gpus: Sequence[str]) -> EngineKey:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if profile.shape is None:
        raise ValueError("the profile needs the item shape")
    if not tensorrt or not gpus:
        raise ValueError("the key needs the TensorRT version and the GPU name(s)")
    return EngineKey(onnx_sha256, (profile.min_batch, profile.opt_batch, profile.max_batch),
                     tuple(profile.shape), precision, tensorrt, tuple(sorted(set(gpus))))


@dataclass(frozen=True)
class EngineSlot:
    """One servable version of one ``tensorrt_plan`` model."""

    model: str
    version: int
    role: str  # detector or embedder (from the spec the exporter recorded), "" if unknown
    input_name: str
    profile: EngineProfile
    onnx: Path
    plan: Path

    @property
    def name(self) -> str:
        return f"{self.model}/{self.version}"


def _role(config: object) -> str:
    parameters = getattr(config, "parameters", {})
    try:
        return str(json.loads(parameters["spec"].string_value).get("role", ""))
    except (KeyError, ValueError):
        return ""


def engine_slots(repository: Path) -> list[EngineSlot]:
    """Every version directory with a ``model.onnx`` of every ``tensorrt_plan`` model, oldest first."""
    slots = []
    for config_path in sorted(Path(repository).glob("*/config.pbtxt")):
        config = read_config(config_path)
        if config.platform != "tensorrt_plan" and config.backend != "tensorrt":
            continue
        model_dir = config_path.parent
        versions = sorted(int(d.name) for d in model_dir.iterdir()
                          if d.name.isdigit() and (d / "model.onnx").is_file())
        if not versions:
            log.warning("%s: no version directory with model.onnx; skipped", model_dir.name)
            continue
        input_name, profile = repository_profile(model_dir.name, config)
        filename = config.default_model_filename or PLAN
        for version in versions:
            onnx = model_dir / str(version) / "model.onnx"
            slots.append(EngineSlot(model_dir.name, version, _role(config), input_name, profile, onnx,
                                    onnx.with_name(filename)))
    return slots


def recorded(plan: Path) -> dict[str, object] | None:
    """What ``model.plan.json`` says about the plan beside it (None: no plan or no record)."""
    meta = plan.with_name(KEY_FILE)
    if not (plan.is_file() and meta.is_file()):
        return None
    try:
        data: dict[str, object] = json.loads(meta.read_text())
    except ValueError:
        return None
    return data


def is_current(slot: EngineSlot, key: EngineKey) -> bool:
    meta = recorded(slot.plan)
    return meta is not None and meta.get("key") == key.as_dict()


def _copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.copyfile(source, tmp)
    os.replace(tmp, target)


@dataclass(frozen=True)
class EngineCache:
    """``<root>/<model>/<key digest>/{model.plan, model.plan.json}``."""

    root: Path

    def _dir(self, slot: EngineSlot, key: EngineKey) -> Path:
        return self.root / slot.model / key.digest

    def restore(self, slot: EngineSlot, key: EngineKey) -> bool:
        cached = self._dir(slot, key) / PLAN
        meta = recorded(cached)
        if meta is None or meta.get("key") != key.as_dict():
            return False
        _copy(cached.with_name(KEY_FILE), slot.plan.with_name(KEY_FILE))
        _copy(cached, slot.plan)
        return True

    def store(self, slot: EngineSlot, key: EngineKey) -> None:
        where = self._dir(slot, key)
        _copy(slot.plan, where / PLAN)
        _copy(slot.plan.with_name(KEY_FILE), where / KEY_FILE)

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Exclusive, for containers that share the volume."""
        self.root.mkdir(parents=True, exist_ok=True)
        with (self.root / ".lock").open("a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)


#: Builds ``slot.plan`` from ``slot.onnx`` (fp16 or not).
Build = Callable[[EngineSlot, bool], None]
#: Compares the freshly built ``slot.plan`` with its ONNX model.
Check = Callable[[EngineSlot, str], PrecisionCheck]


def _write_key(slot: EngineSlot, key: EngineKey, built: str, checks: Sequence[PrecisionCheck]) -> None:
    meta = {"key": key.as_dict(), "model": slot.model, "version": slot.version, "built_precision": built,
            "checks": [c.summary() for c in checks],
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    slot.plan.with_name(KEY_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def build_checked(slot: EngineSlot, key: EngineKey, build: Build, check: Check) -> str:
    """Build the plan at the key's precision, falling back from a refused FP16 to FP32; returns what it
    did. Raises ``EngineRefused`` when no precision passes (and leaves no plan behind)."""
    slot.plan.with_name(KEY_FILE).unlink(missing_ok=True)
    slot.plan.unlink(missing_ok=True)  # a stale plan is never served, even if this build fails
    checks: list[PrecisionCheck] = []
    for precision in PRECISIONS[PRECISIONS.index(key.precision):]:
        build(slot, precision == "fp16")
        result = check(slot, precision)
        checks.append(result)
        log.info("%s: %s", slot.name, result.summary())
        if result.passed:
            _write_key(slot, key, precision, checks)
            return f"built {precision}" + ("" if precision == key.precision else " (fp16 refused)")
        log.warning("%s: the %s plan differs from its ONNX model: %s", slot.name, precision, result.reason)
        slot.plan.unlink(missing_ok=True)
    raise EngineRefused(f"{slot.name}: no TensorRT plan matches the ONNX model: "
                        + "; ".join(c.summary() for c in checks))


def prepare_engines(slots: Sequence[EngineSlot], key_of: Callable[[EngineSlot], EngineKey],
                    build: Build, check: Check, cache: EngineCache | None = None) -> dict[str, str]:
    """Make every slot's plan current: kept, restored from the cache, or built and checked."""
    outcome: dict[str, str] = {}
    with cache.locked() if cache is not None else nullcontext():
        for slot in slots:
            key = key_of(slot)
            if is_current(slot, key):
                outcome[slot.name] = "kept"
            elif cache is not None and cache.restore(slot, key):
                outcome[slot.name] = "cached"
            else:
                outcome[slot.name] = build_checked(slot, key, build, check)
                if cache is not None:
                    cache.store(slot, key)
            log.info("%s: %s (%s)", slot.name, outcome[slot.name], key.digest)
    return outcome


def visible_gpus() -> list[str]:
    """The names of the GPUs ``nvidia-smi`` lists."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise ValueError(f"cannot list the GPUs ({exc}); give their name with --gpu-name") from exc
    names = [line.strip() for line in out.splitlines() if line.strip()]
    if not names:
        raise ValueError("nvidia-smi lists no GPU; give its name with --gpu-name")
    return names


def _build_with_tensorrt(slot: EngineSlot, fp16: bool) -> None:
    build_engine(slot.onnx, slot.plan, slot.profile, fp16=fp16, input_name=slot.input_name)


def build_repository_engines(repository: Path, precision: str = "fp16", *, gpus: Sequence[str] = (),
                             tensorrt: str = "", cache: Path | None = None, photos: Path | None = None,
                             build: Build | None = None, check: Check | None = None) -> dict[str, str]:
    """Make the plan of every servable version current (see the module's docstring); slot -> outcome.

    ``gpus`` and ``tensorrt`` default to what ``nvidia-smi`` and the TensorRT bindings say; ``photos`` are
    the test photos the new plans are checked on (``build`` and ``check`` replace TensorRT and that check
    in tests)."""
    slots = engine_slots(repository)
    if not slots:
        log.info("%s has no tensorrt_plan model: nothing to build", repository)
        return {}
    names, version = list(gpus) or visible_gpus(), tensorrt or tensorrt_version()
    if len(set(names)) > 1:
        log.warning("GPUs of different models are visible (%s): the engines must suit all of them", names)
    if check is None:
        from export.engine_check import plan_check

        check = plan_check(repository, slots, photos)

    def key_of(slot: EngineSlot) -> EngineKey:
        return engine_key(sha256_of(slot.onnx), slot.profile, precision, version, names)

    return prepare_engines(slots, key_of, build or _build_with_tensorrt, check,
                           EngineCache(cache) if cache is not None else None)
