"""``python -m bench.soak``: the whole stack under mixed traffic for a long while, with a Triton kill in it.

``python -m service`` (the gateway and its bundled Triton under the supervisor, as ``make run`` starts
them) serves identify, verify, detect, enroll, delete and malformed requests from a few client threads for
``--minutes``; halfway through, tritonserver is SIGKILLed and the supervisor restarts it. Each window of
``--window-s`` reports the answers by status and code, p50/p99 latency of the good ones, and the resident
memory of the gateway and of the Triton tree. Targets (issue 43): no 5xx but the 503s of the restart, memory
flat (within 10 %) from the first full window to the last, latency after the restart as before it.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.core import processes
from bench.core.inputs import ARTIFACTS, load_photos
from bench.core.reporting import MIB, cli, command_line, log_progress, machine_description, run_header, table
from bench.stack import COLLECTION, setup_collection
from service.launcher import stop_process

log = logging.getLogger("bench.soak")

PHOTOS = ("obama.jpg", "obama2.jpg", "obama3.jpg", "biden.jpg", "t1.jpg")


@dataclass
class Window:
    began_s: float
    answers: Counter[str] = field(default_factory=Counter)  # "200", "503 unavailable", ...
    latencies_ms: list[float] = field(default_factory=list)
    gateway_mib: float = 0.0
    triton_mib: float = 0.0

    def summary(self) -> dict[str, Any]:
        ms = sorted(self.latencies_ms)
        p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))] if ms else 0.0
        return {"began_s": round(self.began_s), "answers": dict(self.answers),
                "requests": sum(self.answers.values()),
                "p50_ms": round(statistics.median(ms), 1) if ms else None, "p99_ms": round(p99, 1),
                "gateway_mib": round(self.gateway_mib), "triton_mib": round(self.triton_mib)}


def _call(client: httpx.Client, key: str, photos: dict[str, bytes], rng: random.Random) -> httpx.Response:
    """One request of the mix: mostly identify; verify, detect, enroll and delete; malformed ones."""
    headers, collection = {"X-API-Key": key}, f"/v1/collections/{COLLECTION}"
    name = rng.choice(PHOTOS)
    roll = rng.random()
    if roll < 0.55:
        return client.post(f"{collection}/identify", headers=headers, files={"image": (name, photos[name])})
    if roll < 0.65:
        other = rng.choice(PHOTOS)
        return client.post("/v1/verify", headers=headers,
                           files={"image_a": (name, photos[name]), "image_b": (other, photos[other])})
    if roll < 0.75:
        return client.post("/v1/detect", headers=headers, files={"image": (name, photos[name])})
    if roll < 0.85:  # enroll a face of a person made for it, then (often) erase them again
        person = f"soak-{rng.randrange(50)}"
        return client.post(f"{collection}/identities/{person}/faces", headers=headers,
                           params={"create": "true"}, files={"images": ("obama3.jpg", photos["obama3.jpg"])})
    if roll < 0.92:
        return client.delete(f"{collection}/identities/soak-{rng.randrange(50)}", headers=headers)
    bad = rng.choice([b"not an image", photos[name][: len(photos[name]) // 3], b""])
    return client.post(f"{collection}/identify", headers=headers, files={"image": ("bad.jpg", bad)})


#: Answers a soak expects: successes, and the refusals its malformed and racing requests earn.
EXPECTED = {"200", "201", "204", "404 not_found", "415 unsupported_media_type", "400 invalid_image",
            "422 no_face", "422 several_faces", "409 conflict"}


def _label(response: httpx.Response) -> str:
    if response.status_code < 300:
        return str(response.status_code)
    try:
        return f"{response.status_code} {response.json().get('code', '')}"
    except ValueError:
        return str(response.status_code)


def soak(minutes: float, window_s: float, clients: int, kill: bool, workdir: Path) -> dict[str, Any]:
    admin_key, port = "soak-" + os.urandom(12).hex(), processes.free_port()
    triton_ports = [str(processes.free_port()) for _ in range(3)]
    env = {**os.environ, "FACEREC_SECURITY__ADMIN_KEY": admin_key, "FACEREC_LOG_LEVEL": "WARNING",
           "FACEREC_DATABASE__URL": f"sqlite:///{workdir / 'gallery.db'}",
           "FACEREC_GALLERY__SNAPSHOT_DIR": str(workdir / "index")}
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "service", "--host", "127.0.0.1", "--port", str(port),
               "--triton-ports", *triton_ports, "--admin-key-file", str(workdir / "admin_key")]
    gateway = processes.start_server(command, env, workdir / "gateway.log", f"{url}/health/ready",
                                     timeout=240)
    photos = load_photos(PHOTOS)
    try:
        key = setup_collection(url, admin_key, photos["obama2.jpg"])
        return _run(url, key, photos, gateway.pid, minutes, window_s, clients, kill)
    finally:
        stop_process(gateway)


def _run(url: str, key: str, photos: dict[str, bytes], gateway_pid: int, minutes: float, window_s: float,
         clients: int, kill: bool) -> dict[str, Any]:
    began, stop = time.monotonic(), threading.Event()
    windows: list[Window] = [Window(0.0)]
    lock = threading.Lock()

    def client_loop(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=url, timeout=60) as client:
            while not stop.is_set():
                sent = time.perf_counter()
                try:
                    label = _label(_call(client, key, photos, rng))
                except httpx.HTTPError as exc:
                    label = f"no answer ({type(exc).__name__})"
                elapsed = (time.perf_counter() - sent) * 1000
                with lock:
                    windows[-1].answers[label] += 1
                    if label == "200":
                        windows[-1].latencies_ms.append(elapsed)

    threads = [threading.Thread(target=client_loop, args=(n,), daemon=True) for n in range(clients)]
    for thread in threads:
        thread.start()
    killed_at, end = None, began + minutes * 60
    while time.monotonic() < end:
        time.sleep(min(window_s, max(0.0, end - time.monotonic())))
        tree = processes.process_tree(gateway_pid)
        triton = [p for p in tree if _command(p) == "tritonserver"]
        with lock:
            current = windows[-1]
            current.gateway_mib = processes.resident_bytes([gateway_pid]) / MIB
            trees = [pid for p in triton for pid in processes.process_tree(p)]
            current.triton_mib = processes.resident_bytes(trees) / MIB
            windows.append(Window(time.monotonic() - began))
        if kill and killed_at is None and time.monotonic() - began >= minutes * 30 and triton:
            os.kill(triton[0], signal.SIGKILL)
            killed_at = time.monotonic() - began
            log.info("tritonserver (pid %d) killed at %.0f s", triton[0], killed_at)
    stop.set()
    for thread in threads:
        thread.join(timeout=90)
    done = [w.summary() for w in windows[:-1]]
    return {"minutes": minutes, "window_s": window_s, "clients": clients, "killed_at_s": killed_at,
            "windows": done, "verdict": verdict(done, killed_at)}


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def verdict(windows: list[dict[str, Any]], killed_at: float | None) -> dict[str, Any]:
    """The targets on the windows: unexpected answers (5xx but the restart's 503s, no answer); memory's
    largest deviation from its median over the windows after the first (warm-up), the kill's window left
    out (a new Triton starts smaller); p50 before the kill against the last three windows'."""
    unexpected: Counter[str] = Counter()
    for window in windows:
        for label, count in window["answers"].items():
            restart = label.startswith("503") and killed_at is not None and window["began_s"] >= killed_at - 1
            if label not in EXPECTED and not restart:
                unexpected[label] += count
    span = _span(windows)
    steady = [w for w in windows[1:] if killed_at is None or not 0 <= killed_at - w["began_s"] < span]
    steady = steady or windows
    drift = {}
    for name in ("gateway_mib", "triton_mib"):
        middle = statistics.median(w[name] for w in steady)
        drift[name] = max(abs(w[name] - middle) for w in steady) / max(middle, 1)
    before = [w["p50_ms"] for w in steady if w["p50_ms"] and (killed_at is None or w["began_s"] < killed_at)]
    after = [w["p50_ms"] for w in steady[-3:] if w["p50_ms"]]
    latency = statistics.median(after) / statistics.median(before) if before and after else None
    return {"unexpected": dict(unexpected), "memory_drift": {k: round(v, 3) for k, v in drift.items()},
            "p50_after_over_before": None if latency is None else round(latency, 2)}


def _span(windows: list[dict[str, Any]]) -> float:
    return float(windows[1]["began_s"] - windows[0]["began_s"]) if len(windows) > 1 else 0.0


def report(result: dict[str, Any], command: str) -> str:
    rows = result["windows"]
    v = result["verdict"]
    columns: list[tuple[str, Any]] = [
        ("from s", "{0[began_s]}"), ("requests", "{0[requests]}"),
        ("answers", lambda w: ", ".join(f"{k}: {n}" for k, n in sorted(w["answers"].items()))),
        ("p50 ms", "{0[p50_ms]}"), ("p99 ms", "{0[p99_ms]}"), ("gateway MiB", "{0[gateway_mib]}"),
        ("Triton MiB", "{0[triton_mib]}")]
    return "\n".join([
        run_header(command, machine_description()), "",
        f"{result['clients']} clients for {result['minutes']:g} min; tritonserver SIGKILLed at "
        f"{result['killed_at_s'] or 0:.0f} s.", "", table(rows, columns), "",
        f"Unexpected answers: {v['unexpected'] or 'none'}. Memory, largest deviation from its median after "
        f"warm-up: gateway {100 * v['memory_drift']['gateway_mib']:.1f} %, Triton "
        f"{100 * v['memory_drift']['triton_mib']:.1f} %. p50 after the restart / before it: "
        f"{v['p50_after_over_before']}."])


def main(argv: list[str] | None = None) -> int:
    parser = cli("bench.soak", __doc__)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--no-kill", action="store_true", help="leave Triton running")
    parser.add_argument("--json", type=Path, help="the raw windows (docs/benchmarks/runs/)")
    args = parser.parse_args(argv)
    log_progress()
    with tempfile.TemporaryDirectory(prefix="soak-", dir=ARTIFACTS) as folder:
        result = soak(args.minutes, args.window_s, args.clients, not args.no_kill, Path(folder))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(report(result, command_line("bench.soak", argv)))
    verdict_ = result["verdict"]
    return 1 if verdict_["unexpected"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
