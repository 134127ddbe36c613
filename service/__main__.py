"""``python -m service``: run the whole local stack — the bundled Triton and the REST gateway.

Without ``FACEREC_SECURITY__ADMIN_KEY`` an admin key is generated once into ``data/admin_key``
(mode 0600) and printed. With ``--triton-url`` an already running Triton (e.g. the NGC container) is
used instead of starting the bundled one; the bundled one is restarted when it dies or hangs (with
backoff; see service/supervisor.py), and ``/health/ready`` says so while it is down.
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
from typing import TYPE_CHECKING, Any

import uvicorn

from facecore.probe import ProbeResult
from facecore.settings import ROOT, GatewaySettings, load_settings
from service.launcher import TritonPorts, TritonServer, TritonStartError
from service.logs import configure_logging
from service.metrics import TritonRestarts
from service.supervisor import Recognition, Supervisor

if TYPE_CHECKING:
    from fastapi import FastAPI

    from service.readiness import RecognitionCheck

log = logging.getLogger("service")


def admin_key(path: Path) -> str | None:
    """The admin key from ``path`` (created on first use) when the environment has none."""
    if os.environ.get("FACEREC_SECURITY__ADMIN_KEY"):
        return None
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_urlsafe(32) + "\n")
        path.chmod(0o600)
    return path.read_text().strip()


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    """uvicorn re-raises SIGTERM after its graceful shutdown (SIGHUP it leaves to us): unwind so Triton is
    stopped too."""
    raise SystemExit(0)


def gateway_probe(app: FastAPI) -> Recognition:
    """The gateway's recognition probe (``RecognitionCheck.from_thread``) for the supervisor's thread; None
    until the app's lifespan has started it."""
    def probe(fresh: bool) -> ProbeResult | None:
        check: RecognitionCheck | None = getattr(app.state, "recognition_check", None)
        return None if check is None else check.from_thread(fresh)

    return probe


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
    from_file = admin_key(args.admin_key_file)
    overrides: dict[str, Any] = {} if from_file is None else {"security": {"admin_key": from_file}}
    settings = load_settings(GatewaySettings, **overrides)
    configure_logging(settings.log_level, settings.log_json)
    from service.app import create_app

    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    signal.signal(signal.SIGHUP, _exit_on_sigterm)  # a closed terminal: stop Triton too, as for SIGTERM
    with ExitStack() as stack:
        supervisor = None
        if args.triton_url is None:
            server = TritonServer(args.model_repository, TritonPorts(*args.triton_ports),
                                  log_file=ROOT / "data" / "tritonserver.log")
            # restarts a tritonserver that dies or hangs (service/supervisor.py)
            supervisor = Supervisor(server, hang_timeout_s=settings.triton.hang_timeout_s)
            try:
                stack.enter_context(supervisor)
            except TritonStartError as exc:
                log.error("%s (log: data/tritonserver.log)", exc)
                return 1
            triton_url = server.grpc_url
        else:
            triton_url = args.triton_url
        triton = settings.triton.model_copy(update={"url": triton_url})
        settings = settings.model_copy(update={"triton": triton})
        base = f"http://{args.host}:{args.port}"
        where = "FACEREC_SECURITY__ADMIN_KEY" if from_file is None else str(args.admin_key_file)
        print(f"\n  API docs:  {base}/docs\n  admin key: in {where}"
              f"\n  example:   curl -H \"X-API-Key: $(cat {args.admin_key_file})\" {base}/v1/collections\n",
              flush=True)
        app = create_app(settings)
        if supervisor is not None:
            app.state.triton_status = supervisor.status  # /health/ready says when Triton is restarting
            supervisor.recognition = gateway_probe(app)
            app.state.metrics.registry.register(TritonRestarts(supervisor.restart_counts))
        uvicorn.run(app, host=args.host, port=args.port, log_config=None, access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
