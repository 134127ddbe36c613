"""The DeepStack API's edges (service/routers/deepstack.py) against the real gateway, Triton and database:
nothing is vetted and no in-flight slot taken before the key is checked, text fields sent as files, JSON
bodies on every route, the register limit, and Retry-After on its 503s."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import requests

from facecore.client import PipelineError
from facecore.settings import GatewaySettings
from service.app import create_app
from service.routers.deepstack import _render

if TYPE_CHECKING:
    from tests.service.live_fixtures import Live, StartLive

pytest_plugins = ["tests.service.live_fixtures"]

NOT_AN_IMAGE = b"not an image"
UNAVAILABLE = "StatusCode.UNAVAILABLE"


@pytest.fixture
def live(live_api: StartLive) -> Live:
    return live_api(deepstack={"collection": "home"})


@pytest.fixture
def key(live: Live) -> str:
    return live.collection_with_key("home")


@pytest.fixture
def image(photos: dict[str, Path]) -> bytes:
    return photos["obama.jpg"].read_bytes()


def post(live: Live, route: str, **kwargs: Any) -> requests.Response:
    return requests.post(f"{live.base}/v1/vision/{route}", timeout=60, **kwargs)


def failed(response: requests.Response, status: int, *words: str) -> str:
    """The error of a DeepStack error answer that must have ``status`` and name each of ``words``."""
    assert response.status_code == status, response.text
    body = response.json()
    assert body["success"] is False and body["code"] == status, body
    assert all(word in body["error"] for word in words), body
    return str(body["error"])


def listed(live: Live, key: str) -> list[str]:
    answer = post(live, "face/list", data={"api_key": key})
    assert answer.status_code == 200, answer.text
    return list(answer.json()["faces"])


@pytest.mark.triton
def test_the_api_off_answers_before_the_body_is_read(live_api: StartLive) -> None:
    off = live_api()
    bodies: list[tuple[str, dict[str, Any]]] = [
        ("face/recognize", {"files": {"image": NOT_AN_IMAGE}}),
        ("face/register", {"data": b"{", "headers": {"content-type": "application/json"}}),
        ("face/delete", {"data": b"{", "headers": {"content-type": "application/json"}}),
    ]
    for route, body in bodies:
        failed(post(off, route, **body), 404, "FACEREC_DEEPSTACK__COLLECTION")


@pytest.mark.triton
def test_the_key_is_checked_before_any_image_is_vetted(live: Live, key: str) -> None:
    other = live.collection_with_key("other")
    for route in ("face", "face/recognize", "face/register"):
        failed(post(live, route, files={"image": NOT_AN_IMAGE}), 401, "api_key")
        failed(post(live, route, data={"api_key": "frk_not_a_key"}, files={"image": NOT_AN_IMAGE}), 401)
        failed(post(live, route, data={"api_key": other}, files={"image": NOT_AN_IMAGE}), 403)
        failed(post(live, route, data={"api_key": key, "userid": "x"}, files={"image": NOT_AN_IMAGE}), 415)
    pair = {"image1": NOT_AN_IMAGE, "image2": NOT_AN_IMAGE}
    failed(post(live, "face/match", files=pair), 401)
    failed(post(live, "face/match", data={"api_key": key}, files=pair), 415, "image1")


@pytest.mark.triton
def test_a_slot_is_taken_after_the_key_and_the_images(live: Live, key: str, photos: dict[str, Path],
                                                        image: bytes) -> None:
    """With the gateway full, a call without a key is a 401 and a bad image a 415 (neither waits for or
    holds a slot); a good call is the 503 overloaded, with Retry-After: 1 as on the v1 API."""
    admission = live.app.state.admission
    good: dict[str, dict[str, dict[str, Any]]] = {
        "face": {"files": {"image": image}},
        "face/recognize": {"files": {"image": image}},
        "face/register": {"files": {"image": image}, "data": {"userid": "obama"}},
        "face/match": {"files": {"image1": image, "image2": photos["obama3.jpg"].read_bytes()}},
    }
    admission.in_flight = admission.limit
    try:
        for route, body in good.items():
            failed(post(live, route, **body), 401)
            data = {"api_key": key, **body.get("data", {})}
            failed(post(live, route, data=data, files=dict.fromkeys(body["files"], NOT_AN_IMAGE)), 415)
            overloaded = post(live, route, files=body["files"], data=data)
            failed(overloaded, 503, "overloaded")
            assert overloaded.headers["retry-after"] == "1"
    finally:
        admission.in_flight = 0
    assert admission.refused == len(good)
    for route, body in good.items():
        answer = post(live, route, files=body["files"], data={"api_key": key, **body.get("data", {})})
        assert answer.status_code == 200 and answer.json()["success"] is True, (route, answer.text)
    assert admission.in_flight == 0


def test_retry_after_on_503_is_the_v1_apis() -> None:
    """1 s when Triton's queue is full (load shed), 5 s when it is down: the values the v1 API sends."""
    full = _render(PipelineError("[StatusCode.UNAVAILABLE] Exceeds maximum queue size", UNAVAILABLE))
    down = _render(PipelineError("failed to connect to all addresses", UNAVAILABLE))
    assert full is not None and full.status_code == 503 and full.headers["retry-after"] == "1"
    assert down is not None and down.status_code == 503 and down.headers["retry-after"] == "5"


@pytest.mark.triton
def test_a_text_field_sent_as_a_file_is_a_400(live: Live, key: str, image: bytes) -> None:
    def as_file(value: str) -> tuple[str, bytes]:
        return ("field.txt", value.encode())

    keyed = {"api_key": key}
    failed(post(live, "face/recognize", files={"image": image, "api_key": as_file(key)}), 400, "api_key",
           "file")
    failed(post(live, "face/list", files={"api_key": as_file(key)}), 400, "api_key", "file")
    failed(post(live, "face/register", data=keyed, files={"image": image, "userid": as_file("bob")}), 400,
           "userid", "file")
    failed(post(live, "face/delete", data=keyed, files={"userid": as_file("bob")}), 400, "userid", "file")
    failed(post(live, "face", data=keyed, files={"image": image, "min_confidence": as_file("0.5")}), 400,
           "min_confidence", "file")
    assert listed(live, key) == []
    # any other file field is an image, as DeepStack registers every file of the form: none is dropped
    answer = post(live, "face/register", data={"api_key": key, "userid": "bob"},
                  files={"image": image, "image17": image})
    assert answer.status_code == 200 and listed(live, key) == ["bob"], answer.text
    assert len(live.admin("GET", "/v1/collections/home/identities/bob/faces")) == 2


def b64(photos: dict[str, Path], name: str) -> str:
    return base64.b64encode(photos[name].read_bytes()).decode()


@pytest.mark.triton
def test_json_bodies(live: Live, key: str, photos: dict[str, Path]) -> None:
    pair = {"api_key": key, "image1": b64(photos, "obama.jpg"), "image2": b64(photos, "obama3.jpg")}
    matched = post(live, "face/match", json=pair)
    assert matched.status_code == 200 and matched.json()["similarity"] > 0.9, matched.text
    three = {"image": b64(photos, "obama.jpg"), "image1": b64(photos, "obama2.jpg"),
             "image2": b64(photos, "obama3.jpg")}
    registered = post(live, "face/register", json={"api_key": key, "userid": "obama", **three})
    assert registered.status_code == 200 and registered.json()["message"] == "face added", registered.text
    assert len(live.admin("GET", "/v1/collections/home/identities/obama/faces")) == 3
    listing = post(live, "face/list", json={"api_key": key})
    assert listing.status_code == 200 and listing.json()["faces"] == ["obama"], listing.text
    assert post(live, "face/delete", json={"api_key": key, "userid": "obama"}).status_code == 200
    assert listed(live, key) == []
    # a field the route does not take is refused, not ignored
    failed(post(live, "face/register", json={"api_key": key, "userid": "x", "image17": three["image"]}), 422,
           "image17")
    failed(post(live, "face/list", json={"api_key": key, "user": "x"}), 422, "user")
    failed(post(live, "face/list", data=b"{", headers={"content-type": "application/json"}), 400, "JSON")


def test_the_openapi_json_bodies_name_every_field_and_no_other() -> None:
    paths = create_app(GatewaySettings(security={"admin_key": "s" * 32})).openapi()["paths"]

    def body(route: str) -> dict[str, Any]:
        schema: dict[str, Any] = paths[f"/v1/vision/{route}"]["post"]["requestBody"]["content"][
            "application/json"]["schema"]
        assert schema["additionalProperties"] is False, route
        return schema

    assert set(body("face/register")["properties"]) == {"api_key", "userid", "min_confidence", "image",
                                                        *(f"image{i}" for i in range(1, 17))}
    assert set(body("face/match")["properties"]) == {"api_key", "image1", "image2"}
    assert set(body("face/recognize")["properties"]) == {"api_key", "min_confidence", "image"}
    assert set(body("face/list")["properties"]) == {"api_key"}
    assert set(body("face/delete")["properties"]) == {"api_key", "userid"}
    # a form needs one image field, whichever (deepstack-python sends only `image`); match needs both
    def form(route: str) -> dict[str, Any]:
        schema: dict[str, Any] = paths[f"/v1/vision/{route}"]["post"]["requestBody"]["content"][
            "multipart/form-data"]["schema"]
        return schema

    assert form("face/register")["required"] == []
    assert form("face/match")["required"] == ["image1", "image2"]


@pytest.mark.triton
def test_register_takes_at_most_max_batch_images_from_its_fields(live_api: StartLive,
                                                                  photos: dict[str, Path]) -> None:
    """Any of image, image1 ... image16, up to FACEREC_LIMITS__MAX_BATCH_IMAGES images (default 16)."""
    live = live_api(deepstack={"collection": "home"})
    key = live.collection_with_key("home")
    seventeen = {f"image{i}" if i else "image": NOT_AN_IMAGE for i in range(17)}
    failed(post(live, "face/register", data={"api_key": key, "userid": "x"}, files=seventeen), 413,
           "at most 16", "too_many_images")
    two = live_api(deepstack={"collection": "home"}, limits={"max_batch_images": 2})
    key = two.collection_with_key("home")
    images = {"image": photos["obama.jpg"].read_bytes(), "image16": photos["obama3.jpg"].read_bytes()}
    answer = post(two, "face/register", data={"api_key": key, "userid": "obama"}, files=images)
    assert answer.status_code == 200, answer.text
    failed(post(two, "face/register", data={"api_key": key, "userid": "x"},
                files={**images, "image5": images["image"]}), 413, "at most 2")
