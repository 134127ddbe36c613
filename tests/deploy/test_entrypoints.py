"""The images' entrypoints, run here with fakes: the stub extraction, and the gateway's settings from the
compose environment (deploy/gateway/entrypoint.py). The Triton entrypoint (engines, host sizing):
tests/deploy/test_gpu.py. See tests/deploy/test_compose.py for the other deployment checks."""

from __future__ import annotations

import hashlib
import io
import re
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.deploy.helpers import DEPLOY, clear_facerec_env, load_module

pytest_plugins = ["tests.deploy.fixtures"]


def test_stub_extraction_checks_hashes(tmp_path: Path) -> None:
    extract_stub = load_module(DEPLOY / "triton" / "extract_stub.py", "facerec_extract_stub")
    assert set(extract_stub.MEMBERS) == {
        "pytriton/tritonserver/python_backend_stubs/3.11/triton_python_backend_stub",
        "nvidia_pytriton.libs/libcudart-09529672.so.12.6.77"}
    wheel = tmp_path / "w.whl"
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("a/stub", b"stub")
    wheel.write_bytes(buffer.getvalue())
    good = {"a/stub": hashlib.sha256(b"stub").hexdigest()}
    assert extract_stub.extract(wheel, tmp_path / "out", good)[0].read_bytes() == b"stub"
    with pytest.raises(SystemExit, match="sha256"):
        extract_stub.extract(wheel, tmp_path / "bad", {"a/stub": "0" * 64})


def test_gateway_settings_from_compose_environment(gateway_entry: ModuleType, models: dict[str, Any],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from sqlalchemy.engine import make_url

    clear_facerec_env(monkeypatch)
    for name, value in models["gpu"]["services"]["gateway"]["environment"].items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setenv("FACEREC_DB_PASSWORD", "p@ss/w:rd%?#")
    settings = gateway_entry.load_settings()
    url = make_url(settings.database.url)
    assert (url.drivername, url.username, url.password, url.host, url.port, url.database) == \
        ("postgresql+psycopg", "facerec", "p@ss/w:rd%?#", "postgres", 5432, "facerec")
    assert settings.triton.url == "triton:8001"
    assert str(settings.gallery.snapshot_dir) == "/var/lib/facerec/index"


def test_gateway_refuses_to_start_without_admin_key(gateway_entry: ModuleType,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    clear_facerec_env(monkeypatch)
    monkeypatch.setenv("FACEREC_DB_HOST", "postgres")
    monkeypatch.setenv("FACEREC_DB_PASSWORD", "secret-password")
    with pytest.raises(SystemExit, match="security") as raised:
        gateway_entry.load_settings()
    assert "secret-password" not in str(raised.value)
    monkeypatch.setenv("FACEREC_SECURITY__ADMIN_KEY", "short")
    with pytest.raises(SystemExit, match="16 characters"):
        gateway_entry.load_settings()


def test_probe_and_scrape_paths_exist_in_the_app(app_routes: set[str], models: dict[str, Any]) -> None:
    assert {"/health/live", "/health/ready", "/metrics"} <= app_routes
    check = " ".join(models["gpu"]["services"]["gateway"]["healthcheck"]["test"])
    assert re.search(r"127\.0\.0\.1:8080(/health/\w+)", check)[1] in app_routes  # type: ignore[index]
