"""Start the tritonserver bundled in the ``nvidia-pytriton`` wheel, wait for the models, stop it cleanly.

The wheel carries a complete tritonserver 2.51 with the Python backend only. This module prepares
what the binary needs (the Python-backend stub for this interpreter, the virtualenv first on PATH so
the stub finds numpy, libpython on LD_LIBRARY_PATH), binds to 127.0.0.1 (``--host`` to change) and
uses a per-run shared-memory prefix so that stopping it removes exactly its own ``/dev/shm`` files.
It refuses to start when its ports are taken (a server already answering there would pass for it), and
on Linux the server gets SIGTERM when the thread that started it ends (``parent_death_signal``), so a
gateway killed without unwinding (SIGKILL, the OOM killer) does not leave it behind holding the ports.

    python -m service.launcher --model-repository model_repository/cpu
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from facecore.client import KEEPALIVE_TIME_MS

log = logging.getLogger(__name__)

DEFAULT_MODELS = ("face_detector", "face_embedder", "face_pipeline")
#: How long a health check may take before the server counts as not answering (``TritonServer.healthy``).
HEALTH_TIMEOUT_S = 2.0
#: prctl(2) option: the signal a process gets when its parent (the thread that forked it) ends.
PR_SET_PDEATHSIG = 1


class TritonStartError(RuntimeError):
    """The server exited or its models did not become ready in time."""


@dataclass(frozen=True)
class TritonPorts:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002

    @classmethod
    def free(cls) -> TritonPorts:
        """Three ports free on 127.0.0.1 right now (for test and benchmark servers beside others)."""
        sockets = [socket.socket() for _ in range(3)]
        try:
            for s in sockets:
                s.bind(("127.0.0.1", 0))
            http, grpc, metrics = (int(s.getsockname()[1]) for s in sockets)
        finally:
            for s in sockets:
                s.close()
        return cls(http, grpc, metrics)

    def taken(self, host: str) -> list[tuple[str, int]]:
        """The ``(name, port)`` of these ports that cannot be bound on ``host`` now (something listens)."""
        named = (("HTTP", self.http), ("gRPC", self.grpc), ("metrics", self.metrics))
        return [(name, port) for name, port in named if port_taken(host, port)]


def port_taken(host: str, port: int) -> bool:
    """Whether binding ``host:port`` fails as tritonserver's bind would (SO_REUSEADDR: the TIME_WAIT
    connections of a previous run are no obstacle, a listener is)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return True
    return False


@functools.cache
def _prctl() -> Callable[..., int] | None:
    """libc's prctl, looked up before a fork (Linux only)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    return prctl


def parent_death_signal(signum: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the child get ``signum`` when the thread that forks it ends (Linux's
    PR_SET_PDEATHSIG; None elsewhere). It is the thread, not the process: start servers from a thread
    that outlives them (the main thread, or the supervisor's watcher, which ends only when the supervisor
    stops). SIGTERM rather than SIGKILL: tritonserver then shuts down cleanly (stops its stubs, removes
    its /dev/shm regions), and a watcher thread that ends during ``Supervisor.stop`` only begins the
    shutdown that ``stop`` then waits for."""
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:  # in the forked child: no locks, no allocation to speak of
        prctl(PR_SET_PDEATHSIG, signum)
        if os.getppid() != parent:  # the parent died before prctl: nobody would send the signal
            os.kill(os.getpid(), signum)

    return preexec


def http_status(url: str, timeout: float = 2.0) -> int:
    """The HTTP status ``url`` answers a GET with, 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return 0


def keepalive_args() -> list[str]:
    """tritonserver's gRPC keepalive flags, matching the clients' (``facecore.client.channel_options``).

    A gRPC server counts a ping that comes sooner than ``min-recv-ping-interval-without-data`` after the
    previous one (5 minutes by default; 2 hours without calls unless ``permit-without-calls``) as a strike,
    and after two strikes it closes the connection with GOAWAY too_many_pings: the clients' pings every
    ``KEEPALIVE_TIME_MS`` must be allowed, with half of it as the limit (timers are not exact). Triton's own
    pings, every 10 s, close the connection of a client that vanished (its calls are then cancelled)."""
    return ["--grpc-keepalive-time=10000", "--grpc-keepalive-timeout=5000",
            "--grpc-keepalive-permit-without-calls=1", "--grpc-http2-max-pings-without-data=0",
            f"--grpc-http2-min-recv-ping-interval-without-data={KEEPALIVE_TIME_MS // 2}"]


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, a debugger): it acts on SIGTERM only once continued."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] in ("T", "t")


def stop_process(process: subprocess.Popen[bytes], timeout: float = 20.0) -> int | None:
    """SIGTERM, wait up to ``timeout`` (not at all for a stopped process), then SIGKILL its process group
    (started with ``start_new_session=True``); returns the exit code."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        timeout = 0 if stopped(process.pid) else timeout
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("process %d did not exit after SIGTERM; killing its process group", process.pid)
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return process.returncode


def bundled_server_dir() -> Path:
    """``site-packages/pytriton/tritonserver`` of the installed wheel."""
    try:
        import pytriton
    except ImportError as exc:
        raise TritonStartError(
            "tritonserver is not installed: `pip install nvidia-pytriton==0.7.0` (the `server` extra) "
            "or run Triton from the NGC container"
        ) from exc
    return Path(pytriton.__file__).resolve().parent / "tritonserver"


def install_stub(server_dir: Path) -> None:
    """Copy the Python-backend stub for this interpreter next to libtriton_python.so (as PyTriton does)."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    target = server_dir / "backends" / "python" / "triton_python_backend_stub"
    source = server_dir / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not source.exists():
        raise TritonStartError(f"the wheel has no Python-backend stub for Python {version}")
    if not target.exists() or target.stat().st_size != source.stat().st_size:
        shutil.copy2(source, target)


def server_environment() -> dict[str, str]:
    """PATH with this interpreter's bin first (the stub finds the venv via ``python3``), libpython visible."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    libdirs = [sysconfig.get_config_var("LIBDIR") or "", env.get("LD_LIBRARY_PATH", "")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(d for d in libdirs if d)
    return env


def group_members(pgid: int) -> list[int]:
    """Live processes (zombies excluded) of process group ``pgid``, from /proc."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        state, _ppid, group = stat[stat.rindex(")") + 2:].split()[:3]
        if int(group) == pgid and state not in ("Z", "X"):
            members.append(int(entry.name))
    return members


@dataclass
class TritonServer:
    """A tritonserver child process. Use as a context manager, or ``start()`` / ``stop()``."""

    model_repository: Path
    ports: TritonPorts = field(default_factory=TritonPorts)
    models: tuple[str, ...] = DEFAULT_MODELS
    explicit: bool = False  # --model-control-mode=explicit, loading ``models``
    log_file: Path | None = None
    extra_args: tuple[str, ...] = ()
    #: Address the endpoints bind to; 127.0.0.1 unless serving other hosts (containers: 0.0.0.0).
    host: str = "127.0.0.1"
    shm_prefix: str = field(default_factory=lambda: f"facerec_{uuid.uuid4().hex[:8]}_")
    _process: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _pgid: int = field(default=0, init=False, repr=False)

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.http}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.ports.grpc}"

    def command(self) -> list[str]:
        server_dir = bundled_server_dir()
        args = [
            str(server_dir / "bin" / "tritonserver"),
            f"--model-repository={self.model_repository.resolve()}",
            f"--backend-directory={server_dir / 'backends'}",
            f"--http-address={self.host}", f"--grpc-address={self.host}", f"--metrics-address={self.host}",
            f"--http-port={self.ports.http}", f"--grpc-port={self.ports.grpc}",
            f"--metrics-port={self.ports.metrics}",
            "--allow-gpu-metrics=false", "--pinned-memory-pool-byte-size=0",
            "--cuda-memory-pool-byte-size=0:0",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            "--exit-timeout-secs=5", "--log-verbose=0", *keepalive_args(),
        ]
        if self.explicit:
            args.append("--model-control-mode=explicit")
            args += [f"--load-model={name}" for name in self.models]
        return [*args, *self.extra_args]

    def start(self, timeout: float = 120.0, stop: threading.Event | None = None) -> TritonServer:
        """Start it and wait until it is ready; ``stop`` being set cancels the wait (and stops it)."""
        if not self.model_repository.is_dir():
            raise TritonStartError(
                f"no model repository at {self.model_repository}: run `python -m export defaults`"
            )
        taken = self.ports.taken(self.host)
        if taken:
            ports = ", ".join(f"{name} port {port}" for name, port in taken)
            raise TritonStartError(
                f"{ports} on {self.host} already in use (another tritonserver?): stop what listens there, "
                "choose free ports (--triton-ports HTTP GRPC METRICS) or use the running Triton "
                "(--triton-url)"
            )
        install_stub(bundled_server_dir())
        if self.log_file:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
        output = self.log_file.open("ab") if self.log_file else None
        log.info("starting tritonserver on %s (http %d, grpc %d, metrics %d)", self.host,
                 self.ports.http, self.ports.grpc, self.ports.metrics)
        self._process = subprocess.Popen(
            self.command(), env=server_environment(), stdout=output,
            stderr=subprocess.STDOUT if output else None, start_new_session=True,
            preexec_fn=parent_death_signal(),  # not left behind by a gateway killed without unwinding
        )
        self._pgid = self._process.pid  # its own session: the stubs it starts are in this group
        try:
            self.wait_ready(timeout, stop)
        except BaseException:
            self.stop()
            raise
        return self

    def _get(self, path: str) -> int:
        return http_status(f"{self.http_url}{path}")

    @property
    def pid(self) -> int | None:
        """The tritonserver process id while it runs (its Python-backend stubs are its children)."""
        return self._process.pid if self.running and self._process is not None else None

    def version(self) -> str:
        """The server's version from its metadata endpoint (``2.51.0``), ``unknown`` when it does not say."""
        try:
            with urllib.request.urlopen(f"{self.http_url}/v2", timeout=5) as response:
                return str(json.loads(response.read())["version"])
        except (OSError, ValueError, KeyError):
            return "unknown"

    def models_ready(self) -> dict[str, bool]:
        return {name: self._get(f"/v2/models/{name}/ready") == 200 for name in self.models}

    def healthy(self, timeout: float = HEALTH_TIMEOUT_S) -> bool:
        """Whether the server answers that it is ready (live, and its models loaded) within ``timeout``; a
        stopped or deadlocked server does not answer."""
        return http_status(f"{self.http_url}/v2/health/ready", timeout) == 200

    def metrics_up(self) -> bool:
        return http_status(f"http://127.0.0.1:{self.ports.metrics}/metrics") == 200

    def wait_ready(self, timeout: float, stop: threading.Event | None = None) -> None:
        """Until the server is live, every model ready and the metrics endpoint answering (Triton starts
        its metrics service after the HTTP one: a scrape right after the models were ready was refused),
        with its process still running then (else another server answered); ``stop`` cancels."""
        deadline = time.monotonic() + timeout
        stop = stop or threading.Event()
        while time.monotonic() < deadline:
            self._raise_if_exited()
            live = self._get("/v2/health/live") == 200
            if live and all(self.models_ready().values()) and self.metrics_up():
                self._raise_if_exited()
                log.info("tritonserver ready: %s", ", ".join(self.models))
                return
            if stop.wait(0.25):
                raise TritonStartError("start cancelled: stopping")
        raise TritonStartError(f"models not ready after {timeout:.0f} s: {json.dumps(self.models_ready())}")

    def _raise_if_exited(self) -> None:
        if self._process is not None and self._process.poll() is not None:
            raise TritonStartError(f"tritonserver exited with code {self._process.returncode}")

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM, wait, SIGKILL if needed; then what is left of this run (``reap``)."""
        process, self._process = self._process, None
        code = stop_process(process, timeout) if process is not None else None
        self.reap()
        return code

    def kill(self, grace: float = 5.0) -> int | None:
        """End a hung server: SIGTERM, then SIGKILL for it and the rest of its process group (its stubs)
        unless it exited within ``grace`` (at once when it is stopped); ``reap`` cleans up after it."""
        return stop_process(self._process, grace) if self._process is not None else None

    def reap(self, timeout: float = 10.0) -> list[int]:
        """After the server exited: SIGKILL the processes left in its process group (its backend stubs,
        which otherwise linger until they notice), wait until they are gone, and remove this run's
        /dev/shm regions. Only this run's: its own process group and its own shm prefix. Returns the
        pids that were still there."""
        left = group_members(self._pgid) if self._pgid else []
        if left:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._pgid, signal.SIGKILL)
            deadline = time.monotonic() + timeout
            while group_members(self._pgid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if group_members(self._pgid):
                log.warning("processes of the dead tritonserver remain: %s", group_members(self._pgid))
        for leftover in Path("/dev/shm").glob(f"{self.shm_prefix}*"):
            leftover.unlink(missing_ok=True)
        return left

    def exit_code(self) -> int | None:
        """The exit code once the server has exited, None while it runs (or before it started)."""
        return None if self._process is None else self._process.poll()

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def __enter__(self) -> TritonServer:
        return self.start() if self._process is None else self

    def __exit__(self, *exc: object | TracebackType) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    root = Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(prog="python -m service.launcher", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-repository", type=Path, default=root / "model_repository" / "cpu")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 inside a container)")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the models")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ports = TritonPorts(args.http_port, args.grpc_port, args.metrics_port)
    server = TritonServer(args.model_repository, ports)
    stop = {"now": False}

    def request_stop(signum: int, _frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    try:
        server.start(args.timeout)
    except TritonStartError as exc:
        log.error("%s", exc)
        return 1
    log.info("gRPC %s, HTTP %s, metrics http://127.0.0.1:%d/metrics; Ctrl-C stops it",
             server.grpc_url, server.http_url, args.metrics_port)
    while not stop["now"] and server.running:
        time.sleep(0.5)
    code = server.stop()
    log.info("tritonserver stopped (exit code %s)", code)
    return 0 if stop["now"] else 1


if __name__ == "__main__":
    sys.exit(main())
