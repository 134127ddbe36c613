"""Entrypoint of the gateway image: ``Settings`` from the environment, then uvicorn on ``create_app``.

Settings come from ``FACEREC_<SECTION>__<FIELD>`` (service/settings.py). The database URL is either
``FACEREC_DATABASE__URL`` or, so that a password never has to be written into a URL by hand (and a
Kubernetes Secret can hold the password alone), built from ``FACEREC_DB_HOST``, ``FACEREC_DB_PORT``
(5432), ``FACEREC_DB_NAME`` (facerec), ``FACEREC_DB_USER`` (facerec) and ``FACEREC_DB_PASSWORD``.

One process per container: the gallery's FAISS indexes live in the process and follow the change log
in the database, so scale with replicas (containers, pods), not with uvicorn workers.

    python entrypoint.py [--host 0.0.0.0] [--port 8080]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from service.settings import Settings

DB_PARTS = ("FACEREC_DB_HOST", "FACEREC_DB_PORT", "FACEREC_DB_NAME", "FACEREC_DB_USER", "FACEREC_DB_PASSWORD")


def database_url(env: Mapping[str, str]) -> str | None:
    """The SQLAlchemy URL from the ``FACEREC_DB_*`` parts (None when ``FACEREC_DB_HOST`` is unset)."""
    if not env.get("FACEREC_DB_HOST"):
        return None
    from sqlalchemy.engine import URL

    url = URL.create(
        "postgresql+psycopg",
        username=env.get("FACEREC_DB_USER", "facerec"),
        password=env.get("FACEREC_DB_PASSWORD") or None,
        host=env["FACEREC_DB_HOST"],
        port=int(env.get("FACEREC_DB_PORT", "5432")),
        database=env.get("FACEREC_DB_NAME", "facerec"),
    )
    return url.render_as_string(hide_password=False)


def load_settings() -> Settings:
    """Settings from ``os.environ``; a readable SystemExit (no secret values) when they are incomplete."""
    from pydantic import ValidationError

    from service.settings import Settings

    overrides: dict[str, Any] = {}
    if not os.environ.get("FACEREC_DATABASE__URL"):
        built = database_url(os.environ)
        if built is not None:
            overrides["database"] = {"url": built}
    try:
        return Settings(**overrides)  # the admin key comes from the environment
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in error['loc'])}: {error['msg']}"
                             for error in exc.errors())
        raise SystemExit(
            f"gateway settings are incomplete: {problems} "
            "(set FACEREC_SECURITY__ADMIN_KEY, at least 16 characters, and the database settings)"
        ) from None


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
                timeout_graceful_shutdown=20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
