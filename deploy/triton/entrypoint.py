"""Entrypoint of the GPU Triton image: model repository, TensorRT engine cache, then ``exec tritonserver``.

1. **Repository.** ``/models/gpu`` (the ``models`` volume) is seeded from the repository baked into
   the image at build time (``python -m export defaults --profiles gpu``). It is re-seeded when the
   image's repository changes (a ``.facerec-seed`` digest records what it was seeded from); a
   repository without that marker was put there by an operator and is used as found.
2. **Engines.** TensorRT engines are specific to the GPU model and the TensorRT version, so they are
   cached in the ``engines`` volume under a key made of both
   (``/engines/<gpu names>__trt-<version>/<model>/<version>/model.plan``) together with the sha256 of
   the ONNX file they were built from. At every start the engines of the present key are copied
   beside their ``model.onnx`` (stale ones are removed), ``python -m export tensorrt --repository``
   builds whatever is missing (the first start on a GPU takes minutes), and new engines are stored
   back. Another GPU or another TensorRT therefore means another key and a rebuild; a new ONNX file
   means a rebuild of that model only.
3. **Server.** ``exec tritonserver --model-repository=/models/gpu --model-control-mode=none`` with
   HTTP 8000, gRPC 8001 and metrics 8002; arguments given to this script are appended.

Environment (all optional): ``FACEREC_IMAGE_REPOSITORY`` (baked repository),
``FACEREC_MODEL_REPOSITORY`` (served repository), ``FACEREC_ENGINE_CACHE`` (engine volume),
``FACEREC_ENGINE_FP32=1`` (FP32 engines), ``FACEREC_GPU_NAME`` / ``FACEREC_TRT_VERSION`` (override
detection), ``FACEREC_TRITONSERVER`` (server binary).

Standard library only: it runs before anything else and is unit-tested without a GPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("facerec.triton")

SEED_MARKER = ".facerec-seed"
PLAN = "model.plan"
ONNX = "model.onnx"
PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}
_TRT_PLATFORM = re.compile(r'^\s*(platform:\s*"tensorrt_plan"|backend:\s*"tensorrt")\s*$', re.MULTILINE)
_DEFAULT_FILENAME = re.compile(r'^\s*default_model_filename:\s*"([^"]+)"\s*$', re.MULTILINE)


class EntrypointError(RuntimeError):
    """A start-up step failed; the message says what to do."""


@dataclass(frozen=True)
class Paths:
    image_repository: Path
    repository: Path
    engine_cache: Path

    @staticmethod
    def from_env(env: Mapping[str, str]) -> Paths:
        return Paths(
            image_repository=Path(env.get("FACEREC_IMAGE_REPOSITORY", "/opt/facerec/model_repository/gpu")),
            repository=Path(env.get("FACEREC_MODEL_REPOSITORY", "/models/gpu")),
            engine_cache=Path(env.get("FACEREC_ENGINE_CACHE", "/engines")),
        )


# --- model repository ------------------------------------------------------------------------------

def _files(root: Path) -> Iterator[Path]:
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root)
        skipped = relative.name in (SEED_MARKER, PLAN) or "__pycache__" in relative.parts
        if path.is_file() and not skipped:
            yield path


def tree_digest(root: Path) -> str:
    """sha256 over the relative paths and contents of a repository (engines and markers excluded)."""
    digest = hashlib.sha256()
    for path in _files(root):
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(file_sha256(path).encode() + b"\0")
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _has_models(repository: Path) -> bool:
    return repository.is_dir() and any(repository.glob("*/config.pbtxt"))


def seed_repository(source: Path, target: Path) -> str:
    """Copy ``source`` to ``target`` when needed; returns what was done (``seeded``/``kept``/``operator``)."""
    marker = target / SEED_MARKER
    if _has_models(target) and not marker.exists():
        log.info("%s has no %s: an operator's repository, used as found", target, SEED_MARKER)
        return "operator"
    if not _has_models(source):
        if _has_models(target):
            log.warning("the image has no repository at %s; serving %s as found", source, target)
            return "kept"
        raise EntrypointError(f"no model repository: neither {source} (image) nor {target} (volume) "
                              "has models")
    digest = tree_digest(source)
    if _has_models(target) and marker.read_text().strip() == digest:
        return "kept"
    staging = target.with_name(f".{target.name}.staging-{os.getpid()}")
    retired = target.with_name(f".{target.name}.old-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging, ignore=shutil.ignore_patterns(PLAN, SEED_MARKER, "__pycache__"))
    (staging / SEED_MARKER).write_text(digest + "\n")
    if target.exists():
        target.rename(retired)
    staging.rename(target)
    shutil.rmtree(retired, ignore_errors=True)
    log.info("seeded %s from %s (%s)", target, source, digest[:12])
    return "seeded"


@dataclass(frozen=True)
class EngineSlot:
    """The latest version of one ``tensorrt_plan`` model: where its ONNX is and its engine goes."""

    model: str
    version: str
    onnx: Path
    plan: Path


def engine_slots(repository: Path) -> list[EngineSlot]:
    slots = []
    for config in sorted(repository.glob("*/config.pbtxt")):
        text = config.read_text(encoding="utf-8")
        if not _TRT_PLATFORM.search(text):
            continue
        versions = [d for d in config.parent.iterdir() if d.name.isdigit() and (d / ONNX).is_file()]
        if not versions:
            log.warning("%s: no version directory with %s", config.parent.name, ONNX)
            continue
        latest = max(versions, key=lambda d: int(d.name))
        filename = _DEFAULT_FILENAME.search(text)
        plan = latest / (filename.group(1) if filename else PLAN)
        slots.append(EngineSlot(config.parent.name, latest.name, latest / ONNX, plan))
    return slots


# --- what the engines are specific to ---------------------------------------------------------------

def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-") or "unknown"


def cache_key(gpu_names: Sequence[str], trt_version: str) -> str:
    """``NVIDIA-H100-80GB-HBM3__trt-10.5.0.18-1-cuda12.6``: every distinct GPU name, then TensorRT."""
    names = sorted({_slug(name) for name in gpu_names})
    if not names:
        raise EntrypointError("no GPU name to key the engine cache with")
    return f"{'+'.join(names)}__trt-{_slug(trt_version)}"


def _run(command: Sequence[str]) -> str:
    return subprocess.run(list(command), capture_output=True, text=True, timeout=60, check=True).stdout


def _nvidia_smi_names() -> list[str]:
    out = _run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"])
    return [line.strip() for line in out.splitlines() if line.strip()]


def _libcuda_names() -> list[str]:
    cuda = ctypes.CDLL("libcuda.so.1")
    if cuda.cuInit(0) != 0:
        return []
    count = ctypes.c_int()
    cuda.cuDeviceGetCount(ctypes.byref(count))
    names = []
    for index in range(count.value):
        device = ctypes.c_int()
        cuda.cuDeviceGet(ctypes.byref(device), index)
        buffer = ctypes.create_string_buffer(256)
        cuda.cuDeviceGetName(buffer, len(buffer), device)
        names.append(buffer.value.decode())
    return names


def gpu_names(env: Mapping[str, str]) -> list[str]:
    """Names of the GPUs this container sees (nvidia-smi, else the CUDA driver API)."""
    if env.get("FACEREC_GPU_NAME"):
        return [env["FACEREC_GPU_NAME"]]
    for probe in (_nvidia_smi_names, _libcuda_names):
        try:
            names = probe()
        except (OSError, subprocess.SubprocessError, AttributeError) as exc:
            log.debug("%s: %r", probe.__name__, exc)
            continue
        if names:
            return names
    raise EntrypointError(
        "no GPU is visible in this container: start it with the NVIDIA container runtime "
        "(compose: deploy.resources.reservations.devices; docker run --gpus all; Kubernetes: an "
        "nvidia.com/gpu limit), or use the CPU variant (docker-compose.cpu.yml)"
    )


def _dpkg_tensorrt() -> str:
    return _run(["dpkg-query", "-W", "-f=${Version}", "libnvinfer10"]).strip()


def _library_tensorrt() -> str:
    name = ctypes.util.find_library("nvinfer") or "libnvinfer.so.10"
    ctypes.CDLL(name)
    for line in Path("/proc/self/maps").read_text().splitlines():
        if "libnvinfer.so" in line:
            real = os.path.realpath(line.split()[-1])
            match = re.search(r"libnvinfer\.so\.([0-9.]+)$", real)
            if match:
                return match.group(1)
    return ""


def _bindings_tensorrt() -> str:
    out = _run([sys.executable, "-c", "import tensorrt; print(tensorrt.__version__)"])
    return out.strip()


def tensorrt_version(env: Mapping[str, str]) -> str:
    """The TensorRT that builds and runs the engines: the image's package, its library, the bindings."""
    if env.get("FACEREC_TRT_VERSION"):
        return env["FACEREC_TRT_VERSION"]
    for probe in (_dpkg_tensorrt, _library_tensorrt, _bindings_tensorrt):
        try:
            version = probe()
        except (OSError, subprocess.SubprocessError) as exc:
            log.debug("%s: %r", probe.__name__, exc)
            continue
        if version:
            return version
    raise EntrypointError("cannot tell the TensorRT version (no libnvinfer10 package, library or bindings)")


# --- the engine cache --------------------------------------------------------------------------------

@contextmanager
def locked(directory: Path) -> Iterator[None]:
    """An exclusive lock on the cache, for containers that share the volume."""
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / ".lock").open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _cached(cache: Path, slot: EngineSlot) -> tuple[Path, Path]:
    base = cache / slot.model / slot.version
    return base / PLAN, base / "engine.json"


def restore_engines(cache: Path, slots: Sequence[EngineSlot]) -> dict[str, str]:
    """Put the cached engine of each slot beside its ONNX, or remove a stale one; model -> outcome."""
    outcome = {}
    for slot in slots:
        plan, meta = _cached(cache, slot)
        wanted = file_sha256(slot.onnx)
        recorded = json.loads(meta.read_text()).get("onnx_sha256") if meta.is_file() else None
        if plan.is_file() and recorded == wanted:
            tmp = slot.plan.with_name(f".{slot.plan.name}.{os.getpid()}.tmp")
            shutil.copyfile(plan, tmp)
            os.replace(tmp, slot.plan)
            os.utime(slot.plan)  # newer than model.onnx: the builder keeps it
            outcome[slot.model] = "cached"
        else:
            slot.plan.unlink(missing_ok=True)  # built for another GPU, TensorRT or ONNX file
            outcome[slot.model] = "build"
    return outcome


def store_engines(cache: Path, slots: Sequence[EngineSlot], key_info: Mapping[str, object]) -> list[str]:
    """Copy freshly built engines into the cache; returns the models stored."""
    stored = []
    for slot in slots:
        if not slot.plan.is_file():
            raise EntrypointError(f"{slot.model}: no engine at {slot.plan} after the build")
        plan, meta = _cached(cache, slot)
        onnx_sha = file_sha256(slot.onnx)
        if plan.is_file() and meta.is_file() and json.loads(meta.read_text()).get("onnx_sha256") == onnx_sha \
                and file_sha256(plan) == file_sha256(slot.plan):
            continue
        plan.parent.mkdir(parents=True, exist_ok=True)
        tmp = plan.with_name(f".{plan.name}.{os.getpid()}.tmp")
        shutil.copyfile(slot.plan, tmp)
        os.replace(tmp, plan)
        meta.write_text(json.dumps({"onnx_sha256": onnx_sha, "model": slot.model, "version": slot.version,
                                    "stored_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                    **key_info}, indent=2) + "\n")
        stored.append(slot.model)
    return stored


def build_command(repository: Path, fp32: bool) -> list[str]:
    return [sys.executable, "-m", "export", "tensorrt", "--repository", str(repository),
            *(["--fp32"] if fp32 else [])]


def _build(command: Sequence[str]) -> None:
    subprocess.run(list(command), check=True)


def prepare_engines(paths: Paths, env: Mapping[str, str],
                    build: Callable[[Sequence[str]], None] = _build) -> dict[str, str]:
    """Restore or build every engine of ``paths.repository``; model -> ``cached`` or ``built``."""
    slots = engine_slots(paths.repository)
    if not slots:
        log.info("%s has no tensorrt_plan model: nothing to build", paths.repository)
        return {}
    names, version = gpu_names(env), tensorrt_version(env)
    key = cache_key(names, version)
    if len(set(names)) > 1:
        log.warning("GPUs of different models are visible (%s): the engines must suit all of them", names)
    cache = paths.engine_cache / key
    with locked(paths.engine_cache):
        outcome = restore_engines(cache, slots)
        missing = [model for model, state in outcome.items() if state == "build"]
        if missing:
            log.info("building TensorRT engines for %s on %s (TensorRT %s); the first start on a GPU takes "
                     "minutes", ", ".join(missing), ", ".join(sorted(set(names))), version)
            started = time.monotonic()
            try:
                build(build_command(paths.repository, env.get("FACEREC_ENGINE_FP32", "0") == "1"))
            except subprocess.CalledProcessError as exc:
                raise EntrypointError(
                    f"the TensorRT build failed (exit code {exc.returncode}); see above") from exc
            log.info("engines built in %.0f s", time.monotonic() - started)
            store_engines(cache, slots, {"gpu_names": names, "tensorrt": version, "key": key})
            outcome.update(dict.fromkeys(missing, "built"))
        else:
            log.info("engines for %s restored from %s", ", ".join(outcome), cache)
    return outcome


def server_command(repository: Path, extra: Sequence[str], env: Mapping[str, str]) -> list[str]:
    return [env.get("FACEREC_TRITONSERVER", "tritonserver"), f"--model-repository={repository}",
            "--model-control-mode=none", f"--http-port={PORTS['http']}", f"--grpc-port={PORTS['grpc']}",
            f"--metrics-port={PORTS['metrics']}", *extra]


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None,
         build: Callable[[Sequence[str]], None] = _build,
         execute: Callable[[list[str]], object] | None = None) -> int:
    env = os.environ if env is None else env
    extra = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    paths = Paths.from_env(env)
    try:
        seed_repository(paths.image_repository, paths.repository)
        prepare_engines(paths, env, build)
    except EntrypointError as exc:
        log.error("%s", exc)
        return 1
    command = server_command(paths.repository, extra, env)
    log.info("exec %s", " ".join(command))
    sys.stdout.flush()
    sys.stderr.flush()
    if execute is not None:
        execute(command)
        return 0
    os.execvp(command[0], command)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
