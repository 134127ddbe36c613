"""The gateway's own CPU per request, apart from Triton's work and from the HTTP server's.

    python -m bench.gateway                  # ~4 minutes on 2 cores, most of it the gRPC calls
    python -m bench.gateway --parts identify --rounds 6 --triton-url 127.0.0.1:8001
    python -m bench.gateway --trees /tmp/before .   # ~3 minutes: two checkouts' gateways side by side

In this one process, alternating rounds: identify through the gateway's real ASGI app (middleware, key,
multipart, the FAISS search of a SQLite gallery, JSON) with ``face_pipeline``'s answer recorded, so
everything but the gRPC call and uvicorn; and the gRPC call's client side, the gateway's client beside
tritonclient's asyncio ``infer``. ``--trees`` measures instead the whole gateway process per REST
identify, as ``python -m bench`` does, of each source tree given (``git worktree add /tmp/before
<commit>``), all served at once on one Triton, the load alternating between them round by round.
Writes a Markdown section to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
import uvloop
from fastapi import FastAPI
from starlette.types import Message

from bench.core.inputs import ROOT, load_photos
from bench.core.load import MultipartSender, multipart_body, run_load
from bench.core.processes import Watched
from bench.core.reporting import fmt, machine_description, table, write_section
from bench.core.triton import triton_url
from bench.stack import COLLECTION, ENROLLED, MAX_FACES, setup_collection, start_gateway
from facecore.client import AsyncPipelineClient
from facecore.contract import OUTPUT_NAMES, PIPELINE_MODEL, Faces, Input
from facecore.settings import GatewaySettings
from facecore.spec import ModelSpec
from service.app import create_app
from service.launcher import stop_process

PROBE = "obama.jpg"

log = logging.getLogger(__name__)


@dataclass
class Answer:
    status: int = 0
    body: bytes = b""


async def asgi_call(app: FastAPI, method: str, path: str, body: bytes = b"", content_type: str = "",
                    key: str = "", query: bytes = b"") -> Answer:
    """One HTTP request through the app's ASGI interface, as uvicorn would hand it over."""
    headers = [(b"host", b"bench"), (b"content-length", str(len(body)).encode())]
    headers += [(b"content-type", content_type.encode())] if content_type else []
    headers += [(b"x-api-key", key.encode())] if key else []
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query,
             "root_path": "", "headers": headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]
    answer = Answer()

    async def receive() -> Message:
        if pending:
            return pending.pop()
        await asyncio.Event().wait()  # the client stays connected
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            answer.status = int(message["status"])
        else:
            answer.body += message.get("body", b"")

    await app(scope, receive, send)
    return answer


class RecordedPipeline:
    """``face_pipeline`` answering every image with the faces recorded for the probe photo."""

    def __init__(self, faces: Faces, spec: ModelSpec) -> None:
        self.faces, self.spec = faces, spec

    async def infer(self, image: bytes, **_: object) -> Faces:
        return self.faces

    async def embedder(self) -> ModelSpec:
        return self.spec


#: Each variant measured -> its CPU ms per request, one value per round.
Runs = dict[str, list[float]]


async def cpu_per_call(call: Callable[[], Awaitable[None]], requests: int, concurrency: int) -> float:
    """This process's CPU ms per ``call``, ``requests`` of them by ``concurrency`` tasks (after a warm-up)."""
    async def worker(count: int) -> None:
        for _ in range(count):
            await call()

    await asyncio.gather(*(worker(4) for _ in range(concurrency)))
    per_task = max(requests // concurrency, 1)
    began = time.process_time()
    await asyncio.gather(*(worker(per_task) for _ in range(concurrency)))
    return 1000 * (time.process_time() - began) / (per_task * concurrency)


async def measure(url: str, requests: int, rounds: int, concurrency: int, parts: Sequence[str]) -> Runs:
    photos = load_photos([ENROLLED, PROBE])
    runs: Runs = {}
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as folder:
        admin = secrets.token_urlsafe(24)
        settings = GatewaySettings(security={"admin_key": admin}, triton={"url": url},
                                   database={"url": f"sqlite:///{Path(folder) / 'gallery.db'}"},
                                   gallery={"snapshot_dir": Path(folder) / "index"})
        app = create_app(settings)
        async with app.router.lifespan_context(app):
            key = await _collection(app, admin, photos[ENROLLED])
            client = AsyncPipelineClient(url)
            reference = aioclient.InferenceServerClient(url)
            recorded = await client.infer(photos[PROBE], max_faces=MAX_FACES)
            app.state.recognition.pipeline = RecordedPipeline(recorded, await client.embedder())
            body, content_type = multipart_body("image", PROBE, photos[PROBE])
            path = f"/v1/collections/{COLLECTION}/identify"

            async def identify() -> None:
                answer = await asgi_call(app, "POST", path, body, content_type, key)
                if answer.status != 200:
                    raise RuntimeError(f"identify answered {answer.status}: {answer.body[:300]!r}")

            async def ours() -> None:
                await client.infer(photos[PROBE], max_faces=MAX_FACES)

            async def tritonclients() -> None:
                image = grpcclient.InferInput(Input.IMAGE.value, [1, 1], "BYTES")
                image.set_data_from_numpy(np.array([[photos[PROBE]]], dtype=np.object_))
                limit = grpcclient.InferInput(Input.MAX_FACES.value, [1, 1], "INT32")
                limit.set_data_from_numpy(np.array([[MAX_FACES]], dtype=np.int32))
                result = await reference.infer(PIPELINE_MODEL, [image, limit], outputs=[
                    grpcclient.InferRequestedOutput(name) for name in OUTPUT_NAMES])
                Faces.from_arrays(lambda name: result.as_numpy(name)[0])

            await identify()
            decisions = json.loads((await asgi_call(app, "POST", path, body, content_type, key)).body)
            log.info("identify %s: %s", PROBE, [face["decision"] for face in decisions["faces"]])
            variants = {IDENTIFY: identify} if "identify" in parts else {}
            variants |= {OURS: ours, TRITONCLIENT: tritonclients} if "grpc" in parts else {}
            for number in range(rounds):
                for name, call in variants.items():
                    runs.setdefault(name, []).append(await cpu_per_call(call, requests, concurrency))
                    log.info("round %d %s: %.3f ms CPU per request", number + 1, name, runs[name][-1])
            await client.close()
            await reference.close()
    return runs


async def _collection(app: FastAPI, admin: str, enroll: bytes) -> str:
    """A collection with one identity enrolled (through the real face_pipeline); returns its key."""
    async def post(path: str, body: bytes, content_type: str, query: bytes = b"") -> dict[str, Any]:
        answer = await asgi_call(app, "POST", path, body, content_type, admin, query)
        if answer.status not in (200, 201):
            raise RuntimeError(f"{path} answered {answer.status}: {answer.body[:300]!r}")
        result: dict[str, Any] = json.loads(answer.body)
        return result

    await post("/v1/collections", json.dumps({"name": COLLECTION}).encode(), "application/json")
    created = await post(f"/v1/collections/{COLLECTION}/keys", b'{"label": "bench"}', "application/json")
    body, content_type = multipart_body("images", ENROLLED, enroll)
    await post(f"/v1/collections/{COLLECTION}/identities/obama/faces", body, content_type, b"create=true")
    return str(created["key"])


IDENTIFY = "identify through the gateway's ASGI app, face_pipeline's answer recorded"
OURS = "gRPC face_pipeline call: the gateway's client (facecore.client)"
TRITONCLIENT = "gRPC face_pipeline call: tritonclient's aio infer, InferInput / InferResult"


def report(runs: Runs, command: str, concurrency: int) -> str:
    rows = [(name, runs[name]) for name in (IDENTIFY, OURS, TRITONCLIENT) if name in runs]
    return "\n\n".join([
        "## The gateway's own CPU per request (`bench/gateway.py`)", _header(command),
        f"Photo {PROBE} (1 face), a collection holding {ENROLLED}, concurrency {concurrency}; CPU ms of the "
        "measuring process per request, median over rounds.", table(rows, ROUNDS)])


ROUNDS = (("measured", "{0}"), ("CPU ms per request (median)", lambda x: fmt(statistics.median(x[1]), 3)),
          ("rounds", lambda x: ", ".join(fmt(v, 3) for v in x[1])))


def _header(command: str) -> str:
    return (f"Command: `{command.strip()}`  \nDate: {time.strftime('%Y-%m-%d %H:%M %Z')}  \n"
            f"Machine: {machine_description(serving=True)}")


def _commit(tree: Path) -> str:
    """The tree's commit as git names it, with "+ changes" when files differ from it."""
    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, check=False)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD") or "not a git checkout"
    return commit + (" + changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def served_trees(url: str, trees: Sequence[Path], rounds: int, seconds: float, concurrency: int,
                 log_dir: Path) -> dict[str, list[float]]:
    """Gateway process CPU ms per REST identify of ``PROBE``, per tree and round: every tree's gateway
    served at once on Triton at ``url``, the load alternating between them (the order turning each round)."""
    photos = load_photos([ENROLLED, PROBE])
    served: dict[str, tuple[Any, str, str]] = {}
    cpu: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-gateway-trees-") as folder:
        try:
            for number, tree in enumerate(trees):
                (work := Path(folder) / str(number)).mkdir()
                log_file = log_dir / f"bench-gateway-tree{number}.log"
                process, base, admin = start_gateway(url, work, log_file, tree)
                label = f"{number + 1}. {tree} ({_commit(tree)})"
                served[label] = (process, base, "")  # stopped below should the set-up fail
                served[label] = (process, base, setup_collection(base, admin, photos[ENROLLED]))
            for number in range(rounds):
                shift = number % len(served)
                for label in [*list(served)[shift:], *list(served)[:shift]]:
                    process, base, key = served[label]
                    sender = MultipartSender(f"{base}/v1/collections/{COLLECTION}/identify", "image", PROBE,
                                             photos[PROBE], {"X-API-Key": key})
                    try:
                        row = run_load("REST identify", PROBE, sender, concurrency, seconds,
                                       [Watched("gateway", process.pid, tree=False)])
                    finally:
                        sender.close()
                    if row.errors:
                        raise RuntimeError(f"{label}: {row.errors} of {row.requests} requests failed")
                    cpu.setdefault(label, []).append(row.cpu_ms["gateway"])
                    log.info("round %d %s: %.3f ms gateway CPU per identify", number + 1, label,
                             row.cpu_ms["gateway"])
        finally:
            for process, _, _ in served.values():
                stop_process(process)
    return cpu


def trees_report(cpu: dict[str, list[float]], command: str, concurrency: int, seconds: float) -> str:
    first = next(iter(cpu.values()))
    rows = [(label, values, "—" if values is first else fmt(statistics.median(
        v - f for v, f in zip(values, first, strict=True)), 3)) for label, values in cpu.items()]
    columns = (("source tree", "{0}"), ("gateway CPU ms per identify (median)",
                                        lambda x: fmt(statistics.median(x[1]), 3)),
               ("paired difference from the first (median)", "{2}"), ROUNDS[2])
    return "\n\n".join([
        "## The gateway of several source trees side by side (`bench/gateway.py --trees`)", _header(command),
        f"REST identify of {PROBE} (1 face) against a collection holding {ENROLLED}, concurrency "
        f"{concurrency}, {fmt(seconds, 0)} s per round and tree; CPU ms of each gateway process (all its "
        "threads) per request, as `python -m bench` reports it.", table(rows, columns)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000, help="requests per round and variant "
                        "(default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=4, help="(default: %(default)s)")
    parser.add_argument("--parts", nargs="+", choices=["identify", "grpc"], default=["identify", "grpc"],
                        help="what to measure (default: both)")
    parser.add_argument("--concurrency", type=int, default=8, help="(default: %(default)s)")
    parser.add_argument("--triton-url", help="a running Triton's gRPC address serving the model repository "
                        "(default: the bundled tritonserver, started for the run)")
    parser.add_argument("--trees", type=Path, nargs="+", help="instead: the whole gateway process of each of "
                        "these source trees, served side by side (see above)")
    parser.add_argument("--seconds", type=float, default=10.0, help="with --trees: seconds per round and "
                        "tree (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "README.md")
    args = parser.parse_args(argv)
    if args.requests < args.concurrency or args.rounds < 1:
        parser.error("--requests must be at least --concurrency, --rounds at least 1")
    for tree in args.trees or ():
        if not (tree / "service" / "__main__.py").is_file():
            parser.error(f"--trees: {tree} is not a source tree of this project (no service/__main__.py)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    command = "python -m bench.gateway " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.trees:
        with triton_url(args.triton_url) as url:
            cpu = served_trees(url, args.trees, args.rounds, args.seconds, args.concurrency,
                               ROOT / "artifacts")
        text = trees_report(cpu, command, args.concurrency, args.seconds)
        print(text)
        write_section(args.out, "bench.gateway.trees", text)
        return 0
    with triton_url(args.triton_url) as url:
        runs = uvloop.run(measure(url, args.requests, args.rounds, args.concurrency, args.parts))
    text = report(runs, command, args.concurrency)
    print(text)
    write_section(args.out, "bench.gateway", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
