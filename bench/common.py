"""Shared pieces of the serving benchmarks: the served settings, photos, processes' CPU and memory,
closed-loop runs with CPU accounting, Triton statistics, the machine description.

Everything here reads ``/proc`` directly (no psutil): CPU time and resident memory of a process tree
(``tritonserver`` plus its Python-backend stub processes), sampled while a benchmark runs.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from bench.gallery import machine_description as gallery_machine
from bench.load import LoadResult, closed_loop
from facecore.pipeline import PipelineSettings
from facecore.processing import image_header

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "artifacts"
REPOSITORY = ROOT / "model_repository" / "cpu"
#: The photos every part measures: one face and six faces.
PHOTOS = ("obama.jpg", "t1.jpg")
MIB = 1 << 20
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def photo_label(name: str, data: bytes) -> str:
    _, width, height = image_header(data, 2**62)
    return f"{name} ({width}x{height})"


# --- the served models -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ServedModels:
    """What ``face_pipeline`` of a CPU repository runs: its settings and the two ONNX files."""

    settings: PipelineSettings
    detector_file: Path
    embedder_file: Path
    detector_threads: int
    embedder_threads: int
    repository: Path
    summary: str = ""  # instances, batching and threads of the three models, for the report


def _config(model_dir: Path) -> mc.ModelConfig:
    return text_format.Parse((model_dir / "config.pbtxt").read_text(), mc.ModelConfig())


def _latest_version(model_dir: Path) -> Path:
    versions = sorted((int(p.name), p) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())
    if not versions:
        raise FileNotFoundError(f"{model_dir} has no version directory")
    return versions[-1][1]


def served_models(repository: Path = REPOSITORY) -> ServedModels:
    """Read the settings ``face_pipeline`` serves (config.pbtxt parameters) and the ONNX files of the newest
    versions of ``face_detector`` and ``face_embedder``, so in-process baselines run exactly the same."""
    if not (repository / "face_pipeline" / "config.pbtxt").exists():
        raise FileNotFoundError(f"no CPU model repository at {repository}: run `python -m export defaults`")
    pipeline = _config(repository / "face_pipeline")
    settings = PipelineSettings.from_parameters({k: v.string_value for k, v in pipeline.parameters.items()})
    files, threads, lines = [], [], [_describe("face_pipeline", pipeline) + (
        f", dynamic_input {settings.dynamic_input}, decode_min_side {settings.decode_min_side}")]
    for name in (settings.detector_model, settings.embedder_model):
        config = _config(repository / name)
        files.append(_latest_version(repository / name) / config.parameters["onnx_file"].string_value)
        threads.append(int(config.parameters["intra_op_threads"].string_value or "0"))
        lines.append(_describe(name, config) + f", {threads[-1]} ONNX Runtime intra-op thread(s)")
    return ServedModels(settings, files[0], files[1], threads[0], threads[1], repository, "; ".join(lines))


def _describe(name: str, config: mc.ModelConfig) -> str:
    instances = sum(group.count or 1 for group in config.instance_group) or 1
    batching = config.dynamic_batching
    preferred = "/".join(str(b) for b in batching.preferred_batch_size) or "none"
    return (f"{name}: {instances} instance(s), max batch {config.max_batch_size}, preferred {preferred}, "
            f"queue delay {batching.max_queue_delay_microseconds} µs")


# --- processes: CPU time and resident memory from /proc ---------------------------------------------


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()  # fields from the 3rd (state) on


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants that are alive now."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    tree, pending = [], [root]
    while pending:
        pid = pending.pop()
        if _stat_fields(pid) is not None:
            tree.append(pid)
            pending += children.get(pid, [])
    return tree


def find_process(needle: str, name: str) -> int | None:
    """The process whose command name is ``name`` and whose command line contains ``needle``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != name:
                continue
            if needle in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                return int(entry.name)
        except OSError:
            continue
    return None


def process_label(pid: int) -> str:
    """``tritonserver``, ``stub face_detector`` (a Python-backend stub, named by its model), or the comm."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return str(pid)
    model = re.search(r"/(face_\w+)/\d+/model\.py", command)
    return f"stub {model.group(1)}" if model else comm


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU seconds of these processes (threads included; exited ones count nothing)."""
    total = 0
    for pid in pids:
        fields = _stat_fields(pid)
        if fields is not None:
            total += int(fields[11]) + int(fields[12])
    return total / CLOCK_TICKS


def rss_bytes(pids: Iterable[int]) -> int:
    """Summed resident set of these processes (pages shared between them count once per process)."""
    total = 0
    for pid in pids:
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
        except (OSError, IndexError, ValueError):
            continue
    return total


@dataclass(frozen=True)
class Watched:
    """A named process (tree) whose CPU and memory a benchmark records."""

    name: str
    root: int
    tree: bool = True

    def pids(self) -> list[int]:
        return process_tree(self.root) if self.tree else [self.root]


@dataclass
class RssSampler:
    """Samples the resident memory of watched process trees every ``interval`` seconds in a thread."""

    watched: Sequence[Watched]
    interval: float
    samples: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    def sample(self) -> dict[str, int]:
        return {w.name: rss_bytes(w.pids()) for w in self.watched}

    def _run(self, began: float) -> None:
        while True:
            self.samples.append((time.monotonic() - began, self.sample()))
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> RssSampler:
        self._thread = threading.Thread(target=self._run, args=(time.monotonic(),), daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


# --- HTTP servers in subprocesses and multipart load ----------------------------------------------------


def http_status(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return 0


def start_server(command: Sequence[str], env: Mapping[str, str], log_file: Path, ready_url: str,
                 timeout: float = 120.0) -> subprocess.Popen[bytes]:
    """Start ``command`` (its output appended to ``log_file``) and wait until ``ready_url`` answers 200."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with log_file.open("ab") as output:
        process = subprocess.Popen(list(command), env=dict(env), stdout=output, stderr=subprocess.STDOUT,
                                   cwd=ROOT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{command[2:4]} exited with code {process.returncode}; see {log_file}")
        if http_status(ready_url) == 200:
            return process
        time.sleep(0.25)
    stop_server(process)
    raise RuntimeError(f"{ready_url} not ready after {timeout:.0f} s; see {log_file}")


def stop_server(process: subprocess.Popen[bytes], timeout: float = 20.0) -> int | None:
    """SIGTERM (a graceful uvicorn shutdown), then SIGKILL of its process group if it hangs."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return process.returncode


class MultipartSender:
    """Callable for ``closed_loop``: POSTs one image as a multipart upload; one httpx client per thread.
    A response other than 200 raises (``closed_loop`` counts it as an error)."""

    def __init__(self, url: str, field_name: str, filename: str, data: bytes,
                 headers: Mapping[str, str] | None = None) -> None:
        self.url, self.field_name, self.filename, self.data = url, field_name, filename, data
        self.headers = dict(headers or {})
        self._local = threading.local()
        self._clients: list[httpx.Client] = []
        self._lock = threading.Lock()

    def _client(self) -> httpx.Client:
        client: httpx.Client | None = getattr(self._local, "client", None)
        if client is None:
            client = httpx.Client(timeout=300.0)
            self._local.client = client
            with self._lock:
                self._clients.append(client)
        return client

    def __call__(self) -> httpx.Response:
        files = {self.field_name: (self.filename, self.data, "image/jpeg")}
        response = self._client().post(self.url, files=files, headers=self.headers)
        if response.status_code != 200:
            raise RuntimeError(f"{self.url}: {response.status_code} {response.text[:300]}")
        return response

    def close(self) -> None:
        with self._lock:
            for client in self._clients:
                client.close()
            self._clients.clear()


# --- closed-loop runs --------------------------------------------------------------------------------


@dataclass
class LoadRow:
    """One closed-loop measurement with the CPU each process spent per request."""

    target: str  # "REST identify", "gRPC face_pipeline", "naive /embed, 2 threads", ...
    photo: str
    concurrency: int
    requests: int
    errors: int
    seconds: float
    throughput: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    client_cpu_ms: float  # this process (the load generator), per request
    cpu_ms: dict[str, float] = field(default_factory=dict)  # per watched process (tree), per request
    #: per process of the watched trees ("triton: stub face_detector"), per request
    cpu_detail_ms: dict[str, float] = field(default_factory=dict)
    rss_mib: dict[str, float] = field(default_factory=dict)  # at the end of the run
    triton: dict[str, dict[str, float]] | None = None  # statistics deltas per model

    @property
    def cpu_ms_total(self) -> float:
        return self.client_cpu_ms + sum(self.cpu_ms.values())


def run_load(target: str, photo: str, send: Callable[[], object], concurrency: int, seconds: float,
             watched: Sequence[Watched] = (), triton_url: str | None = None) -> LoadRow:
    """``closed_loop`` with the CPU time of this process and of ``watched`` processes, per request, and
    Triton's statistics deltas when ``triton_url`` is given."""
    before_stats = model_statistics(triton_url) if triton_url else None
    pids = {w.name: w.pids() for w in watched}
    cpu_before = {name: cpu_seconds(p) for name, p in pids.items()}
    trees = {(w.name, pid): cpu_seconds([pid]) for w in watched if w.tree for pid in pids[w.name]}
    client_before = time.process_time()
    result: LoadResult = closed_loop(send, concurrency, seconds)
    client = time.process_time() - client_before
    cpu = {name: cpu_seconds(p) - cpu_before[name] for name, p in pids.items()}
    detail: dict[str, float] = {}
    for (name, pid), before in trees.items():
        key = f"{name}: {process_label(pid)}"
        detail[key] = detail.get(key, 0.0) + cpu_seconds([pid]) - before
    stats = None
    if before_stats is not None and triton_url:
        stats = statistics_delta(before_stats, model_statistics(triton_url))
    # The warm-up requests (closed_loop sends 2 first) are in the CPU figures: count them too.
    done = max(result.requests + 2, 1)
    return LoadRow(
        target=target, photo=photo, concurrency=concurrency, requests=result.requests, errors=result.errors,
        seconds=result.seconds, throughput=result.throughput, p50_ms=result.percentile(50),
        p90_ms=result.percentile(90), p99_ms=result.percentile(99), client_cpu_ms=1000 * client / done,
        cpu_ms={name: 1000 * value / done for name, value in cpu.items()},
        cpu_detail_ms={key: 1000 * value / done for key, value in sorted(detail.items())},
        rss_mib={w.name: rss_bytes(w.pids()) / MIB for w in watched}, triton=stats,
    )


# --- Triton statistics --------------------------------------------------------------------------------

MODELS = ("face_pipeline", "face_detector", "face_embedder")
_COMPUTE = ("compute_input", "compute_infer", "compute_output")


def model_statistics(url: str, models: Sequence[str] = MODELS) -> dict[str, dict[str, float]]:
    """Cumulative counters per model. ``requests``/``request_ns``/``queue_ns`` are per request (a request
    in a batch of 4 counts the whole execution's duration); ``exec_compute_ns`` sums the executions
    (``batch_stats``), so it is the time the model really spent computing."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    out: dict[str, dict[str, float]] = {}
    try:
        for name in models:
            stats = client.get_inference_statistics(name, as_json=True)["model_stats"][0]
            inference = stats["inference_stats"]

            def ns(section: Mapping[str, Any], key: str) -> float:
                return float(section.get(key, {}).get("ns", 0))

            out[name] = {
                "items": float(stats.get("inference_count", 0)),
                "executions": float(stats.get("execution_count", 0)),
                "requests": float(inference.get("success", {}).get("count", 0)),
                "request_ns": ns(inference, "success"),
                "queue_ns": ns(inference, "queue"),
                "compute_ns": sum(ns(inference, k) for k in _COMPUTE),
                "exec_compute_ns": sum(ns(batch, k) for batch in stats.get("batch_stats", [])
                                       for k in _COMPUTE),
            }
    finally:
        client.close()
    return out


def statistics_delta(before: Mapping[str, Mapping[str, float]], after: Mapping[str, Mapping[str, float]]
                     ) -> dict[str, dict[str, float]]:
    """Per model over the interval: average batch (items per execution), queue and request time per
    request, compute time per execution and per item, and, for ``face_pipeline``, its time outside the
    two networks per image (its executions' compute time minus the detector's and embedder's request
    times its BLS calls waited for, divided by the images)."""
    d = {name: {k: after[name][k] - before[name].get(k, 0.0) for k in after[name]} for name in after}
    rows: dict[str, dict[str, float]] = {}
    for name, v in d.items():
        executions, requests, items = max(v["executions"], 1.0), max(v["requests"], 1.0), max(v["items"], 1.0)
        rows[name] = {
            "items": v["items"], "executions": v["executions"], "requests": v["requests"],
            "avg_batch": v["items"] / executions,
            "requests_per_exec": v["requests"] / executions,
            "queue_ms_per_request": v["queue_ns"] / requests / 1e6,
            "request_ms": v["request_ns"] / requests / 1e6,
            "compute_ms_per_exec": v["exec_compute_ns"] / executions / 1e6,
            "compute_ms_per_item": v["exec_compute_ns"] / items / 1e6,
        }
    if {"face_pipeline", "face_detector", "face_embedder"} <= d.keys():
        pipeline, det, emb = d["face_pipeline"], d["face_detector"], d["face_embedder"]
        images = max(pipeline["items"], 1.0)
        rows["face_pipeline"]["models_ms_per_image"] = (det["request_ns"] + emb["request_ns"]) / images / 1e6
        rows["face_pipeline"]["outside_models_ms_per_image"] = (
            pipeline["exec_compute_ns"] - det["request_ns"] - emb["request_ns"]) / images / 1e6
    return rows


def triton_version(http_url: str) -> str:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{http_url}/v2", timeout=5) as response:
            return str(json.loads(response.read())["version"])
    except (OSError, ValueError, KeyError):
        return "unknown"


# --- the machine ------------------------------------------------------------------------------------


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def os_name() -> str:
    release = Path("/etc/os-release")
    if release.exists():
        match = re.search(r'^PRETTY_NAME="?([^"\n]+)"?', release.read_text(), re.MULTILINE)
        if match:
            return f"{match.group(1)}, kernel {platform.release()}"
    return platform.platform()


def machine_description(triton: str = "") -> str:
    """CPU, cores, RAM, FAISS (bench.gallery's line), plus OS, Python and the serving stack's versions."""
    import onnxruntime

    server = triton or f"tritonserver from nvidia-pytriton {_version('nvidia-pytriton')}"
    return (f"{gallery_machine()}; OS: {os_name()}; Python {platform.python_version()} "
            f"({sys.implementation.name}); onnxruntime {onnxruntime.__version__} "
            f"({', '.join(onnxruntime.get_available_providers())}); {server}; "
            f"tritonclient {_version('tritonclient')}; fastapi {_version('fastapi')}, "
            f"uvicorn {_version('uvicorn')}, opencv {_version('opencv-python-headless')}")
