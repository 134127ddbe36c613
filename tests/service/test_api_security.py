"""Authentication and authorization of every route, read from ``app.routes`` (a new route is covered
the moment it exists): 401 without a valid key, 403 across collections and on admin routes for
collection keys, key lifecycle (shown once, listed without the secret, revocation), and no route that
lets one collection's key see another collection's data.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import fastapi.routing
import pytest
from fastapi.dependencies.models import Dependant

from service.deps import admin, admitted, admitted_collection, collection_access, principal

if TYPE_CHECKING:
    from tests.service.fixtures import Api

pytest_plugins = ["tests.service.fixtures"]

pytestmark = pytest.mark.triton

PUBLIC = {
    "/health/live",
    "/health/ready",
    "/metrics",
    "/openapi.json",
    "/docs",
    "/docs/oauth2-redirect",
    "/redoc",
}
#: The web demo's page and assets (service/routers/demo.py): public, outside the schema, no data.
DEMO = {"/", "/static/{name}"}
#: The CompreFace- and DeepStack-compatible APIs check their clients' keys (``x-api-key`` header, the
#: ``api_key`` form field) inside the handlers, in the clients' own error formats (docs/compat.md).
COMPAT_PREFIXES = ("/api/v1/", "/v1/vision/")


@dataclass(frozen=True)
class Endpoint:
    method: str
    path: str  # template, e.g. /v1/collections/{collection}
    access: str  # "public", "any" (any valid key), "collection" (admin or this collection's key), "admin"

    def url(self, collection: str = "alpha", external_id: str = "alpha-1", number: int = 1) -> str:
        values = {"collection": collection, "external_id": external_id, "face_id": number, "key_id": number}
        return re.sub(r"\{(\w+)\}", lambda m: str(values[m.group(1)]), self.path)


def _calls(dependant: Dependant) -> Iterator[Callable[..., Any]]:
    for dependency in dependant.dependencies:
        if dependency.call is not None:
            yield dependency.call
        yield from _calls(dependency)


def _access(calls: set[Callable[..., Any]]) -> str:
    if admin in calls:
        return "admin"
    if collection_access in calls or admitted_collection in calls:
        return "collection"
    return "any" if principal in calls or admitted in calls else "public"


def routes(api: Api) -> list[Any]:
    """The app's routes, flattened (FastAPI >= 0.165 nests included routers in ``app.routes``)."""
    flatten = getattr(fastapi.routing, "iter_route_contexts", None)
    return list(flatten(api.app.routes)) if flatten else list(api.app.routes)


def endpoints(api: Api) -> list[Endpoint]:
    """Every (method, path) of the app with the access its dependencies enforce."""
    found = []
    for route in routes(api):
        dependant = getattr(route, "dependant", None)
        access = _access(set(_calls(dependant)) if isinstance(dependant, Dependant) else set())
        assert route.path and route.methods, f"unexpected route {route!r}"
        found += [Endpoint(m, route.path, access) for m in sorted(route.methods) if m != "HEAD"]
    assert len(found) > 20, found
    return found


@pytest.fixture
def two_collections(api: Api) -> Api:
    for name in ("alpha", "bravo"):
        api.create_collection(name)
        api.create_identity(name, f"{name}-1", f"{name.title()} One")
    return api


def test_routes_are_classified(api: Api) -> None:
    """Only health, metrics, the docs (and the demo page) are public; collection routes check it."""
    found = [e for e in endpoints(api) if not e.path.startswith(COMPAT_PREFIXES)]
    public = {e.path for e in found if e.access == "public"}
    assert PUBLIC <= public <= PUBLIC | DEMO, public
    assert not [e for e in found if e.path.startswith("/v1") and e.access == "public"]
    for endpoint in found:
        if "{collection}" in endpoint.path:
            assert endpoint.access in {"collection", "admin"}, endpoint
        if endpoint.access == "admin":
            assert endpoint.path.startswith("/v1/collections"), endpoint
    assert {(e.method, e.path) for e in found if e.access == "admin"} == {
        ("GET", "/v1/collections"),
        ("POST", "/v1/collections"),
        ("PATCH", "/v1/collections/{collection}"),
        ("DELETE", "/v1/collections/{collection}"),
        ("GET", "/v1/collections/{collection}/keys"),
        ("POST", "/v1/collections/{collection}/keys"),
        ("DELETE", "/v1/collections/{collection}/keys/{key_id}"),
    }
    # The schema documents the keys on every protected operation.
    paths = api.ok(api.get("/openapi.json", key=""))["paths"]
    for endpoint in found:
        if endpoint.access != "public":
            security = paths[endpoint.path][endpoint.method.lower()].get("security")
            assert security, f"{endpoint} has no security requirement in the schema"


def test_compat_routes_refuse_a_request_without_a_key(api: Api) -> None:
    """The compatible APIs authenticate in their handlers: none answers 2xx to a keyless request."""
    compat = [e for e in endpoints(api) if e.path.startswith(COMPAT_PREFIXES)]
    assert len(compat) >= 12, compat
    for endpoint in compat:
        url = re.sub(r"\{(\w+)\}", "x", endpoint.path)
        files = api.files("file", "obama.jpg") + api.files("image", "obama.jpg")
        kwargs: dict[str, Any] = {} if endpoint.method in ("GET", "DELETE") else {"files": files}
        response = api.request(endpoint.method, url, "", **kwargs)  # "": no key at all
        assert 400 <= response.status_code < 500, f"{endpoint}: {response.status_code} {response.text[:300]}"
        assert response.status_code != 422 or endpoint.path.startswith("/v1/vision/"), endpoint


def test_every_route_needs_a_valid_key(two_collections: Api) -> None:
    api = two_collections
    wrong = [
        {},  # no key
        {"X-API-Key": ""},
        {"X-API-Key": api.admin_key[:-1]},
        {"X-API-Key": api.admin_key + "x"},
        {"X-API-Key": "frk_0123abcd_" + "A" * 43},
        {"Authorization": f"Bearer {api.admin_key[::-1]}"},
        {"Authorization": "Bearer "},
        {"Authorization": f"Basic {api.admin_key}"},
    ]
    checked = 0
    for endpoint in endpoints(api):
        if endpoint.access == "public":
            continue
        for headers in wrong:
            response = api.client.request(endpoint.method, endpoint.url(), headers=headers)
            api.error(response, 401, "unauthorized")
            checked += 1
    assert checked >= 17 * len(wrong)
    # Nothing was changed by the refused calls.
    assert [c["name"] for c in api.ok(api.get("/v1/collections"))] == ["alpha", "bravo"]
    assert api.ok(api.get("/v1/collections/alpha/identities/alpha-1"))["name"] == "Alpha One"


def test_public_routes_need_no_key(api: Api) -> None:
    for path in sorted(PUBLIC - {"/docs/oauth2-redirect"}):
        response = api.client.get(path)
        assert response.status_code == 200, f"{path}: {response.status_code} {response.text[:300]}"


def test_collection_keys(two_collections: Api) -> None:
    api = two_collections
    created = api.create_key("alpha", "kiosk-3")
    secret = created["key"]
    assert set(created) == {"id", "prefix", "label", "created_at", "revoked_at", "key"}
    assert secret.startswith(f"frk_{created['prefix']}_") and len(secret) > 40
    assert created["label"] == "kiosk-3" and created["revoked_at"] is None
    listed = api.get("/v1/collections/alpha/keys")
    assert [k["id"] for k in api.ok(listed)] == [created["id"]]
    assert set(listed.json()[0]) == {"id", "prefix", "label", "created_at", "revoked_at"}
    assert secret not in listed.text and secret.split("_", 2)[2] not in listed.text
    assert api.ok(api.get("/v1/collections/bravo/keys")) == []
    api.error(api.post("/v1/collections/nowhere/keys", json={}), 404, "not_found")
    api.error(api.post("/v1/collections/alpha/keys", json={"label": "x" * 129}), 422, "validation_error")

    # Its own collection: every kind of call works, through either header.
    assert api.ok(api.get("/v1/collections/alpha", secret))["name"] == "alpha"
    api.create_identity("alpha", "alpha-2", "Alpha Two", key=secret)
    assert api.ok(api.get("/v1/collections/alpha/identities", secret))["total"] == 2
    assert (
        api.ok(api.patch("/v1/collections/alpha/identities/alpha-2", secret, json={"name": "A2"}))["name"]
        == "A2"
    )
    api.ok(api.enroll("alpha", "alpha-2", "obama.jpg", key=secret), 201)
    assert (
        api.ok(api.identify("alpha", "obama2.jpg", key=secret))["faces"][0]["identity"]["external_id"]
        == "alpha-2"
    )
    assert len(api.ok(api.detect("t1.jpg", key=secret))["faces"]) == 6
    bearer = api.client.get("/v1/collections/alpha", headers={"Authorization": f"Bearer {secret}"})
    assert api.ok(bearer)["name"] == "alpha"
    admin_bearer = api.client.get("/v1/collections", headers={"Authorization": f"Bearer {api.admin_key}"})
    assert len(api.ok(admin_bearer)) == 2

    # Another collection's routes, and every admin route: 403, whatever the method.
    refused = 0
    for endpoint in endpoints(api):
        if endpoint.access == "collection":
            api.error(
                api.request(endpoint.method, endpoint.url("bravo", "bravo-1"), secret), 403, "forbidden"
            )
            refused += 1
        elif endpoint.access == "admin":
            for collection in ("alpha", "bravo"):
                api.error(
                    api.request(endpoint.method, endpoint.url(collection, f"{collection}-1"), secret),
                    403,
                    "forbidden",
                )
                refused += 1
    assert refused >= 12 + 2 * 6
    assert api.ok(api.get("/v1/collections/bravo/identities/bravo-1"))["name"] == "Bravo One"
    assert [c["name"] for c in api.ok(api.get("/v1/collections"))] == ["alpha", "bravo"]

    # Revocation: at once, idempotent, and scoped to the key's collection.
    other = api.create_key("alpha", "spare")["key"]
    api.error(api.delete(f"/v1/collections/bravo/keys/{created['id']}"), 404, "not_found")
    api.error(api.delete("/v1/collections/alpha/keys/987654"), 404, "not_found")
    api.error(api.delete("/v1/collections/alpha/keys/0"), 422, "validation_error")
    assert api.delete(f"/v1/collections/alpha/keys/{created['id']}").status_code == 204
    api.error(api.get("/v1/collections/alpha", secret), 401, "unauthorized")
    api.error(
        api.client.get("/v1/collections/alpha", headers={"Authorization": f"Bearer {secret}"}),
        401,
        "unauthorized",
    )
    assert api.delete(f"/v1/collections/alpha/keys/{created['id']}").status_code == 204
    revoked = {k["id"]: k for k in api.ok(api.get("/v1/collections/alpha/keys"))}[created["id"]]
    assert revoked["revoked_at"] is not None
    assert api.ok(api.get("/v1/collections/alpha", other))["name"] == "alpha"


def test_no_route_leaks_another_collection(two_collections: Api) -> None:
    api = two_collections
    bravo_secrets = ["bravo-1", "Bravo One", "bravo-secret-42", "Joe Bravo-Hidden", "bravo-tag"]
    api.create_identity("bravo", "bravo-secret-42", "Joe Bravo-Hidden", team="bravo-tag")
    bravo_face = api.ok(api.enroll("bravo", "bravo-secret-42", "biden.jpg"), 201)["faces"][0]
    api.ok(api.enroll("bravo", "bravo-1", "obama3.jpg"), 201)

    alpha_face = api.ok(api.enroll("alpha", "alpha-1", "obama.jpg"), 201)["faces"][0]
    api.create_identity("alpha", "alpha-victim", "Victim")
    victim_face = api.ok(api.enroll("alpha", "alpha-victim", "t1.jpg", data={"face": "largest"}), 201)[
        "faces"
    ][0]
    key = api.create_key("alpha")["key"]

    image = {"files": api.files("image", "biden.jpg")}
    pair = {"files": api.files("image_a", "biden.jpg") + api.files("image_b", "obama3.jpg")}
    calls: dict[tuple[str, str], list[tuple[str, dict[str, Any], int]]] = {
        ("GET", "/v1/collections/{collection}"): [("/v1/collections/alpha", {}, 200)],
        ("GET", "/v1/collections/{collection}/index"): [("/v1/collections/alpha/index", {}, 200)],
        ("GET", "/v1/collections/{collection}/identities"): [
            ("/v1/collections/alpha/identities", {}, 200),
            ("/v1/collections/alpha/identities", {"params": {"name": "bravo"}}, 200),
            ("/v1/collections/alpha/identities", {"params": {"name": "o", "limit": 500}}, 200),
        ],
        ("POST", "/v1/collections/{collection}/identities"): [
            ("/v1/collections/alpha/identities", {"json": {"external_id": "alpha-new"}}, 201),
            ("/v1/collections/alpha/identities", {"json": {"external_id": "alpha-1"}}, 409),
        ],
        ("GET", "/v1/collections/{collection}/identities/{external_id}"): [
            ("/v1/collections/alpha/identities/alpha-1", {}, 200)
        ],
        ("PATCH", "/v1/collections/{collection}/identities/{external_id}"): [
            ("/v1/collections/alpha/identities/alpha-1", {"json": {"name": "Alpha Uno"}}, 200)
        ],
        ("GET", "/v1/collections/{collection}/identities/{external_id}/faces"): [
            ("/v1/collections/alpha/identities/alpha-1/faces", {}, 200)
        ],
        ("POST", "/v1/collections/{collection}/identities/{external_id}/faces"): [
            (
                "/v1/collections/alpha/identities/alpha-1/faces",
                {"files": api.files("images", "obama2.jpg")},
                201,
            )
        ],
        ("POST", "/v1/collections/{collection}/identify"): [
            ("/v1/collections/alpha/identify", {**image, "params": {"k": 100, "threshold": -1}}, 200)
        ],
        ("POST", "/v1/collections/{collection}/identify/batch"): [
            (
                "/v1/collections/alpha/identify/batch",
                {"files": api.files("images", "biden.jpg", "obama3.jpg"), "params": {"k": 100}},
                200,
            )
        ],
        ("POST", "/v1/collections/{collection}/identities/{external_id}/verify"): [
            ("/v1/collections/alpha/identities/alpha-1/verify", image, 200)
        ],
        ("DELETE", "/v1/collections/{collection}/faces/{face_id}"): [
            (f"/v1/collections/alpha/faces/{bravo_face['id']}", {}, 404),  # bravo's face through alpha's path
            (f"/v1/collections/alpha/faces/{victim_face['id']}", {}, 204),
        ],
        ("DELETE", "/v1/collections/{collection}/identities/{external_id}"): [
            ("/v1/collections/alpha/identities/alpha-victim", {}, 204)
        ],
        ("POST", "/v1/detect"): [("/v1/detect", image, 200)],
        ("POST", "/v1/verify"): [("/v1/verify", pair, 200)],
        ("POST", "/v1/collections/{collection}/faces/{face_id}/search"): [
            (f"/v1/collections/alpha/faces/{alpha_face['id']}/search",
             {"params": {"k": 100, "threshold": -1}}, 200),
            (f"/v1/collections/alpha/faces/{bravo_face['id']}/search", {}, 404),  # bravo's face via alpha
        ],
    }
    reachable = {(e.method, e.path) for e in endpoints(api) if e.access in {"collection", "any"}}
    assert set(calls) == reachable, "every route a collection key reaches must be probed here"

    for (method, _), requests in calls.items():
        for url, kwargs, status in requests:
            response = api.request(method, url, key, **kwargs)
            assert response.status_code == status, (
                f"{method} {url}: {response.status_code} {response.text[:500]}"
            )
            leaked = [s for s in bravo_secrets if s.lower() in response.text.lower()]
            assert not leaked, f"{method} {url} shows bravo's {leaked}: {response.text[:500]}"

    # What alpha's identify sees is alpha's gallery only, even with k=100 and threshold=-1.
    seen = api.ok(api.identify("alpha", "biden.jpg", key=key, params={"k": 100, "threshold": -1}))
    assert {c["external_id"] for f in seen["faces"] for c in f["candidates"]} == {"alpha-1"}
    assert api.ok(api.get("/v1/collections/alpha", key))["faces"] == 2  # alpha-1's two faces
    # Bravo's face survived the attempt to delete it through alpha's path.
    bravo = api.ok(api.get("/v1/collections/bravo/identities/bravo-secret-42/faces"))
    assert [f["id"] for f in bravo] == [bravo_face["id"]]
    assert alpha_face["id"] in {
        f["id"] for f in api.ok(api.get("/v1/collections/alpha/identities/alpha-1/faces"))
    }
    # Bravo's identities cannot be addressed through alpha's paths either.
    for response in (
        api.get("/v1/collections/alpha/identities/bravo-secret-42", key),
        api.get("/v1/collections/alpha/identities/bravo-secret-42/faces", key),
        api.patch("/v1/collections/alpha/identities/bravo-secret-42", key, json={"name": "x"}),
        api.delete("/v1/collections/alpha/identities/bravo-secret-42", key),
        api.enroll("alpha", "bravo-secret-42", "obama.jpg", key=key),
    ):
        api.error(response, 404, "not_found")
    assert api.ok(api.get("/v1/collections/bravo/identities/bravo-secret-42"))["name"] == "Joe Bravo-Hidden"
