"""Fixtures for the REST API tests: the real gateway on the real Triton, a real database and FAISS.

Test modules load this file with ``pytest_plugins = ["tests.service.fixtures"]`` and never import it at
run time (pytest must import it itself to rewrite its asserts); for annotations they import ``Api``
under ``TYPE_CHECKING`` only. It loads ``tests.gallery.fixtures`` for the PostgreSQL scratch database
(``pg_database``) and the engine-parametrized ``db_url``.

``start_api(...)`` builds ``create_app(GatewaySettings(...))`` and enters a ``TestClient`` as a context
manager, so the lifespan (migrations, gallery load, follower thread, Triton client) really runs; every
client is closed at the end of the test. The returned ``Api`` wraps the client with the admin key and
the helpers the tests share (upload building, error-body checks).
"""

from __future__ import annotations

import secrets
import string
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from facecore.settings import GatewaySettings
from service.app import create_app

pytest_plugins = ["tests.gallery.fixtures"]

#: Keys of every error body, exactly.
ERROR_KEYS = {"code", "message", "details"}
MEDIA = {".jpg": "image/jpeg", ".png": "image/png"}

#: ``key`` argument meaning "send no key at all".
NO_KEY = ""

Image = str | bytes  # a photo name (``obama.jpg``) or encoded bytes


def random_key(length: int = 32) -> str:
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(length))


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for name, value in extra.items():
        out[name] = (
            _merge(out[name], value)
            if isinstance(value, Mapping) and isinstance(out.get(name), dict)
            else value
        )
    return out


def make_settings(
    triton_url: str, db_url: str, workdir: Path, admin_key: str, **sections: Mapping[str, Any]
) -> GatewaySettings:
    """Settings for one app: ``sections`` override (deep-merged), e.g. ``limits={"max_pixels": 10**6}``."""
    base: dict[str, Any] = {
        "security": {"admin_key": admin_key},
        "triton": {"url": triton_url, "timeout_s": 30.0},
        "database": {"url": db_url},
        "gallery": {"snapshot_dir": workdir / "index"},
    }
    return GatewaySettings(**_merge(base, sections))


class Api:
    """A started app behind a ``TestClient``; requests carry the admin key unless told otherwise."""

    def __init__(self, client: TestClient, app: FastAPI, admin_key: str, photos: Mapping[str, bytes]) -> None:
        self.client, self.app, self.admin_key, self.photos = client, app, admin_key, photos
        self.closed = False

    def close(self) -> None:
        """Stop the app (its lifespan's shutdown); idempotent, and done by the fixture at the latest."""
        if not self.closed:
            self.closed = True
            self.client.__exit__(None, None, None)

    @property
    def settings(self) -> GatewaySettings:
        settings: GatewaySettings = self.app.state.settings
        return settings

    # --- raw requests ------------------------------------------------------------------------

    def headers(self, key: str | None = None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """``X-API-Key`` with ``key`` (default: the admin key; ``NO_KEY``: none)."""
        key = self.admin_key if key is None else key
        headers = {"X-API-Key": key} if key else {}
        headers.update(extra or {})
        return headers

    def request(
        self,
        method: str,
        url: str,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        response = self.client.request(method, url, headers=self.headers(key, headers), **kwargs)
        # No call in these tests may end in a 500 (the TestClient re-raises unhandled exceptions itself).
        assert response.status_code != 500, f"{method} {url}: 500 {response.text[:800]}"
        return response

    def get(self, url: str, key: str | None = None, **kwargs: Any) -> httpx.Response:
        return self.request("GET", url, key, **kwargs)

    def post(self, url: str, key: str | None = None, **kwargs: Any) -> httpx.Response:
        return self.request("POST", url, key, **kwargs)

    def patch(self, url: str, key: str | None = None, **kwargs: Any) -> httpx.Response:
        return self.request("PATCH", url, key, **kwargs)

    def delete(self, url: str, key: str | None = None, **kwargs: Any) -> httpx.Response:
        return self.request("DELETE", url, key, **kwargs)

    # --- images ------------------------------------------------------------------------------

    def image(self, image: Image) -> bytes:
        return self.photos[image] if isinstance(image, str) else image

    def files(self, field: str, *images: Image) -> list[tuple[str, tuple[str, bytes, str]]]:
        """Multipart file parts named ``field`` (photo names get their media type)."""
        parts = []
        for i, image in enumerate(images):
            name = image if isinstance(image, str) else f"upload{i}.bin"
            media = MEDIA.get(Path(name).suffix, "application/octet-stream")
            parts.append((field, (name, self.image(image), media)))
        return parts

    # --- the common calls --------------------------------------------------------------------

    def ok(self, response: httpx.Response, status: int = 200) -> Any:
        """The JSON body of a response that must have ``status``."""
        assert response.status_code == status, (
            f"{response.request.method} {response.request.url}: {response.status_code} {response.text[:800]}"
        )
        return response.json() if response.content else None

    def create_collection(self, name: str, **body: Any) -> dict[str, Any]:
        created: dict[str, Any] = self.ok(self.post("/v1/collections", json={"name": name, **body}), 201)
        return created

    def create_identity(
        self, collection: str, external_id: str, name: str = "", key: str | None = None, **metadata: Any
    ) -> dict[str, Any]:
        body = {"external_id": external_id, "name": name, "metadata": metadata}
        created: dict[str, Any] = self.ok(
            self.post(f"/v1/collections/{collection}/identities", key, json=body), 201
        )
        return created

    def create_key(self, collection: str, label: str = "") -> dict[str, Any]:
        created: dict[str, Any] = self.ok(
            self.post(f"/v1/collections/{collection}/keys", json={"label": label}), 201
        )
        return created

    def enroll(
        self,
        collection: str,
        external_id: str,
        *images: Image,
        key: str | None = None,
        params: Mapping[str, Any] | None = None,
        data: Mapping[str, str] | None = None,
    ) -> httpx.Response:
        return self.post(
            f"/v1/collections/{collection}/identities/{external_id}/faces",
            key,
            files=self.files("images", *images),
            params=params,
            data=data,
        )

    def identify(
        self, collection: str, image: Image, key: str | None = None, params: Mapping[str, Any] | None = None
    ) -> httpx.Response:
        return self.post(
            f"/v1/collections/{collection}/identify", key, files=self.files("image", image), params=params
        )

    def detect(self, image: Image, key: str | None = None) -> httpx.Response:
        return self.post("/v1/detect", key, files=self.files("image", image))

    # --- checks ------------------------------------------------------------------------------

    @staticmethod
    def error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
        """Check an error response (status, the one error model, the code, a request id) and return its
        ``details``."""
        where = f"{response.request.method} {response.request.url.path}"
        assert response.status_code == status, f"{where}: {response.status_code} {response.text[:800]}"
        body = response.json()
        assert isinstance(body, dict) and set(body) == ERROR_KEYS, f"{where}: not an error body: {body}"
        assert body["code"] == code, f"{where}: code {body['code']!r}, expected {code!r}: {body}"
        assert isinstance(body["message"], str) and body["message"], f"{where}: empty message: {body}"
        assert isinstance(body["details"], dict), f"{where}: details is not an object: {body}"
        assert response.headers.get("x-request-id"), f"{where}: no X-Request-ID"
        if status == 503:
            assert response.headers.get("retry-after", "").isdigit(), f"{where}: 503 without Retry-After"
        details: dict[str, Any] = body["details"]
        return details


StartApi = Callable[..., Api]


@pytest.fixture(scope="session")
def admin_key() -> str:
    return random_key(32)


@contextmanager
def _app_starter(
    request: pytest.FixtureRequest, root: Path, admin_key: str, photo_bytes: dict[str, bytes]
) -> Iterator[StartApi]:
    stack = ExitStack()
    count = 0

    def start(
        db_url: str | None = None,
        triton_url: str | None = None,
        workdir: Path | None = None,
        **sections: Mapping[str, Any],
    ) -> Api:
        nonlocal count
        count += 1
        workdir = workdir or root / f"app{count}"
        workdir.mkdir(parents=True, exist_ok=True)
        db_url = db_url or f"sqlite:///{root / 'gallery.db'}"
        triton_url = triton_url or request.getfixturevalue("triton").grpc_url
        app = create_app(make_settings(triton_url, db_url, workdir, admin_key, **sections))
        client = TestClient(app)
        client.__enter__()  # runs the lifespan
        api = Api(client, app, admin_key, photo_bytes)
        stack.callback(api.close)
        return api

    with stack:
        yield start


@pytest.fixture
def start_api(
    request: pytest.FixtureRequest, tmp_path: Path, admin_key: str, photo_bytes: dict[str, bytes]
) -> Iterator[StartApi]:
    """``start_api(db_url=None, triton_url=None, workdir=None, **sections) -> Api``: a started app.

    Defaults: a fresh SQLite file, the session's Triton, a fresh snapshot folder. Several calls with the
    same ``db_url`` are replicas of one deployment. Every app is stopped at the end of the test.
    """
    with _app_starter(request, tmp_path, admin_key, photo_bytes) as start:
        yield start


@pytest.fixture(scope="module")
def start_module_api(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    admin_key: str,
    photo_bytes: dict[str, bytes],
) -> Iterator[StartApi]:
    """``start_api`` whose apps live as long as the test module (stopped at its end)."""
    with _app_starter(request, tmp_path_factory.mktemp("api"), admin_key, photo_bytes) as start:
        yield start


@pytest.fixture(scope="session")
def new_pg_database(pg_database: str) -> Callable[[str], AbstractContextManager[str]]:
    """``with new_pg_database(prefix) as url``: a PostgreSQL database of its own, dropped at the end
    (for tests that close it to connections, or keep apps on it for a whole module)."""

    @contextmanager
    def create(prefix: str) -> Iterator[str]:
        name = f"{prefix}_{secrets.token_hex(4)}"
        admin = create_engine(pg_database, isolation_level="AUTOCOMMIT")  # any database can create one
        try:
            with admin.connect() as connection:
                connection.execute(text(f'CREATE DATABASE "{name}"'))
            try:
                yield make_url(pg_database).set(database=name).render_as_string(hide_password=False)
            finally:
                with admin.connect() as connection:
                    connection.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true'))
                    connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        finally:
            admin.dispose()

    return create


@pytest.fixture
def api(start_api: StartApi) -> Api:
    """An app on a fresh SQLite database."""
    return start_api()
