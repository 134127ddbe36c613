"""Every dependency of every route runs on the event loop: FastAPI runs a plain ``def`` dependency in its
thread pool, one hop (two thread wake-ups, ~0.1 ms of CPU and more of latency) per dependency and request,
for what is an attribute read. Work that blocks goes to the thread pool explicitly, once, inside."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.routing import APIRoute

from service.app import ROUTERS


def _calls(dependant: Any) -> Iterator[Any]:
    for sub in dependant.dependencies:
        yield sub.call
        yield from _calls(sub)


def _on_the_loop(call: Any) -> bool:
    target = call if inspect.isfunction(call) or inspect.ismethod(call) else type(call).__call__
    return inspect.iscoroutinefunction(target) or inspect.isasyncgenfunction(target)


def test_no_route_dependency_needs_a_thread_pool_hop() -> None:
    routes = [route for router in ROUTERS for route in router.routes if isinstance(route, APIRoute)]
    assert len(routes) > 20
    hopping = sorted({f"{route.path}: {getattr(call, '__qualname__', call)}" for route in routes
                      for call in _calls(route.dependant) if not _on_the_loop(call)})
    assert hopping == []


def test_fastapis_own_telemetry_is_off(tmp_path: Any) -> None:
    """FastAPI 0.16x's OpenTelemetry hooks looked up the tracer and meter providers on every request (the
    gateway has its own Prometheus metrics and access log): they are switched off where FastAPI has them."""
    from fastapi import FastAPI

    from service.app import create_app
    from tests.service.fixtures import make_settings

    app = create_app(make_settings("127.0.0.1:1", f"sqlite:///{tmp_path}/g.db", tmp_path, "k" * 32))
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        pytest.skip("this FastAPI has no native telemetry")
    config = app._telemetry  # type: ignore[attr-defined]
    assert (config["tracing"], config["metrics"], config["logs"]) == (False, False, False)


#: The recognition routes (nearly every request) and enroll, and the dependencies FastAPI solves for each on
#: every request: one, ``admitted`` / ``admitted_collection``, which calls the key's two schemes itself;
#: the route checks ``k`` and holds its admission slot (tests/service/test_api_ops.py checks every such route
#: does).
RECOGNITION = {("POST", "/v1/collections/{collection}/identify"): 1, ("POST", "/v1/detect"): 1,
               ("POST", "/v1/verify"): 1, ("POST", "/v1/collections/{collection}/identify/batch"): 1,
               ("POST", "/v1/collections/{collection}/identities/{external_id}/verify"): 1,
               ("POST", "/v1/collections/{collection}/identities/{external_id}/faces"): 2}


def test_the_recognition_routes_solve_few_dependencies() -> None:
    """Each dependency node costs FastAPI 0.16x 20-60 us of CPU per request (it classifies and caches every
    node again; a generator enters an exit stack): the recognition routes take the use cases and settings
    from one plain dependency (eleven nodes on identify became five, then one). Enroll has one more, the
    check of its query parameters' names."""
    routes = {(method, route.path): route for router in ROUTERS for route in router.routes
              if isinstance(route, APIRoute) for method in route.methods}
    solved = {key: len(list(_calls(routes[key].dependant))) for key in RECOGNITION}
    assert solved == RECOGNITION
