"""Fixtures shared by the deployment tests (tests/deploy/).

Test modules load this file with ``pytest_plugins = ["tests.deploy.fixtures"]`` and never import it.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

from tests.deploy.compose_files import interpolate, load_compose, load_model, plain, read_env_file
from tests.deploy.helpers import COMPOSE, COMPOSE_CPU, DEPLOY, ENV_EXAMPLE, load_module


@pytest.fixture(scope="module")
def example_env() -> dict[str, str]:
    return read_env_file(ENV_EXAMPLE)


@pytest.fixture(scope="module")
def models(example_env: dict[str, str]) -> dict[str, dict[str, Any]]:
    """The interpolated compose models: each file alone and the two configurations."""
    return {
        "docker-compose.yml": interpolate(load_compose(COMPOSE), example_env),
        # The override alone (for the schema): its `!reset`/`!override` values as written.
        "docker-compose.cpu.yml": plain(interpolate(load_compose(COMPOSE_CPU), example_env)),
        "gpu": load_model([COMPOSE], example_env),
        "cpu": load_model([COMPOSE, COMPOSE_CPU], example_env),
    }


@pytest.fixture(scope="module")
def gateway_entry() -> ModuleType:
    return load_module(DEPLOY / "gateway" / "entrypoint.py", "facerec_gateway_entrypoint")


@pytest.fixture(scope="module")
def app_routes() -> set[str]:
    from facecore.settings import GatewaySettings
    from service.app import create_app

    app = create_app(GatewaySettings(security={"admin_key": "x" * 16}))
    return set(app.openapi()["paths"])
