"""The REST API end to end on the real stack: real Triton (face_pipeline), a real database, real FAISS.

The main flows run on SQLite and on PostgreSQL (``db_url`` is parametrized); the image-centric cases
(group photos, quality gate, detection, verification) run on SQLite.
"""

from __future__ import annotations

import base64
import time
from typing import TYPE_CHECKING, Any

import cv2
import numpy as np
import pytest

if TYPE_CHECKING:
    from tests.service.fixtures import Api, StartApi

pytest_plugins = ["tests.service.fixtures"]

pytestmark = pytest.mark.triton

QUALITY_KEYS = {"face_size", "blur", "yaw", "pitch", "roll", "detection_score"}


@pytest.fixture
def engine_api(start_api: StartApi, db_url: str) -> Api:
    """An app on an empty SQLite or PostgreSQL database."""
    return start_api(db_url=db_url)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def blurred(data: bytes, sigma: float = 8.0) -> bytes:
    image = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    ok, encoded = cv2.imencode(".jpg", cv2.GaussianBlur(image, (0, 0), sigma))
    assert ok
    return encoded.tobytes()


def box_list(box: dict[str, float]) -> list[float]:
    return [box["x1"], box["y1"], box["x2"], box["y2"]]


def area(box: list[float]) -> float:
    return (box[2] - box[0]) * (box[3] - box[1])


def only_face(identified: dict[str, Any]) -> dict[str, Any]:
    assert len(identified["faces"]) == 1, identified
    face: dict[str, Any] = identified["faces"][0]
    return face


def gallery_size(api: Api, collection: str) -> int:
    size: int = api.ok(api.get(f"/v1/collections/{collection}"))["faces"]
    return size


# --- the main flow --------------------------------------------------------------------------------


def test_enroll_identify_then_erase(engine_api: Api) -> None:
    api = engine_api
    collection = api.create_collection("people")
    assert collection["name"] == "people" and collection["faces"] == 0
    assert collection["dimension"] == 128 and collection["embedding_model"]
    threshold = collection["match_threshold"]
    assert 0 < threshold < 0.7

    identity = api.create_identity("people", "obama", "Barack Obama", party="D")
    assert identity["external_id"] == "obama" and identity["metadata"] == {"party": "D"}

    enrolled = api.ok(api.enroll("people", "obama", "obama.jpg"), 201)
    assert enrolled["identity"]["external_id"] == "obama" and enrolled["identity"]["name"] == "Barack Obama"
    (face,) = enrolled["faces"]
    assert face["id"] >= 1 and face["has_crop"] and len(face["image_sha256"]) == 64
    assert set(face["quality"]) == QUALITY_KEYS and face["detection_score"] > 0.9
    assert gallery_size(api, "people") == 1

    found = api.ok(api.identify("people", "obama2.jpg"))
    decided = api.ok(api.get("/v1/collections/people"))  # the default policy: a target FPIR at its size
    assert decided["match_policy"] == {"fpir": 0.01, "threshold": None} and found["match_policy"] == "fpir"
    assert found["threshold"] == pytest.approx(decided["decision"]["threshold"], abs=1e-6)
    assert found["threshold"] >= threshold
    match = only_face(found)
    assert match["decision"] == "match"
    assert match["identity"]["external_id"] == "obama" and match["identity"]["name"] == "Barack Obama"
    assert match["identity"]["score"] >= 0.7 and match["identity"]["confidence"] > 0.5
    assert match["candidates"][0] == match["identity"]
    assert len(match["landmarks"]) == 5

    stranger = only_face(api.ok(api.identify("people", "biden.jpg")))
    assert stranger["decision"] == "unknown" and stranger["identity"] is None
    assert all(c["score"] < threshold and c["confidence"] < 0.5 for c in stranger["candidates"])

    assert api.delete("/v1/collections/people/identities/obama").status_code == 204
    api.error(api.get("/v1/collections/people/identities/obama"), 404, "not_found")
    assert gallery_size(api, "people") == 0
    gone = only_face(api.ok(api.identify("people", "obama2.jpg")))
    assert gone["decision"] == "unknown" and gone["identity"] is None and gone["candidates"] == []


def test_enroll_base64_json_and_create(engine_api: Api) -> None:
    api = engine_api
    api.create_collection("json")
    url = "/v1/collections/json/identities/potus-44/faces"
    # The identity does not exist: 404 without create=true, and nothing is stored.
    api.error(api.post(url, json={"images": [b64(api.photos["obama.jpg"])]}), 404, "not_found")

    created = api.ok(
        api.post(
            url,
            params={"create": "true", "name": "Barack Obama"},
            json={"images": [b64(api.photos["obama.jpg"])]},
        ),
        201,
    )
    assert created["identity"] == api.ok(api.get("/v1/collections/json/identities/potus-44"))
    assert created["identity"]["name"] == "Barack Obama" and len(created["faces"]) == 1

    data_uri = "data:image/jpeg;base64," + b64(api.photos["obama3.jpg"])
    again = api.ok(api.post(url, json={"images": [data_uri], "face": "only"}), 201)
    assert again["identity"]["external_id"] == "potus-44" and len(again["faces"]) == 1
    assert again["faces"][0]["image_sha256"] != created["faces"][0]["image_sha256"]
    assert len(api.ok(api.get(f"{url}"))) == 2
    assert gallery_size(api, "json") == 2

    match = only_face(
        api.ok(api.post("/v1/collections/json/identify", json={"image": b64(api.photos["obama2.jpg"])}))
    )
    assert match["decision"] == "match" and match["identity"]["external_id"] == "potus-44"


# --- choosing the face, the quality gate, all-or-nothing ------------------------------------------


def test_group_photo_needs_a_choice(api: Api) -> None:
    api.create_collection("group")
    details = api.error(
        api.enroll("group", "someone", "t1.jpg", params={"create": "true"}), 422, "several_faces"
    )
    boxes = details["boxes"]
    assert details["image"] == 0 and len(boxes) == 6 and all(len(b) == 4 for b in boxes)
    # Refused before anything was written: create=true did not create the identity.
    api.error(api.get("/v1/collections/group/identities/someone"), 404, "not_found")

    largest = api.ok(
        api.enroll("group", "largest", "t1.jpg", params={"create": "true"}, data={"face": "largest"}), 201
    )
    biggest = max(boxes, key=area)
    assert box_list(largest["faces"][0]["box"]) == pytest.approx(biggest, abs=1.0)

    chosen = next(b for b in boxes if b is not biggest)
    picked = api.ok(
        api.enroll(
            "group",
            "picked",
            "t1.jpg",
            params={"create": "true"},
            data={"box": ",".join(f"{v:.1f}" for v in chosen)},
        ),
        201,
    )
    assert box_list(picked["faces"][0]["box"]) == pytest.approx(chosen, abs=1.0)

    nothing = api.error(
        api.enroll("group", "picked", "t1.jpg", data={"box": "0,0,20,20"}), 422, "no_face_in_box"
    )
    assert len(nothing["boxes"]) == 6
    assert len(api.ok(api.get("/v1/collections/group/identities/picked/faces"))) == 1
    assert gallery_size(api, "group") == 2

    # Malformed choices are refused before any inference.
    api.error(api.enroll("group", "picked", "t1.jpg", data={"face": "biggest"}), 422, "validation_error")
    api.error(api.enroll("group", "picked", "t1.jpg", data={"box": "1,2,3"}), 422, "validation_error")
    api.error(api.enroll("group", "picked", "t1.jpg", data={"box": "10,10,5,5"}), 422, "validation_error")


def test_enroll_refuses_no_face_and_low_quality(api: Api) -> None:
    api.create_collection("gate")
    api.create_identity("gate", "obama")
    details = api.error(api.enroll("gate", "obama", "coffee.png"), 422, "no_face")
    assert details["image"] == 0

    details = api.error(api.enroll("gate", "obama", blurred(api.photos["obama.jpg"])), 422, "low_quality")
    assert "too_blurry" in details["reasons"]
    assert details["quality"]["blur"] < api.settings.quality.min_blur

    # All or nothing: a good image with a bad one stores neither.
    details = api.error(api.enroll("gate", "obama", "obama.jpg", "coffee.png"), 422, "no_face")
    assert details["image"] == 1
    details = api.error(
        api.enroll("gate", "obama", blurred(api.photos["obama2.jpg"]), "obama.jpg"), 422, "low_quality"
    )
    assert details["image"] == 0
    assert api.ok(api.get("/v1/collections/gate/identities/obama/faces")) == []
    assert gallery_size(api, "gate") == 0


# --- identities and faces ---------------------------------------------------------------------------


def test_identities_crud_and_pagination(engine_api: Api) -> None:
    api = engine_api
    api.create_collection("staff")
    names = [f"Person {i}" for i in range(7)] + ["Ada Lovelace", "ada byron", "100% sure"]
    for i, name in enumerate(names):
        api.create_identity("staff", f"emp-{i:03d}", name, rank=i)
    everyone = api.ok(api.get("/v1/collections/staff/identities", params={"limit": 500}))
    assert everyone["total"] == len(names) and [i["name"] for i in everyone["items"]] == names

    pages = []
    for offset in range(0, 12, 4):
        page = api.ok(api.get("/v1/collections/staff/identities", params={"offset": offset, "limit": 4}))
        assert page["total"] == len(names) and page["offset"] == offset and page["limit"] == 4
        pages += page["items"]
    assert pages == everyone["items"]
    beyond = api.ok(api.get("/v1/collections/staff/identities", params={"offset": 50}))
    assert beyond["items"] == [] and beyond["total"] == len(names)

    ada = api.ok(api.get("/v1/collections/staff/identities", params={"name": "ADA"}))
    assert ada["total"] == 2 and {i["name"] for i in ada["items"]} == {"Ada Lovelace", "ada byron"}
    percent = api.ok(api.get("/v1/collections/staff/identities", params={"name": "%"}))
    assert [i["name"] for i in percent["items"]] == ["100% sure"]  # LIKE wildcards are literal
    for bad in ({"limit": 0}, {"limit": 501}, {"offset": -1}):
        api.error(api.get("/v1/collections/staff/identities", params=bad), 422, "validation_error")

    one = api.ok(api.get("/v1/collections/staff/identities/emp-007"))
    assert one["name"] == "Ada Lovelace" and one["metadata"] == {"rank": 7}
    renamed = api.ok(api.patch("/v1/collections/staff/identities/emp-007", json={"name": "Augusta Ada King"}))
    assert renamed["name"] == "Augusta Ada King" and renamed["metadata"] == {"rank": 7}
    retagged = api.ok(
        api.patch(
            "/v1/collections/staff/identities/emp-007",
            json={"metadata": {"team": "engines", "tags": ["a", 1]}},
        )
    )
    assert retagged["name"] == "Augusta Ada King" and retagged["metadata"] == {
        "team": "engines",
        "tags": ["a", 1],
    }
    assert api.ok(api.get("/v1/collections/staff/identities/emp-007")) == retagged

    conflict = api.post("/v1/collections/staff/identities", json={"external_id": "emp-007", "name": "again"})
    api.error(conflict, 409, "conflict")
    api.error(
        api.post("/v1/collections/staff/identities", json={"external_id": "a/b"}), 422, "validation_error"
    )
    api.error(api.post("/v1/collections/staff/identities", json={"name": "x"}), 422, "validation_error")

    assert api.delete("/v1/collections/staff/identities/emp-007").status_code == 204
    for response in (
        api.get("/v1/collections/staff/identities/emp-007"),
        api.patch("/v1/collections/staff/identities/emp-007", json={"name": "x"}),
        api.delete("/v1/collections/staff/identities/emp-007"),
        api.get("/v1/collections/staff/identities/emp-007/faces"),
        api.get("/v1/collections/nowhere/identities"),
        api.get("/v1/collections/nowhere/identities/emp-001"),
        api.post("/v1/collections/nowhere/identities", json={"external_id": "x"}),
    ):
        api.error(response, 404, "not_found")
    assert api.ok(api.get("/v1/collections/staff/identities"))["total"] == len(names) - 1


def test_faces_list_and_delete(engine_api: Api) -> None:
    api = engine_api
    api.create_collection("faces")
    enrolled = api.ok(api.enroll("faces", "obama", "obama.jpg", "obama3.jpg", params={"create": "true"}), 201)
    assert len(enrolled["faces"]) == 2
    listed = api.ok(api.get("/v1/collections/faces/identities/obama/faces"))
    assert [f["id"] for f in listed] == [f["id"] for f in enrolled["faces"]]
    assert all(f["has_crop"] and set(f["quality"]) == QUALITY_KEYS for f in listed)
    assert gallery_size(api, "faces") == 2

    first = listed[0]["id"]
    assert api.delete(f"/v1/collections/faces/faces/{first}").status_code == 204
    assert [f["id"] for f in api.ok(api.get("/v1/collections/faces/identities/obama/faces"))] == [
        listed[1]["id"]
    ]
    assert gallery_size(api, "faces") == 1
    api.error(api.delete(f"/v1/collections/faces/faces/{first}"), 404, "not_found")
    api.error(api.delete("/v1/collections/faces/faces/987654321"), 404, "not_found")
    api.error(api.delete(f"/v1/collections/nowhere/faces/{listed[1]['id']}"), 404, "not_found")
    api.error(api.delete("/v1/collections/faces/faces/0"), 422, "validation_error")
    api.error(api.delete("/v1/collections/faces/faces/abc"), 422, "validation_error")
    # The identity keeps matching with its remaining face.
    assert only_face(api.ok(api.identify("faces", "obama2.jpg")))["decision"] == "match"


# --- detect, verify, identify options ------------------------------------------------------------


def test_detect(api: Api) -> None:
    found = api.ok(api.detect("t1.jpg"))
    assert (found["width"], found["height"]) == (1280, 886)
    assert len(found["faces"]) == 6
    for face in found["faces"]:
        box = face["box"]
        assert 0 <= box["x1"] < box["x2"] <= 1280 and 0 <= box["y1"] < box["y2"] <= 886
        assert len(face["landmarks"]) == 5 and 0.5 < face["score"] <= 1
        assert all(
            box["x1"] <= p["x"] <= box["x2"] and box["y1"] <= p["y"] <= box["y2"] for p in face["landmarks"]
        )
        assert set(face["quality"]) == QUALITY_KEYS and face["quality"]["face_size"] > 40
    assert api.ok(api.detect("coffee.png"))["faces"] == []
    json_found = api.ok(api.post("/v1/detect", json={"image": b64(api.photos["obama.jpg"])}))
    assert len(json_found["faces"]) == 1


def test_verify_images(api: Api) -> None:
    def verify(a: str, b: str) -> dict[str, Any]:
        body: dict[str, Any] = api.ok(
            api.post("/v1/verify", files=api.files("image_a", a) + api.files("image_b", b))
        )
        return body

    same = verify("obama.jpg", "obama3.jpg")
    assert same["same"] is True and same["score"] >= same["threshold"] and same["confidence"] > 0.5
    assert same["face_a"]["quality"] and same["face_b"]["quality"]
    different = verify("obama.jpg", "biden.jpg")
    assert different["same"] is False and different["score"] < different["threshold"]
    assert different["confidence"] < 0.5
    only_one = api.post("/v1/verify", files=api.files("image_a", "obama.jpg"))
    api.error(only_one, 400, "missing_image")
    twice = api.post("/v1/verify", files=api.files("image_a", "obama.jpg", "biden.jpg"))
    api.error(twice, 400, "missing_image")


def test_verify_pairs_images_by_field_not_by_part_order(api: Api) -> None:
    a, b = api.files("image_a", "obama.jpg"), api.files("image_b", "t1.jpg")
    in_order, reversed_parts = (api.ok(api.post("/v1/verify", files=parts)) for parts in (a + b, b + a))
    assert reversed_parts["face_a"] == in_order["face_a"] and reversed_parts["face_b"] == in_order["face_b"]
    assert in_order["face_a"]["box"] != in_order["face_b"]["box"]


def test_verify_against_identity(api: Api) -> None:
    api.create_collection("verify")
    api.ok(api.enroll("verify", "obama", "obama.jpg", params={"create": "true"}), 201)
    url = "/v1/collections/verify/identities/obama/verify"
    same = api.ok(api.post(url, files=api.files("image", "obama2.jpg")))
    assert same["same"] is True and same["confidence"] > 0.5 and same["face_b"] is None
    other = api.ok(api.post(url, files=api.files("image", "biden.jpg")))
    assert other["same"] is False and other["confidence"] < 0.5
    strict = api.ok(api.post(url, files=api.files("image", "obama2.jpg"), params={"threshold": 0.99}))
    assert strict["same"] is False and strict["threshold"] == 0.99

    api.error(
        api.post("/v1/collections/verify/identities/nobody/verify", files=api.files("image", "obama2.jpg")),
        404,
        "not_found",
    )
    api.create_identity("verify", "empty")
    api.error(
        api.post("/v1/collections/verify/identities/empty/verify", files=api.files("image", "obama2.jpg")),
        422,
        "no_enrolled_face",
    )


def test_identify_batch_and_options(api: Api) -> None:
    api.create_collection("batch")
    api.ok(api.enroll("batch", "obama", "obama.jpg", params={"create": "true", "name": "Obama"}), 201)
    api.ok(api.enroll("batch", "biden", "biden.jpg", params={"create": "true", "name": "Biden"}), 201)

    images = api.files("images", "obama2.jpg", b"this is not an image at all", "coffee.png")
    results = api.ok(api.post("/v1/collections/batch/identify/batch", files=images))["results"]
    assert [r["index"] for r in results] == [0, 1, 2]
    assert results[0]["error"] is None
    assert only_face(results[0]["result"])["identity"]["external_id"] == "obama"
    assert results[1]["result"] is None and set(results[1]["error"]) == {"code", "message", "details"}
    assert results[1]["error"]["code"] in {"invalid_image", "unsupported_media_type"}
    assert results[2]["error"] is None and results[2]["result"]["faces"] == []

    default = only_face(api.ok(api.identify("batch", "obama2.jpg")))
    assert default["decision"] == "match" and [c["external_id"] for c in default["candidates"]] == [
        "obama",
        "biden",
    ]
    strict = api.ok(api.identify("batch", "obama2.jpg", params={"k": 1, "threshold": 0.99}))
    assert strict["threshold"] == 0.99
    face = only_face(strict)
    assert face["decision"] == "unknown" and face["identity"] is None
    assert [c["external_id"] for c in face["candidates"]] == ["obama"]
    assert face["candidates"][0]["score"] == default["candidates"][0]["score"]
    # the confidence is the score's meaning for this collection, whatever threshold a request decides at
    assert face["candidates"][0]["confidence"] == default["candidates"][0]["confidence"]

    json_batch = api.post(
        "/v1/collections/batch/identify/batch",
        params={"k": 1},
        json={"images": [b64(api.photos["biden.jpg"]), "!!!not base64!!!"]},
    )
    api.error(json_batch, 400, "invalid_base64")  # the JSON body itself is malformed: the whole request fails


def test_collection_threshold_is_the_default(api: Api) -> None:
    api.create_collection("strict", match_threshold=0.9, keep_crops=False)
    enrolled = api.ok(api.enroll("strict", "obama", "obama.jpg", params={"create": "true"}), 201)
    assert enrolled["faces"][0]["has_crop"] is False
    found = api.ok(api.identify("strict", "obama2.jpg"))
    assert found["threshold"] == 0.9 and only_face(found)["decision"] == "unknown"


# --- collections ---------------------------------------------------------------------------------


def test_collections_lifecycle(engine_api: Api) -> None:
    api = engine_api
    first = api.create_collection("first")
    second = api.create_collection("second", match_threshold=0.5)
    listed = api.ok(api.get("/v1/collections"))
    assert [c["name"] for c in listed] == ["first", "second"]
    assert listed[1]["match_threshold"] == 0.5 and api.ok(api.get("/v1/collections/first")) == first
    assert second["keep_crops"] is True
    api.error(api.post("/v1/collections", json={"name": "first"}), 409, "conflict")
    for bad in ({"name": "bad name!"}, {"name": ""}, {"name": "x", "match_threshold": 1.5}, {}):
        api.error(api.post("/v1/collections", json=bad), 422, "validation_error")
    api.error(api.get("/v1/collections/nowhere"), 404, "not_found")
    api.error(api.delete("/v1/collections/nowhere"), 404, "not_found")

    key = api.create_key("first")["key"]
    api.create_identity("first", "someone", "Some One")
    api.ok(api.enroll("first", "obama", "obama.jpg", params={"create": "true"}), 201)
    assert api.ok(api.get("/v1/collections/first", key))["faces"] == 1
    index = api.ok(api.get("/v1/collections/first/index", key))
    assert (index["engine"], index["kind"], index["faces"]) == ("faiss", "flat", 1)  # SQLite or PostgreSQL
    assert (index["search_effort"], index["chosen_at_faces"], index["measured"]) == (None, None, None)
    assert index["reselecting"] is False
    api.error(api.get("/v1/collections/nowhere/index"), 404, "not_found")

    assert api.delete("/v1/collections/first").status_code == 204
    api.error(api.get("/v1/collections/first"), 404, "not_found")
    api.error(api.get("/v1/collections/first/identities"), 404, "not_found")
    api.error(api.get("/v1/collections/first/keys"), 404, "not_found")
    api.error(api.get("/v1/collections/first", key), 401, "unauthorized")
    api.error(api.delete("/v1/collections/first"), 404, "not_found")
    assert [c["name"] for c in api.ok(api.get("/v1/collections"))] == ["second"]

    # A new collection with the same name starts empty: no identity, face, vector or key survives.
    api.create_collection("first")
    assert api.ok(api.get("/v1/collections/first"))["faces"] == 0
    assert api.ok(api.get("/v1/collections/first/identities"))["total"] == 0
    assert api.ok(api.get("/v1/collections/first/keys")) == []
    api.error(api.get("/v1/collections/first", key), 401, "unauthorized")
    assert only_face(api.ok(api.identify("first", "obama2.jpg")))["candidates"] == []


def test_erasure_reaches_the_snapshot_files(start_api: Any) -> None:
    """After an identity is deleted, the on-disk index snapshot no longer holds its vectors."""
    from gallery.engines.index import FaceIndex

    api = start_api(gallery={"erasure_snapshot_delay_s": 0.2})
    api.create_collection("people")
    enrolled = api.enroll("people", "obama", "obama.jpg", params={"create": "true"})
    face_id = api.ok(enrolled, 201)["faces"][0]["id"]
    snapshot_dir = api.settings.gallery.snapshot_dir
    assert snapshot_dir is not None
    api.app.state.gallery.snapshot()
    (path,) = snapshot_dir.glob("collection-*.faiss")
    assert face_id in FaceIndex.load(path)[0].ids
    assert api.delete("/v1/collections/people/identities/obama").status_code == 204
    deadline = time.monotonic() + 10
    while face_id in FaceIndex.load(path)[0].ids and time.monotonic() < deadline:
        time.sleep(0.1)
    assert face_id not in FaceIndex.load(path)[0].ids
