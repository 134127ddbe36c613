"""A throwaway PostgreSQL cluster that a fault test may stop and start: ``initdb`` in a folder of its own, on
a free loopback port, with trust authentication (never the shared server on 5432).

PostgreSQL refuses to run as root: as root the binaries run as the ``postgres`` user (``runuser``), in a
folder under the system's temporary directory that it owns (pytest's ``tmp_path`` lies under a folder only
root may enter).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.conftest import free_ports

BIN = Path(os.environ.get("FACEREC_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))
#: The unprivileged account the server runs as when the tests run as root.
SERVER_USER = "postgres"


def _as_server_user() -> list[str]:
    return ["runuser", "-u", SERVER_USER, "--"] if os.geteuid() == 0 else []


def unavailable() -> str | None:
    """Why no cluster can be made here (a skip reason), or None."""
    if not (BIN / "initdb").exists() or not (BIN / "pg_ctl").exists():
        return f"no PostgreSQL binaries in {BIN} (set FACEREC_TEST_PG_BIN)"
    if os.geteuid() == 0:
        if shutil.which("runuser") is None:
            return "running as root without runuser: PostgreSQL refuses to run as root"
        try:
            import pwd

            pwd.getpwnam(SERVER_USER)
        except KeyError:
            return f"running as root without a {SERVER_USER!r} user to run PostgreSQL as"
    return None


class PgCluster:
    """``create()`` makes and starts it; ``stop()`` / ``start()`` take it down and bring it back on the same
    port with the same data; ``remove()`` stops it and deletes its folder."""

    def __init__(self, root: Path, port: int) -> None:
        self.root, self.port = root, port
        self.data, self.log = root / "data", root / "server.log"

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    @classmethod
    def create(cls) -> PgCluster:
        root = Path(tempfile.mkdtemp(prefix="facerec-pg-"))
        if os.geteuid() == 0:
            shutil.chown(root, SERVER_USER, SERVER_USER)
        cluster = cls(root, free_ports(1)[0])
        try:
            cluster._run("initdb", "-D", str(cluster.data), "-A", "trust", "-U", "postgres", "-E", "UTF8",
                         "--no-sync", "--no-instructions")
            cluster.start()
        except BaseException:
            cluster.remove()
            raise
        return cluster

    def _run(self, tool: str, *args: str) -> None:
        result = subprocess.run([*_as_server_user(), str(BIN / tool), *args], capture_output=True, text=True,
                                timeout=60, check=False)
        if result.returncode != 0:
            log = self.log.read_text()[-3000:] if self.log.exists() else ""
            raise RuntimeError(f"{tool} {' '.join(args)}: exit {result.returncode}\n{result.stdout}\n"
                               f"{result.stderr}\n--- server log ---\n{log}")

    def start(self) -> None:
        """Start and wait until it accepts connections. fsync is off: the tests kill the server, never the
        machine, so the data is kept by the kernel either way."""
        options = (f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories='' "
                   "-c fsync=off -c full_page_writes=off -c max_connections=60 -c shared_buffers=16MB")
        self._run("pg_ctl", "start", "-w", "-t", "60", "-D", str(self.data), "-l", str(self.log),
                  "-o", options)

    def stop(self, mode: str = "immediate") -> None:
        """``immediate``: the server dies as in a crash (every connection cut, recovery at the next start)."""
        self._run("pg_ctl", "stop", "-w", "-t", "60", "-D", str(self.data), "-m", mode)

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def remove(self) -> None:
        if self.running():
            self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
