"""A milvus-lite server (the real Milvus, packaged in the ``milvus-lite`` wheel) in its own process.

``MilvusClient("file.db")`` would start one inside the calling process, reachable only from it; the
gallery tests and benchmarks need one that several processes share and that survives a SIGKILLed
client, so this starts the wheel's ``milvus`` binary on a TCP port, as its own ``Server`` class does.
For development and tests (the `milvus` extra); production runs Milvus standalone or a cluster.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

from milvus_lite.server import BIN_PATH


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class MilvusLite:
    def __init__(self, db_file: Path, port: int | None = None) -> None:
        self.db_file, self.port = db_file, port or free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> MilvusLite:
        self.db_file.parent.mkdir(parents=True, exist_ok=True)
        self._process = subprocess.Popen(
            [os.path.join(BIN_PATH, "milvus"), str(self.db_file), f"127.0.0.1:{self.port}", "ERROR"],
            env={"LD_LIBRARY_PATH": BIN_PATH}, cwd=self.db_file.parent, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return self
            except OSError:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"milvus-lite did not start on port {self.port}") from None
                time.sleep(0.05)

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
