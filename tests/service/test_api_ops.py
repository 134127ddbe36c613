"""Operations: health checks, Prometheus metrics, JSON logs with request ids, and how the gateway
behaves when its dependencies fail: Triton stopped and restarted, the database unreachable and back,
and replicas sharing one database.
"""

from __future__ import annotations

import io
import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
from fastapi.routing import APIRoute
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from service.launcher import TritonPorts, TritonServer
from service.logs import configure_logging
from tests.conftest import free_ports

if TYPE_CHECKING:
    from tests.service.fixtures import Api, StartApi

pytest_plugins = ["tests.service.fixtures"]

pytestmark = pytest.mark.triton


def samples(api: Api) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics: (name, sorted labels) -> value."""
    response = api.client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def sample(
    found: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float | None:
    return found.get((name, tuple(sorted(labels.items()))))


def wait_for(condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> float:
    """Poll until ``condition()``; returns the seconds it took."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(interval)
    return time.monotonic() - started


def decision(response: httpx.Response) -> str | None:
    """The external id matched by the first face of a (successful) identify response, else None."""
    assert response.status_code == 200, response.text
    faces = response.json()["faces"]
    identity = faces[0]["identity"] if faces else None
    return identity["external_id"] if identity else None


# --- health, metrics, logs -------------------------------------------------------------------------


def test_health(api: Api) -> None:
    assert api.ok(api.client.get("/health/live")) == {"status": "ok"}
    assert api.ok(api.client.get("/health/ready")) == {
        "ready": True,
        "checks": {"triton": True, "recognition": True, "database": True, "gallery": True},
        "details": {},
    }


def test_metrics(api: Api) -> None:
    api.create_collection("metered")
    for missing in ("ghost-1", "ghost-2"):
        api.error(api.get(f"/v1/collections/metered/identities/{missing}"), 404, "not_found")
    api.error(api.client.get("/v1/nowhere/at/all"), 404, "not_found")
    api.ok(api.enroll("metered", "obama", "obama.jpg", params={"create": "true"}), 201)
    api.ok(api.detect("t1.jpg"))
    found = samples(api)

    identity_route = "/v1/collections/{collection}/identities/{external_id}"
    assert sample(found, "facerec_http_requests_total", method="GET", route=identity_route, status="404") == 2
    assert (
        sample(found, "facerec_http_requests_total", method="POST", route="/v1/collections", status="201")
        == 1
    )
    assert sample(found, "facerec_http_requests_total", method="GET", route="unmatched", status="404") == 1
    routes = {dict(labels)["route"] for name, labels in found if name == "facerec_http_requests_total"}
    assert not [r for r in routes if "ghost" in r or "metered" in r or "nowhere" in r], (
        routes
    )  # templates only
    assert (
        sample(found, "facerec_http_request_duration_seconds_count", method="GET", route=identity_route) == 2
    )
    assert sample(found, "facerec_http_request_duration_seconds_sum", method="GET", route=identity_route) > 0
    assert sample(found, "facerec_triton_request_duration_seconds_count") == 2
    assert sample(found, "facerec_triton_request_duration_seconds_sum") > 0
    assert sample(found, "facerec_faces_per_request_count") == 2
    assert sample(found, "facerec_faces_per_request_sum") == 1 + 6
    assert sample(found, "facerec_faces_per_request_bucket", le="0.0") == 0
    assert sample(found, "facerec_gallery_faces", collection="metered") == 1
    assert sample(found, "facerec_gallery_index_reselecting") == 0
    assert sample(found, "facerec_gallery_index_reselections_total", outcome="chosen") == 0

    api.ok(api.enroll("metered", "obama", "obama3.jpg"), 201)
    api.create_collection("empty")
    api.ok(api.get("/v1/collections/empty"))
    found = samples(api)
    assert sample(found, "facerec_gallery_faces", collection="metered") == 2
    assert sample(found, "facerec_gallery_faces", collection="empty") == 0
    assert api.delete("/v1/collections/metered/identities/obama").status_code == 204
    assert sample(samples(api), "facerec_gallery_faces", collection="metered") == 0
    assert api.delete("/v1/collections/metered").status_code == 204
    assert sample(samples(api), "facerec_gallery_faces", collection="metered") is None


@pytest.fixture
def json_logs() -> Iterator[io.StringIO]:
    """The gateway's logging as configured at its entry point (JSON lines), captured in a buffer."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, {n: logging.getLogger(n).level for n in ("alembic", "faiss")})
    configure_logging("INFO", as_json=True)
    buffer = io.StringIO()
    handler = root.handlers[0]
    assert isinstance(handler, logging.StreamHandler)
    handler.setStream(buffer)
    try:
        yield buffer
    finally:
        root.handlers[:], level, levels = saved
        root.setLevel(level)
        for name, value in levels.items():
            logging.getLogger(name).setLevel(value)


def test_json_logs_carry_the_request_id(api: Api, json_logs: io.StringIO) -> None:
    api.create_collection("logged")
    api.error(
        api.get("/v1/collections/logged/identities/x", headers={"X-Request-ID": "req-abc.123"}),
        404,
        "not_found",
    )
    generated = api.get("/v1/collections/logged").headers["x-request-id"]
    lines = [json.loads(line) for line in json_logs.getvalue().splitlines()]  # every line is JSON
    assert lines and all({"time", "level", "logger", "message", "request_id"} <= set(e) for e in lines)
    mine = [e for e in lines if e["request_id"] == "req-abc.123"]
    assert len(mine) == 1, lines
    entry = mine[0]
    assert entry["status"] == 404 and entry["path"] == "/v1/collections/logged/identities/x"
    assert "/v1/collections/{collection}/identities/{external_id}" in entry["message"]
    assert entry["duration_ms"] >= 0 and entry["level"] == "INFO"
    assert [e["status"] for e in lines if e["request_id"] == generated] == [200]


# --- Triton stopped and restarted --------------------------------------------------------------------


def test_triton_outage_and_recovery(start_api: StartApi, cpu_repository: Path, tmp_path: Path) -> None:
    ports = TritonPorts(*free_ports(3))
    servers = [TritonServer(cpu_repository, ports, log_file=tmp_path / "triton-1.log")]
    try:
        servers[0].start()
        api = start_api(triton_url=servers[0].grpc_url)
        api.create_collection("c")
        api.ok(api.enroll("c", "obama", "obama.jpg", params={"create": "true"}), 201)
        assert decision(api.identify("c", "obama2.jpg")) == "obama"

        servers[0].stop()
        before = samples(api)
        for response in (
            api.identify("c", "obama2.jpg"),
            api.detect("obama2.jpg"),
            api.enroll("c", "obama", "obama3.jpg"),
            api.post("/v1/collections/c/identify/batch", files=api.files("images", "obama2.jpg")),
            api.post("/v1/verify", files=api.files("image_a", "t1.jpg") + api.files("image_b", "t1.jpg")),
        ):
            api.error(response, 503, "triton_unavailable")
        # the failed calls are in the latency histogram and counted (they were left out: an outage looked
        # like fewer, fast calls); no faces are counted for them
        after = samples(api)
        calls = "facerec_triton_request_duration_seconds_count"
        assert sample(after, calls) == (sample(before, calls) or 0) + 6  # verify: a call per image
        assert sample(after, "facerec_triton_request_failures_total") == 6
        faces = "facerec_faces_per_request_count"
        assert sample(after, faces) == sample(before, faces)
        ready = api.client.get("/health/ready")
        assert ready.status_code == 503
        body = ready.json()
        assert {k: body[k] for k in ("ready", "checks")} == {
            "ready": False,
            "checks": {"triton": False, "recognition": False, "database": True, "gallery": True},
        }
        assert "not ready" in body["details"]["recognition"]
        assert api.client.get("/health/live").status_code == 200
        # What needs no inference keeps working.
        assert [f["has_crop"] for f in api.ok(api.get("/v1/collections/c/identities/obama/faces"))] == [True]

        servers.append(TritonServer(cpu_repository, ports, log_file=tmp_path / "triton-2.log"))
        servers[1].start()

        def recovered() -> bool:
            response = api.identify("c", "obama2.jpg")
            assert response.status_code in {200, 503}, response.text
            return response.status_code == 200 and decision(response) == "obama"

        wait_for(recovered, 60, "identify after Triton came back", interval=0.5)
        assert api.ok(api.client.get("/health/ready"))["ready"] is True
        assert len(api.ok(api.detect("t1.jpg"))["faces"]) == 6
    finally:
        for server in servers:
            server.stop()


# --- the database unreachable -----------------------------------------------------------------------


@pytest.fixture
def scratch_pg(
    pg_database: str, new_pg_database: Callable[[str], AbstractContextManager[str]]
) -> Iterator[tuple[str, Callable[[bool], None]]]:
    """A PostgreSQL database of its own (it is closed to connections during the test) and a switch
    ``allow(bool)`` that opens or closes it (closing also ends its open connections)."""
    admin = create_engine(pg_database, isolation_level="AUTOCOMMIT")
    try:
        with new_pg_database("facerec_api_down") as url:
            name = make_url(url).database

            def allow(yes: bool) -> None:
                with admin.connect() as connection:
                    connection.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS {str(yes).lower()}'))
                    if not yes:
                        connection.execute(
                            text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"),
                            {"n": name},
                        )

            yield url, allow
    finally:
        admin.dispose()


def test_database_outage_and_recovery(
    scratch_pg: tuple[str, Callable[[bool], None]], start_api: StartApi
) -> None:
    # scratch_pg first: set up first, it is torn down (dropped) last, after the app that uses it.
    url, allow = scratch_pg
    api = start_api(db_url=url)
    api.create_collection("c")
    api.create_identity("c", "obama", "Barack Obama")
    api.ok(api.enroll("c", "obama", "obama.jpg"), 201)
    key, unseen = api.create_key("c")["key"], api.create_key("c")["key"]
    time.sleep(0.6)  # the key watch has seen the new keys (it forgets every key when the table changes)
    assert decision(api.identify("c", "obama2.jpg", key)) == "obama"  # the gateway remembers this key

    allow(False)
    try:
        for response in (
            api.get("/v1/collections"),
            api.get("/v1/collections/c/identities"),
            api.get("/v1/collections/c/identities/obama"),
            api.post("/v1/collections/c/identities", json={"external_id": "new"}),
            api.delete("/v1/collections/c/identities/obama"),
            api.get("/v1/collections/c", unseen),  # a key never seen here is checked in the database
            api.identify("c", "obama2.jpg", unseen),
        ):
            api.error(response, 503, "database_unavailable")
        assert decision(api.identify("c", "obama2.jpg")) == "obama"  # the index and its labels are in memory
        assert decision(api.identify("c", "obama2.jpg", key)) == "obama"  # a key seen before keeps working
        ready = api.client.get("/health/ready")  # still ready: it answers identify; writes get 503
        assert ready.status_code == 200 and ready.json()["checks"] == {
            "triton": True,
            "recognition": True,
            "database": False,
            "gallery": True,
        }
        assert api.client.get("/health/live").status_code == 200
        assert api.ok(api.detect("t1.jpg"))["faces"]  # detection needs no database
    finally:
        allow(True)

    wait_for(lambda: api.get("/v1/collections/c/identities").status_code == 200, 30, "the database is back")
    assert api.ok(api.get("/v1/collections/c/identities/obama"))["name"] == "Barack Obama"
    assert api.ok(api.get("/v1/collections/c", key))["faces"] == 1
    assert decision(api.identify("c", "obama2.jpg")) == "obama"
    assert api.ok(api.client.get("/health/ready"))["ready"] is True


# --- replicas ---------------------------------------------------------------------------------------


def test_replicas_share_one_database(start_api: StartApi, db_url: str) -> None:
    """Two gateways on one database (two processes in production): what one writes, the other serves
    within a second, through its change-log follower."""
    first, second = start_api(db_url=db_url), start_api(db_url=db_url)
    first.create_collection("shared")
    first.create_identity("shared", "obama", "Barack Obama")
    assert second.ok(second.get("/v1/collections/shared/identities/obama"))["name"] == "Barack Obama"
    assert decision(second.identify("shared", "obama2.jpg")) is None  # the second replica's index is loaded

    def second_sees(count: int) -> Callable[[], bool]:
        return lambda: second.ok(second.get("/v1/collections/shared"))["faces"] == count

    first.ok(first.enroll("shared", "obama", "obama.jpg"), 201)
    took = wait_for(second_sees(1), 1.0, "the second replica's index has the new face")
    assert decision(second.identify("shared", "obama2.jpg")) == "obama"

    key = first.create_key("shared")["key"]
    assert second.ok(second.get("/v1/collections/shared", key))["faces"] == 1
    assert second.delete("/v1/collections/shared/identities/obama").status_code == 204
    took = max(
        took,
        wait_for(
            lambda: first.ok(first.get("/v1/collections/shared"))["faces"] == 0,
            1.0,
            "the first replica's index drops the face",
        ),
    )
    assert decision(first.identify("shared", "obama2.jpg")) is None
    assert took < 1.0


def test_load_beyond_the_in_flight_limit_is_shed_with_503(start_api: StartApi) -> None:
    """With room for 2 recognition requests, 10 at once: some are answered 503 overloaded (Retry-After: 1)
    at once, the admitted ones succeed, and once the burst is over a request is admitted again."""
    from concurrent.futures import ThreadPoolExecutor

    api = start_api(limits={"max_in_flight": 2})
    api.create_collection("c")
    with ThreadPoolExecutor(10) as pool:
        responses = list(pool.map(lambda _: api.identify("c", "t1.jpg"), range(10)))
    statuses = sorted(r.status_code for r in responses)
    assert 200 in statuses and 503 in statuses and set(statuses) <= {200, 503}, statuses
    for response in responses:
        if response.status_code == 503:
            api.error(response, 503, "overloaded")
            assert response.headers["retry-after"] == "1"
    assert api.app.state.admission.in_flight == 0 and api.app.state.admission.refused == statuses.count(503)
    api.ok(api.identify("c", "obama.jpg"))
    families = {f.name: f for f in text_string_to_metric_families(api.get("/metrics").text)}
    assert families["facerec_shed_requests"].samples[0].value == statuses.count(503)


def _admitted_routes() -> set[str]:
    """The path templates of the app's routes that take ``AdmittedDep`` / ``AdmittedCollectionDep``."""
    from service.app import ROUTERS
    from service.deps import admitted, admitted_collection

    return {route.path for router in ROUTERS for route in router.routes if isinstance(route, APIRoute)
            and any(d.call in (admitted, admitted_collection) for d in route.dependant.dependencies)}


def test_every_admitted_route_holds_a_slot_and_lists_the_key_schemes(start_api: StartApi) -> None:
    """Each route that takes the admitted dependency (which checks the key, not the limit) holds an
    in-flight slot around its work: with the gateway full, every one answers 503 overloaded; and each
    lists the key's two security schemes in the OpenAPI document, as a route solving them would."""
    from service.deps import KEY_SECURITY

    api = start_api(limits={"max_in_flight": 2})
    api.create_collection("c")
    api.ok(api.enroll("c", "obama", "obama.jpg", params={"create": "true"}), 201)
    image = api.files("image", "obama.jpg")
    calls = {
        "/v1/detect": ("/v1/detect", image),
        "/v1/collections/{collection}/identify": ("/v1/collections/c/identify", image),
        "/v1/collections/{collection}/identify/batch": ("/v1/collections/c/identify/batch",
                                                        api.files("images", "obama.jpg")),
        "/v1/verify": ("/v1/verify", api.files("image_a", "obama.jpg") + api.files("image_b", "obama2.jpg")),
        "/v1/collections/{collection}/identities/{external_id}/verify":
            ("/v1/collections/c/identities/obama/verify", image),
        "/v1/collections/{collection}/identities/{external_id}/faces":
            ("/v1/collections/c/identities/obama/faces", api.files("images", "obama2.jpg")),
    }
    assert _admitted_routes() == set(calls)
    admission = api.app.state.admission
    admission.in_flight = admission.limit
    try:
        for path, files in calls.values():
            api.error(api.post(path, files=files), 503, "overloaded")
    finally:
        admission.in_flight = 0
    assert admission.refused == len(calls)
    for path, files in calls.values():
        assert api.post(path, files=files).status_code in (200, 201), path
    assert admission.in_flight == 0
    document = api.app.openapi()
    for path in calls:
        assert document["paths"][path]["post"]["security"] == KEY_SECURITY, path


def test_a_full_triton_queue_is_overloaded_not_unavailable() -> None:
    from facecore.client import PipelineError
    from service.errors import Overloaded, Unavailable, pipeline_error

    full = pipeline_error(PipelineError("[StatusCode.UNAVAILABLE] Exceeds maximum queue size",
                                        "StatusCode.UNAVAILABLE"))
    assert isinstance(full, Overloaded) and full.code == "overloaded" and full.retry_after_s == 1
    down = pipeline_error(PipelineError("failed to connect to all addresses", "StatusCode.UNAVAILABLE"))
    assert isinstance(down, Unavailable) and down.code == "triton_unavailable"


def test_a_refused_or_failed_recognition_request_gives_its_admission_back(start_api: StartApi) -> None:
    """With room for one request, requests that fail inside the route (an unreadable image, an unknown
    collection, k above max_k, a 403 key) each leave the limit as they found it: the next one is admitted."""
    api = start_api(limits={"max_in_flight": 1, "max_k": 10})
    api.create_collection("c")
    api.create_collection("d")
    other = api.create_key("d")["key"]
    failures = [
        (api.post("/v1/collections/c/identify", files={"image": ("x.jpg", b"\xff\xd8\xff" + b"\x00" * 64,
                                                                 "image/jpeg")}), 400),
        (api.identify("missing", "obama.jpg"), 404),
        (api.identify("c", "obama.jpg", params={"k": 11}), 422),
        (api.identify("c", "obama.jpg", key=other), 403),
        (api.post("/v1/verify", files=api.files("image_a", "obama.jpg")), 400),
    ]
    for response, status in failures:
        assert response.status_code == status, response.text
        assert api.app.state.admission.in_flight == 0
    api.ok(api.identify("c", "obama.jpg"))
    api.ok(api.post("/v1/detect", files=api.files("image", "obama.jpg")))
    assert api.app.state.admission.in_flight == 0 and api.app.state.admission.refused == 0
