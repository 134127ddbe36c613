"""Entrypoint of the gateway image: ``Settings`` from the environment, then uvicorn on ``create_app``.

Settings come from ``FACEREC_<SECTION>__<FIELD>`` (``facecore/settings.py``, the one settings object of
every entry point). The database URL is either ``FACEREC_DATABASE__URL`` or built there from
``FACEREC_DB_HOST``, ``FACEREC_DB_PORT``, ``FACEREC_DB_NAME``, ``FACEREC_DB_USER`` and
``FACEREC_DB_PASSWORD`` (a Kubernetes Secret can then hold the password alone).

One process per container: the gallery's FAISS indexes live in the process and follow the change log
in the database, so scale with replicas (containers, pods), not with uvicorn workers.

    python entrypoint.py [--host 0.0.0.0] [--port 8080]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from facecore.settings import GatewaySettings


#: How long a stop waits for requests in flight; the final gallery snapshot is written after it. Compose's
#: ``stop_grace_period`` and Kubernetes' ``terminationGracePeriodSeconds`` must be longer.
GRACEFUL_SHUTDOWN_S = 20


def load_settings() -> GatewaySettings:
    """Settings from ``os.environ``; a readable SystemExit (no secret values) when they are incomplete."""
    from facecore.settings import GatewaySettings, load_settings

    return load_settings(GatewaySettings)


def parse_args(argv: Sequence[str] | None, env: Mapping[str, str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="entrypoint.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default=env.get("FACEREC_HOST", "0.0.0.0"))
    parser.add_argument("--port", type=int, default=int(env.get("FACEREC_PORT", "8080")))
    parser.add_argument("--forwarded-allow-ips", default=env.get("FORWARDED_ALLOW_IPS", "127.0.0.1"),
                        help="proxies whose X-Forwarded-* headers are trusted")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv, os.environ)
    settings = load_settings()

    import uvicorn

    from service.app import create_app
    from service.logs import configure_logging

    configure_logging(settings.log_level, settings.log_json)
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_config=None, access_log=False,
                proxy_headers=True, forwarded_allow_ips=args.forwarded_allow_ips,
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    return 0


if __name__ == "__main__":
    sys.exit(main())
