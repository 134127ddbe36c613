"""Entrypoint of the GPU Triton image: repository, TensorRT engines, host sizing, then ``exec tritonserver``.

The image's ENTRYPOINT is NGC's ``/opt/nvidia/nvidia_entrypoint.sh`` followed by this script, so CUDA
forward compatibility on older data-centre drivers is set up (by NGC's ``entrypoint.d``) before anything
here touches the GPU.

1. **Repository.** ``/models/gpu`` (the ``models`` volume) is seeded from the repository baked into
   the image at build time (``python -m export defaults --profiles gpu``). It is re-seeded when the
   image's repository changes (a ``.facerec-seed`` digest records what it was seeded from); a
   repository without that marker was put there by an operator and is used as found.
2. **Engines.** ``python -m export tensorrt --repository`` (``export/engine_cache.py``) makes the plan
   of every servable version current: each plan is keyed by (ONNX sha256, optimization profile,
   precision, TensorRT version, GPU model), restored from the ``engines`` volume when that key was built
   before, else built and compared with its ONNX model on the test photos baked into the image (an FP16
   plan that fails is replaced by an FP32 one). This script detects the GPU model(s) and the TensorRT
   version and passes them on; it fails clearly when no GPU is visible.
3. **Host sizing.** ``face_pipeline``'s instance count (its Python work: decode, letterbox, NMS,
   alignment) is set from the CPUs this container may use (affinity and cgroup quota), leaving two for
   Triton itself; ``FACEREC_PIPELINE_INSTANCES`` sets it (a number) or keeps the config's (``config``).
4. **Server.** ``exec tritonserver --model-repository=/models/gpu --model-control-mode=none`` with
   HTTP 8000, gRPC 8001 and metrics 8002 and the gRPC keepalive the gateway's channels need
   (``KEEPALIVE``); arguments given to this script are appended. Its Python-backend shared memory is
   named ``SHM_PREFIX``, and what a killed run left of it in /dev/shm is removed first (Kubernetes keeps
   the pod's /dev/shm volume when the liveness probe restarts the container).

Environment (all optional): ``FACEREC_IMAGE_REPOSITORY`` (baked repository),
``FACEREC_MODEL_REPOSITORY`` (served repository), ``FACEREC_ENGINE_CACHE`` (engine volume),
``FACEREC_ENGINE_FP32=1`` (FP32 engines), ``FACEREC_CHECK_PHOTOS`` (the photos plans are checked on),
``FACEREC_GPU_NAME`` / ``FACEREC_TRT_VERSION`` (override detection), ``FACEREC_PIPELINE_INSTANCES``,
``FACEREC_TRITONSERVER`` (server binary).

Standard library only: it runs before anything else and is unit-tested without a GPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("facerec.triton")

SEED_MARKER = ".facerec-seed"
PLAN = "model.plan"
ONNX = "model.onnx"
PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}
SHM_PREFIX = "facerec_triton_"
#: The gateway's channels ping every 2 s, also without calls (facecore/client.py): allowed here, or Triton
#: answers GOAWAY too_many_pings; Triton's own pings notice a gateway that vanished. The flags of
#: ``keepalive_args`` in service/launcher.py (tests/deploy/test_gpu.py compares them).
KEEPALIVE = ("--grpc-keepalive-time=10000", "--grpc-keepalive-timeout=5000",
             "--grpc-keepalive-permit-without-calls=1", "--grpc-http2-max-pings-without-data=0",
             "--grpc-http2-min-recv-ping-interval-without-data=1000")
_TRT_PLATFORM = re.compile(r'^\s*(platform:\s*"tensorrt_plan"|backend:\s*"tensorrt")\s*$', re.MULTILINE)
_DEFAULT_FILENAME = re.compile(r'^\s*default_model_filename:\s*"([^"]+)"\s*$', re.MULTILINE)


class EntrypointError(RuntimeError):
    """A start-up step failed; the message says what to do."""


@dataclass(frozen=True)
class Paths:
    image_repository: Path
    repository: Path
    engine_cache: Path
    check_photos: Path

    @staticmethod
    def from_env(env: Mapping[str, str]) -> Paths:
        return Paths(
            image_repository=Path(env.get("FACEREC_IMAGE_REPOSITORY", "/opt/facerec/model_repository/gpu")),
            repository=Path(env.get("FACEREC_MODEL_REPOSITORY", "/models/gpu")),
            engine_cache=Path(env.get("FACEREC_ENGINE_CACHE", "/engines")),
            check_photos=Path(env.get("FACEREC_CHECK_PHOTOS", "/opt/facerec/check-photos")),
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


def tensorrt_models(repository: Path) -> list[str]:
    """The ``tensorrt_plan`` models of a repository."""
    return [config.parent.name for config in sorted(repository.glob("*/config.pbtxt"))
            if _TRT_PLATFORM.search(config.read_text(encoding="utf-8"))]


# --- what the engines are specific to ---------------------------------------------------------------

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


# --- the engines -------------------------------------------------------------------------------------

def build_command(paths: Paths, gpus: Sequence[str], trt_version: str, fp32: bool) -> list[str]:
    """``python -m export tensorrt --repository``: keys, cache, build and check (export/engine_cache.py)."""
    return [sys.executable, "-m", "export", "tensorrt", "--repository", str(paths.repository),
            "--engine-cache", str(paths.engine_cache), "--check-photos", str(paths.check_photos),
            *(arg for name in sorted(set(gpus)) for arg in ("--gpu-name", name)),
            "--tensorrt-version", trt_version, *(["--fp32"] if fp32 else [])]


def _build(command: Sequence[str]) -> None:
    subprocess.run(list(command), check=True)


def prepare_engines(paths: Paths, env: Mapping[str, str],
                    build: Callable[[Sequence[str]], None] = _build) -> None:
    """Make the plan of every servable version current (restored, or built and checked)."""
    models = tensorrt_models(paths.repository)
    if not models:
        log.info("%s has no tensorrt_plan model: nothing to build", paths.repository)
        return
    names, version = gpu_names(env), tensorrt_version(env)
    log.info("TensorRT engines of %s for %s (TensorRT %s); a first build takes minutes", ", ".join(models),
             ", ".join(sorted(set(names))), version)
    started = time.monotonic()
    try:
        build(build_command(paths, names, version, env.get("FACEREC_ENGINE_FP32", "0") == "1"))
    except subprocess.CalledProcessError as exc:
        raise EntrypointError(f"the TensorRT engines could not be prepared (exit code {exc.returncode}); "
                              "see above") from exc
    log.info("engines ready in %.0f s", time.monotonic() - started)


# --- sizing to the host ------------------------------------------------------------------------------

_INSTANCES = re.compile(r"(instance_group\s*\{[^}]*?count:\s*)(\d+)")
#: CPUs left to tritonserver itself (gRPC/HTTP frontends, the TensorRT instances' threads).
RESERVED_CPUS = 2


def usable_cpus(affinity: int, cpu_max: str | None) -> int:
    """CPUs this container may use: its affinity, bounded by a cgroup v2 quota (``cpu.max``)."""
    if cpu_max:
        quota, _, period = cpu_max.strip().partition(" ")
        if quota != "max" and quota.isdigit() and period.isdigit() and int(period) > 0:
            return max(1, min(affinity, -(-int(quota) // int(period))))
    return max(1, affinity)


def pipeline_instances(env: Mapping[str, str], cpus: int) -> int | None:
    """face_pipeline's instance count: FACEREC_PIPELINE_INSTANCES, or one per CPU left over (None: keep)."""
    wanted = env.get("FACEREC_PIPELINE_INSTANCES", "auto").strip().lower()
    if wanted == "config":
        return None
    if wanted == "auto":
        return max(1, cpus - RESERVED_CPUS)
    if wanted.isdigit() and int(wanted) >= 1:
        return int(wanted)
    raise EntrypointError(f"FACEREC_PIPELINE_INSTANCES must be auto, config or a number, got {wanted!r}")


def with_instance_count(config_text: str, count: int) -> str:
    """``config.pbtxt`` text with its (first) instance_group's count set to ``count``."""
    updated, found = _INSTANCES.subn(lambda m: f"{m.group(1)}{count}", config_text, count=1)
    if not found:
        raise EntrypointError("face_pipeline's config.pbtxt has no instance_group count to size")
    return updated


def _host_cpus() -> int:
    cpu_max = Path("/sys/fs/cgroup/cpu.max")
    return usable_cpus(len(os.sched_getaffinity(0)), cpu_max.read_text() if cpu_max.is_file() else None)


def size_pipeline(repository: Path, env: Mapping[str, str], cpus: int | None = None) -> int | None:
    """Write face_pipeline's instance count for this host into the served repository; returns it."""
    config = repository / "face_pipeline" / "config.pbtxt"
    count = pipeline_instances(env, _host_cpus() if cpus is None else cpus)
    if count is None or not config.is_file():
        return None
    config.write_text(with_instance_count(config.read_text(encoding="utf-8"), count))
    log.info("face_pipeline: %d instances for this host", count)
    return count


def server_command(repository: Path, extra: Sequence[str], env: Mapping[str, str]) -> list[str]:
    return [env.get("FACEREC_TRITONSERVER", "tritonserver"), f"--model-repository={repository}",
            "--model-control-mode=none", f"--http-port={PORTS['http']}", f"--grpc-port={PORTS['grpc']}",
            f"--metrics-port={PORTS['metrics']}",
            f"--backend-config=python,shm-region-prefix-name={SHM_PREFIX}", *KEEPALIVE, *extra]


def remove_leftover_shm(shm: Path) -> int:
    """Remove the shared-memory regions a previous run of this container left (one killed as hung)."""
    leftovers = list(shm.glob(f"{SHM_PREFIX}*"))
    for leftover in leftovers:
        leftover.unlink(missing_ok=True)
    if leftovers:
        log.info("removed %d shared-memory regions a previous run left in %s", len(leftovers), shm)
    return len(leftovers)


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None,
         build: Callable[[Sequence[str]], None] = _build,
         execute: Callable[[list[str]], object] | None = None, shm: Path = Path("/dev/shm")) -> int:
    env = os.environ if env is None else env
    extra = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    paths = Paths.from_env(env)
    try:
        seed_repository(paths.image_repository, paths.repository)
        prepare_engines(paths, env, build)
        size_pipeline(paths.repository, env)
        remove_leftover_shm(shm)
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
