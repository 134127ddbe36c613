"""The Triton containers' health checks: the recognition probe, and what to do with a hung server.

    python3 /opt/facerec/healthcheck.py --image PHOTO                        # readiness (Kubernetes)
    python3 /opt/facerec/healthcheck.py --image PHOTO --kill-hung-after 30   # the compose healthcheck
    python3 /opt/facerec/healthcheck.py --image PHOTO --liveness             # liveness (Kubernetes)

Healthy means that a real photo goes through face_pipeline (``facecore.probe``): the exit status is 0 when
it does, 1 otherwise, with one line saying why. A server is *hung* when it fails that probe and does not
answer ``/v2/health/ready`` within 2 s, or fails it saying that one of its stubs is not healthy
(``facecore.probe.stub_unhealthy``): the rule ``python -m service``'s supervisor applies
(service/supervisor.py). A server too busy to pass the probe still answers its health check: not hung.

- ``--liveness`` exits 1 only while the server is hung: Kubernetes restarts the container after
  ``failureThreshold`` such answers in a row.
- ``--kill-hung-after S``: Docker restarts a container whose main process exits, never one that is merely
  unhealthy. The check remembers (``--state``) since when the server has been hung; from ``S`` seconds on
  it SIGKILLs tritonserver and its process group (a stopped process ignores SIGTERM) and removes its
  shared memory, the container exits, and its restart policy starts it again. Only a server that passed
  the probe before can be hung (one still loading its models is not), and only when exactly one
  tritonserver runs here (``--server-pid`` names it).

Standard library and ``facecore`` only: both Triton images have them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from facecore.client import PipelineClient
from facecore.probe import ProbeResult, probe, stub_unhealthy

#: As the supervisor: how long the health check may take, and each call of the probe.
HEALTH_TIMEOUT_S = 2.0
PROBE_TIMEOUT_S = 5.0


def answers_health(http_url: str, timeout: float = HEALTH_TIMEOUT_S) -> bool:
    try:
        with urllib.request.urlopen(f"{http_url}/v2/health/ready", timeout=timeout) as response:
            return int(response.status) == 200
    except (urllib.error.URLError, OSError):
        return False


def hung(result: ProbeResult, http_url: str) -> str | None:
    """Why the server counts as hung given the probe's ``result``; None when it does not."""
    if result.ok:
        return None
    if stub_unhealthy(result):
        return result.detail
    if answers_health(http_url):
        return None
    return f"no answer to its health check within {HEALTH_TIMEOUT_S:.0f} s"


def _stat(pid: int) -> list[str]:
    text = Path(f"/proc/{pid}/stat").read_text()
    return [text[text.index("(") + 1:text.rindex(")")], *text[text.rindex(")") + 2:].split()]


def tritonservers() -> list[int]:
    """The tritonserver processes this container runs (not zombies)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = _stat(int(entry.name)) if entry.name.isdigit() else []
        except OSError:
            continue
        if stat[:1] == ["tritonserver"] and stat[1] not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def identity(pid: int) -> str:
    """The process id and its start time: a restarted server is another one, even with the same id."""
    return f"{pid}:{_stat(pid)[20]}"


def shm_prefix(pid: int) -> str | None:
    """The server's ``shm-region-prefix-name`` (both images set one); None when it has none."""
    arguments = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    given = [a.rsplit("shm-region-prefix-name=", 1)[1] for a in arguments if "shm-region-prefix-name=" in a]
    return given[-1].split(",")[0] if given else None


def kill(pid: int, shm: Path = Path("/dev/shm")) -> None:
    """SIGKILL the server (its process group too when it leads one: the stubs), and remove its shared memory
    when it names it (else which regions are its own is not known)."""
    prefix = shm_prefix(pid)
    if os.getpgid(pid) == pid:
        os.killpg(pid, signal.SIGKILL)
    else:
        os.kill(pid, signal.SIGKILL)
    for leftover in shm.glob(f"{prefix}*") if prefix else ():
        leftover.unlink(missing_ok=True)


def track(state_file: Path, result: ProbeResult, why: str | None, kill_after: float,
          server_pid: int | None) -> str | None:
    """Remember since when the server is hung, and kill it once that is ``kill_after`` s; says what it did."""
    servers = [server_pid] if server_pid else tritonservers()
    if len(servers) != 1:  # none yet (the entrypoint prepares the engines), or not ours to choose
        return None
    pid = servers[0]
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError):
        state = {}
    if state.get("server") != identity(pid):
        state = {"server": identity(pid), "passed": False, "hung_since": None}
    state["passed"] = state["passed"] or result.ok
    done = None
    if why is None or not state["passed"]:
        state["hung_since"] = None
    else:
        now = time.monotonic()  # the same clock for every process of this boot
        state["hung_since"] = state["hung_since"] or now
        lasted = now - state["hung_since"]
        done = f"hung for {lasted:.0f} s (restarted at {kill_after:.0f} s)"
        if lasted >= kill_after:
            kill(pid)
            done = f"hung for {lasted:.0f} s: tritonserver {pid} killed, the container restarts"
    state_file.write_text(json.dumps(state))
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="healthcheck.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", type=Path, required=True, help="the probe photo")
    parser.add_argument("--url", default="127.0.0.1:8001", help="Triton gRPC address")
    parser.add_argument("--http", default="http://127.0.0.1:8000", help="Triton HTTP address")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--liveness", action="store_true", help="exit 1 only while the server is hung")
    mode.add_argument("--kill-hung-after", type=float, metavar="S",
                      help="kill a server hung for S seconds (compose: the container then restarts)")
    parser.add_argument("--state", type=Path, default=Path("/tmp/facerec-triton-health.json"))
    parser.add_argument("--server-pid", type=int, help="the tritonserver to kill (default: the only one)")
    args = parser.parse_args(argv)
    client = PipelineClient(args.url, PROBE_TIMEOUT_S)
    try:
        result = probe(client, args.image.read_bytes())
    finally:
        client.close()
    why = hung(result, args.http)
    done = None
    if args.kill_hung_after is not None:
        done = track(args.state, result, why, args.kill_hung_after, args.server_pid)
    print(("ok: " if result.ok else "FAILED: ") + result.detail + (f"; {done}" if done else ""), flush=True)
    if args.liveness:
        return 1 if why else 0
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
