"""A real HTTP gateway for clients that open their own connections (``urllib``, ``requests``, the
CompreFace and DeepStack SDKs, the REST importer): uvicorn on a free loopback port in a thread, serving
``create_app`` on the real Triton and a real database.

Test modules load it with ``pytest_plugins = ["tests.service.live_fixtures"]`` (it loads
``tests.service.fixtures`` for the Triton server, the admin key and the photos).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi import FastAPI

from facecore.settings import GatewaySettings
from service.app import create_app
from tests.readme_runner import serve

pytest_plugins = ["tests.service.fixtures"]


@dataclass(frozen=True)
class Live:
    """A running gateway: its base URL, the admin key, and a helper for the setup calls."""

    base: str
    admin_key: str
    app: FastAPI

    @property
    def host(self) -> str:
        return str(urlsplit(self.base).hostname)

    @property
    def port(self) -> int:
        return int(urlsplit(self.base).port or 80)

    def admin(self, method: str, path: str, **kwargs: Any) -> Any:
        response = httpx.request(method, self.base + path, headers={"X-API-Key": self.admin_key},
                                 timeout=60, **kwargs)
        assert response.status_code < 300, f"{method} {path}: {response.status_code} {response.text}"
        return response.json() if response.content else None

    def collection_with_key(self, name: str, **body: Any) -> str:
        """Create a collection and return a new key of it."""
        self.admin("POST", "/v1/collections", json={"name": name, **body})
        created: dict[str, Any] = self.admin("POST", f"/v1/collections/{name}/keys", json={"label": "test"})
        return str(created["key"])


StartLive = Callable[..., Live]


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for name, value in extra.items():
        nested = isinstance(value, Mapping) and isinstance(out.get(name), dict)
        out[name] = _merge(out[name], value) if nested else value
    return out


@pytest.fixture
def live_api(request: pytest.FixtureRequest, tmp_path: Path, admin_key: str) -> Iterator[StartLive]:
    """``live_api(triton_url=None, db_url=None, **sections) -> Live``: a gateway served over HTTP.

    Defaults: the session's Triton (``triton_url="127.0.0.1:1"`` for tests that never reach it), a fresh
    SQLite file, listening on loopback (``host="0.0.0.0"``: every address). Sections override settings,
    e.g. ``deepstack={"collection": "home"}``."""
    numbers = count(1)
    with ExitStack() as stack:
        def start(triton_url: str | None = None, db_url: str | None = None, host: str = "127.0.0.1",
                  **sections: Any) -> Live:
            workdir = tmp_path / f"live{next(numbers)}"
            workdir.mkdir()
            url = triton_url or request.getfixturevalue("triton").grpc_url
            base: dict[str, Any] = {
                "security": {"admin_key": admin_key}, "triton": {"url": url, "timeout_s": 30.0},
                "database": {"url": db_url or f"sqlite:///{workdir / 'gallery.db'}"},
                "gallery": {"snapshot_dir": workdir / "index"},
            }
            app = create_app(GatewaySettings(**_merge(base, sections)))
            return Live(stack.enter_context(serve(app, host=host)), admin_key, app)

        yield start
