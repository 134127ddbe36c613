"""The CompreFace API's error answers on the real gateway, Triton and database: an image id that is not one
of ours is an unknown image (404/44: never a 500, never another face), the bulk delete skips it, a failure
on the server's side (the gateway's limit, Triton, the database) keeps v1's 5xx and Retry-After (a 400 told
clients not to retry), and an HTTP error Starlette raises in a route is named for its status."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpx
import pytest
from sqlalchemy import create_engine, make_url, text
from starlette.exceptions import HTTPException as StarletteHTTPException

from facecore.client import PipelineError
from service.compat import describe
from service.compreface import compreface_error, render
from service.errors import ApiError, Overloaded, Timeout, Unavailable

if TYPE_CHECKING:
    from tests.service.fixtures import Api, StartApi

pytest_plugins = ["tests.service.fixtures"]

FACES = "/api/v1/recognition/faces"
UNAVAILABLE = "StatusCode.UNAVAILABLE"
NewDatabase = Callable[[str], AbstractContextManager[str]]  # the new_pg_database fixture


def compreface(response: httpx.Response, status: int, code: int) -> str:
    """The message of a CompreFace error answer that must have ``status`` and ``code``."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"message", "code"} and body["code"] == code, body
    return str(body["message"])


def not_ours(face_id: int) -> list[str]:
    """Image ids that are not ids as we write them, some of which Python's ``int`` would read."""
    return [
        "²",  # a digit to str.isdigit, not to int()
        "".join(chr(0x660 + int(d)) for d in str(face_id)),  # the same number in Arabic-Indic digits
        f"00{face_id}",
        "9" * 5000,  # more digits than int() converts
        str(2**63),  # beyond the database's 64-bit ids
        "0", "-1", f"+{face_id}", "1e3", "abc",
    ]


def added(api: Api, key: str, subject: str, photo: str) -> int:
    answer = api.post(FACES, key, params={"subject": subject}, files=api.files("file", photo))
    assert answer.status_code == 201, answer.text
    return int(answer.json()["image_id"])


@pytest.fixture
def keyed(start_api: StartApi) -> tuple[Api, str]:
    api = start_api()
    api.create_collection("cf")
    return api, str(api.create_key("cf")["key"])


@pytest.mark.triton
def test_an_image_id_that_is_not_ours_is_an_unknown_image(keyed: tuple[Api, str]) -> None:
    api, key = keyed
    obama = added(api, key, "obama", "obama.jpg")
    for bad in not_ours(obama):
        path = f"{FACES}/{quote(bad, safe='')}"
        assert compreface(api.delete(path, key), 404, 44) == f"Image {bad[:64]} not found"
        compreface(api.post(f"{path}/verify", key, files=api.files("file", "obama2.jpg")), 404, 44)
    assert [f["image_id"] for f in api.ok(api.get(FACES, key))["faces"]] == [str(obama)]  # still there
    compreface(api.delete(f"{FACES}/{obama + 1000}", key), 404, 44)  # as an unknown number answers


@pytest.mark.triton
def test_the_bulk_delete_skips_ids_that_are_not_ours(keyed: tuple[Api, str]) -> None:
    """Like unknown ids (CompreFace's rule): what it deleted is what it answers, the rest stays."""
    api, key = keyed
    obama, biden = added(api, key, "obama", "obama.jpg"), added(api, key, "biden", "biden.jpg")
    kept = added(api, key, "obama", "obama3.jpg")
    ids = [str(obama), *not_ours(kept), *not_ours(biden), str(biden), str(biden), "123456"]
    deleted = api.ok(api.post(f"{FACES}/delete", key, json=ids))
    assert deleted == [{"image_id": str(obama), "subject": "obama"},
                       {"image_id": str(biden), "subject": "biden"}]
    assert [f["image_id"] for f in api.ok(api.get(FACES, key))["faces"]] == [str(kept)]


@pytest.mark.triton
def test_an_overloaded_gateway_answers_503_with_retry_after(start_api: StartApi) -> None:
    """Every CompreFace route that takes an in-flight slot, with the gateway full: 503, Retry-After: 1 (as
    v1 answers), not the 400 that told clients to give up."""
    api = start_api(limits={"max_in_flight": 1})
    api.create_collection("cf")
    key = str(api.create_key("cf")["key"])
    image = api.files("file", "obama.jpg")
    calls: list[tuple[str, dict[str, Any], Any]] = [
        ("/api/v1/recognition/recognize", {}, image), (FACES, {"subject": "x"}, image),
        (f"{FACES}/1/verify", {}, image), ("/api/v1/detection/detect", {}, image),
        ("/api/v1/verification/verify", {},
         api.files("source_image", "obama.jpg") + api.files("target_image", "obama2.jpg")),
    ]
    admission = api.app.state.admission
    admission.in_flight = admission.limit
    try:
        for path, params, files in calls:
            response = api.post(path, key, params=params, files=files)
            assert "(overloaded)" in compreface(response, 503, 41), path
            assert response.headers["retry-after"] == "1", path
    finally:
        admission.in_flight = 0
    assert admission.refused == len(calls)


@pytest.mark.triton
def test_the_database_down_is_503_with_retry_after(pg_database: str, start_api: StartApi,
                                                   new_pg_database: NewDatabase) -> None:
    """The database unreachable: 503 with Retry-After on every route that needs it (v1's answer)."""
    admin = create_engine(pg_database, isolation_level="AUTOCOMMIT")
    try:
        with new_pg_database("facerec_cf_down") as url:
            name = make_url(url).database
            api = start_api(db_url=url)
            api.create_collection("cf")
            key = str(api.create_key("cf")["key"])
            with admin.connect() as connection:
                connection.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false'))
                connection.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                        "WHERE datname = :n"), {"n": name})
            for response in (api.get("/api/v1/recognition/subjects", key), api.get(FACES, key),
                             api.delete(f"{FACES}/1", key), api.post(f"{FACES}/delete", key, json=["1"]),
                             api.delete(FACES, key)):
                assert response.status_code == 503, response.text
                assert response.headers["retry-after"] == "5"
                assert response.json()["code"] == "database_unavailable"
            with admin.connect() as connection:
                connection.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true'))
            api.close()  # before the database is dropped
    finally:
        admin.dispose()


def test_every_server_side_failure_keeps_its_status() -> None:
    """Each of our 5xx errors (the ApiError classes, Triton's answers, one without a CompreFace code yet)
    keeps v1's status and Retry-After in CompreFace's shape; the caller's mistakes stay 4xx."""
    classes, seen = [ApiError], []
    while classes:
        cls = classes.pop()
        seen.append(cls)
        classes += cls.__subclasses__()
    failures: list[ApiError] = [cls("x") for cls in seen if cls.status >= 500]
    assert {type(e) for e in failures} >= {Unavailable, Overloaded, Timeout}
    failures.append(ApiError("x", code="a_new_failure", status=502))
    for exc in failures:
        response = render(exc)
        assert response is not None and response.status_code == exc.status, (exc.code, response)
        retry = response.headers.get("retry-after")
        assert retry == (str(exc.retry_after_s) if isinstance(exc, Unavailable) else None), exc.code
    full = render(PipelineError(f"[{UNAVAILABLE}] Exceeds maximum queue size", UNAVAILABLE))  # Triton's queue
    assert full is not None and (full.status_code, full.headers["retry-after"]) == (503, "1")
    down = render(PipelineError("failed to connect to all addresses", UNAVAILABLE))
    assert down is not None and (down.status_code, down.headers["retry-after"]) == (503, "5")
    mistake = compreface_error(ApiError("x", code="a_new_mistake"))
    assert mistake is not None and mistake[:2] == (400, 0)


def test_an_http_error_inside_a_route_is_named_for_its_status() -> None:
    """Starlette's 400 for a form it cannot parse is not a ``payload_too_large`` (only its 413 is), in
    either compatible API's answer."""
    refused = StarletteHTTPException(400, "Missing boundary in multipart.")
    assert describe(refused) == (400, "invalid_multipart", "Missing boundary in multipart.")
    assert compreface_error(refused) == (400, 34, "Missing boundary in multipart. (invalid_multipart)")
    large = StarletteHTTPException(413, "the body is over 10485760 bytes")
    assert describe(large) == (413, "payload_too_large", "the body is over 10485760 bytes")
    assert compreface_error(large) == (413, 0, "the body is over 10485760 bytes (payload_too_large)")
