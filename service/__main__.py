"""``python -m service``: run the whole local stack — the bundled Triton and the REST gateway.

Without ``FACEREC_SECURITY__ADMIN_KEY`` an admin key is generated once into ``data/admin_key``
(mode 0600) and printed. With ``--triton-url`` an already running Triton (e.g. the NGC container) is
used instead of starting the bundled one.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import sys
from contextlib import ExitStack
from pathlib import Path

import uvicorn

from service.launcher import TritonPorts, TritonServer, TritonStartError
from service.logs import configure_logging
from service.settings import ROOT

log = logging.getLogger("service")


def admin_key(path: Path) -> str:
    """The admin key from the environment, else from ``path`` (created on first use)."""
    from_env = os.environ.get("FACEREC_SECURITY__ADMIN_KEY")
    if from_env:
        return from_env
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_urlsafe(32) + "\n")
        path.chmod(0o600)
    return path.read_text().strip()


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    """uvicorn re-raises the signal after its graceful shutdown: unwind so Triton is stopped too."""
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--triton-url",
                        help="use this running Triton (gRPC host:port) instead of the bundled one")
    parser.add_argument("--model-repository", type=Path, default=ROOT / "model_repository" / "cpu")
    parser.add_argument("--triton-ports", type=int, nargs=3, default=[8000, 8001, 8002],
                        metavar=("HTTP", "GRPC", "METRICS"), help="ports of the bundled Triton")
    parser.add_argument("--admin-key-file", type=Path, default=ROOT / "data" / "admin_key")
    args = parser.parse_args(argv)
    configure_logging(os.environ.get("FACEREC_LOG_LEVEL", "INFO"),
                      os.environ.get("FACEREC_LOG_JSON", "false").lower() in ("1", "true", "yes"))
    from_env = bool(os.environ.get("FACEREC_SECURITY__ADMIN_KEY"))
    os.environ["FACEREC_SECURITY__ADMIN_KEY"] = admin_key(args.admin_key_file)
    from service.app import create_app
    from service.settings import Settings

    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    with ExitStack() as stack:
        triton_url = args.triton_url
        if triton_url is None:
            server = TritonServer(args.model_repository, TritonPorts(*args.triton_ports),
                                  log_file=ROOT / "data" / "tritonserver.log")
            try:
                stack.enter_context(server)
            except TritonStartError as exc:
                log.error("%s (log: data/tritonserver.log)", exc)
                return 1
            triton_url = server.grpc_url
        os.environ["FACEREC_TRITON__URL"] = triton_url
        settings = Settings()  # the admin key comes from the environment
        base = f"http://{args.host}:{args.port}"
        where = "FACEREC_SECURITY__ADMIN_KEY" if from_env else str(args.admin_key_file)
        print(f"\n  API docs:  {base}/docs\n  admin key: in {where}"
              f"\n  example:   curl -H \"X-API-Key: $(cat {args.admin_key_file})\" {base}/v1/collections\n",
              flush=True)
        uvicorn.run(create_app(settings), host=args.host, port=args.port, log_config=None, access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
