"""The benchmarks' core (``bench/core``): report sections, the machine line, /proc accounting, child
servers, and the bundled Triton started through the launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from bench.core.inputs import served_models
from bench.core.load import MultipartSender, closed_loop, run_load
from bench.core.processes import (
    Watched,
    cpu_seconds,
    free_port,
    process_tree,
    resident_bytes,
    rss_bytes,
    start_server,
)
from bench.core.reporting import (
    cpu_identity,
    machine_description,
    markdown_table,
    read_section,
    table,
    write_section,
)
from bench.core.triton import bundled_triton, model_statistics, triton_url
from service.launcher import stop_process
from service.multipart import split_form


def test_sections_of_the_shared_report_are_replaced_in_place(tmp_path: Path) -> None:
    out = tmp_path / "docs" / "gallery.md"
    write_section(out, "bench.gallery", "first")
    write_section(out, "bench.enroll", "enroll")
    write_section(out, "bench.gallery", "second")
    text = out.read_text()
    assert text.startswith("# Gallery benchmarks\n\n")
    assert "first" not in text and text.index("second") < text.index("enroll")
    assert text.count("<!-- bench.gallery:start -->") == 1
    assert read_section(text, "bench.enroll").strip() == "enroll" and read_section(text, "other") == ""
    readme = tmp_path / "README.md"
    write_section(readme, "bench", "serving")
    assert readme.read_text().startswith("# Benchmarks\n\n<!-- bench:start -->\nserving\n")


def test_markdown_table() -> None:
    assert markdown_table(("a", "b"), [("1", "2")]) == "| a | b |\n|---|---|\n| 1 | 2 |"


def test_a_table_reads_each_cell_by_template_or_function() -> None:
    """A column's cell is a ``str.format`` template given the row (a tuple row: its items) or a function."""
    columns = (("name", "{0[name]}"), ("ms", "{0[ms]:.1f}"), ("twice", lambda r: 2 * r["ms"]))
    expected = "| name | ms | twice |\n|---|---|---|\n| a | 1.2 | 2.5 |"
    assert table([{"name": "a", "ms": 1.25}], columns) == expected
    pairs = (("left", "{0}"), ("right", "{1:>3}"))
    assert table([("x", 7)], pairs).splitlines()[-1] == "| x |   7 |"


def test_one_machine_description_with_or_without_the_serving_stack() -> None:
    hardware = machine_description()
    assert f"{os.cpu_count()} cores" in hardware and "faiss " in hardware and "GPU: " in hardware
    assert "onnxruntime" not in hardware
    serving = machine_description(serving=True, triton="tritonserver 2.51.0")
    assert serving.startswith(hardware + "; OS: ")
    assert "onnxruntime " in serving and "; tritonserver 2.51.0; tritonclient " in serving
    assert "nvidia-pytriton" in machine_description(serving=True)


ZEN5 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni

processor\t: 1
cpu family\t: 26
"""


def test_the_cpu_is_named_with_its_family_model_and_vector_features() -> None:
    assert cpu_identity(ZEN5) == "AMD EPYC (family 26, model 2; AVX2, AVX-512, AVX-512 BF16)"
    sapphire = ZEN5.replace("AMD EPYC", "Intel(R) Xeon(R) Processor").replace(": 26", ": 6").replace(
        "model\t\t: 2", "model\t\t: 143").replace("avx512_vnni", "avx512_vnni amx_bf16 amx_tile")
    assert cpu_identity(sapphire) == ("Intel(R) Xeon(R) Processor (family 6, model 143; AVX2, AVX-512, "
                                      "AVX-512 BF16, AMX)")
    zen3 = ZEN5.replace(" avx512f avx512_bf16 avx512_vnni", "").replace(": 26", ": 25")
    assert cpu_identity(zen3) == "AMD EPYC (family 25, model 2; AVX2)"
    assert machine_description().startswith(cpu_identity() + ", ")


def test_a_child_server_is_accounted_and_stopped(tmp_path: Path) -> None:
    port = free_port()
    command = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    process = start_server(command, dict(os.environ), tmp_path / "server.log", f"http://127.0.0.1:{port}/")
    try:
        assert process_tree(process.pid) == [process.pid]
        assert rss_bytes([process.pid]) > 1 << 20
        before = cpu_seconds([process.pid])
        sender = _getter(f"http://127.0.0.1:{port}/")
        row = run_load("http.server", "-", sender, 2, 0.5, [Watched("server", process.pid, tree=False)])
        assert row.requests > 0 and row.errors == 0 and row.rss_mib["server"] > 1
        assert cpu_seconds([process.pid]) >= before and row.cpu_ms["server"] >= 0
    finally:
        assert stop_process(process) is not None
    assert process.poll() is not None
    with pytest.raises(RuntimeError, match="exited with code"):
        start_server([sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ), tmp_path / "bad.log",
                     f"http://127.0.0.1:{free_port()}/", timeout=30)


SHARER = """
import mmap, sys
region = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_SHARED)
region.write(b"x" * (64 << 20))  # 64 MiB of pages touched, shared with the child forked next
import os
child = os.fork()
if child == 0:
    region.seek(0)
    region.read()  # the child maps (and reads) the same pages
    print(os.getpid(), flush=True)
    sys.stdin.read()
    os._exit(0)
sys.stdin.read()
"""


def test_shared_pages_count_once_in_a_tree(tmp_path: Path) -> None:
    """A server and its stubs share memory: the tree's resident memory (PSS) counts a shared page once,
    summed RSS once per process (the Triton tree's RSS sum was about twice its real footprint)."""
    process = subprocess.Popen([sys.executable, "-c", SHARER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert process.stdout is not None
        int(process.stdout.readline())  # the child has read the region
        pids = process_tree(process.pid)
        assert len(pids) == 2
        shared = 64 << 20
        assert rss_bytes(pids) - resident_bytes(pids) > 0.8 * shared  # RSS counts the 64 MiB twice
        assert resident_bytes(pids) > shared  # and PSS still counts them once
    finally:
        for pid in reversed(process_tree(process.pid)):  # the child first, then its parent
            os.kill(pid, signal.SIGKILL)
        process.wait()


def _getter(url: str) -> Callable[[], bytes]:
    def get() -> bytes:
        with urllib.request.urlopen(url, timeout=10) as response:
            return bytes(response.read())

    return get


@pytest.mark.triton
def test_the_bundled_triton_is_the_launchers(cpu_repository: Path, tmp_path: Path) -> None:
    assert served_models(cpu_repository).settings.detector_model == "face_detector"
    with bundled_triton(cpu_repository, tmp_path / "triton.log") as server:
        assert server.pid is not None and server.pid in process_tree(server.pid)
        assert len(process_tree(server.pid)) >= 4  # the server and one stub per model instance
        with triton_url(None, cpu_repository, tmp_path / "other.log") as url:
            assert url != server.grpc_url and model_statistics(url)["face_pipeline"]["items"] == 0
        with triton_url(server.grpc_url) as url:
            assert url == server.grpc_url
    assert server.pid is None and (tmp_path / "triton.log").stat().st_size > 0


def test_closed_loop_counts_errors_without_raising() -> None:
    calls = {"n": 0}

    def flaky() -> None:
        calls["n"] += 1
        if calls["n"] % 2:
            raise RuntimeError("every other call fails")

    result = closed_loop(flaky, 1, 0.2, warmup=0)
    assert result.errors > 0 and result.requests > 0 and abs(result.errors - result.requests) <= 1


class _Recorder(BaseHTTPRequestHandler):
    """Answers every POST with 200 (or the status asked for in the path), records what came, and closes
    the connection after each answer when the path asks for it, as an idle server does."""

    protocol_version = "HTTP/1.1"
    seen: ClassVar[list[tuple[str, dict[str, str], bytes, int]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.seen.append((self.path, dict(self.headers), body, self.client_address[1]))
        status = 500 if "fail" in self.path else 200
        self.send_response(status)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")
        self.close_connection = "close" in self.path

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[str]:
    _Recorder.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_the_load_sender_posts_one_multipart_image_on_a_kept_alive_connection(recorder: str) -> None:
    data = bytes(range(256)) * 40 + b"\r\n--x"
    sender = MultipartSender(f"{recorder}/up?k=1", "image", "a.jpg", data, {"X-API-Key": "secret"})
    assert sender() == b"ok" and sender() == b"ok"
    sender.close()
    (path, headers, body, first), (_, _, again, second) = _Recorder.seen
    assert path == "/up?k=1" and headers["X-API-Key"] == "secret" and body == again and first == second
    parts = split_form(body, headers["Content-Type"], 10)
    assert parts is not None and [(p.name, p.filename, p.data) for p in parts] == [("image", "a.jpg", data)]



def test_the_load_sender_sends_several_images_in_turn(recorder: str) -> None:
    images = [b"first", b"second", b"third"]
    sender = MultipartSender(f"{recorder}/up", "image", "a.jpg", images)
    for _ in range(4):
        assert sender() == b"ok"
    sender.close()
    sent = []
    for _, headers, body, _ in _Recorder.seen:
        parts = split_form(body, headers["Content-Type"], 10)
        assert parts is not None
        sent.append(parts[0].data)
    assert sent == [b"first", b"second", b"third", b"first"]
    with pytest.raises(ValueError, match="no image"):
        MultipartSender(f"{recorder}/up", "image", "a.jpg", [])

def test_the_load_sender_reconnects_once_and_raises_on_an_error_status(recorder: str) -> None:
    closing = MultipartSender(f"{recorder}/close", "image", "a.jpg", b"jpeg")
    for _ in range(3):  # the server closes after every answer: each later call reconnects once
        assert closing() == b"ok"
    assert len({seen[3] for seen in _Recorder.seen}) == 3
    with pytest.raises(RuntimeError, match="500"):
        MultipartSender(f"{recorder}/fail", "image", "a.jpg", b"jpeg")()
    with pytest.raises(ValueError, match="http://"):
        MultipartSender("https://example.org/x", "image", "a.jpg", b"jpeg")
