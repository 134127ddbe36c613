"""The CompreFace-compatible API driven by CompreFace's own Python SDK (``compreface-sdk==0.6.0``, over
HTTP with ``requests``) against the real gateway, Triton and database: enroll, recognise the same person
in another photo, *unknown* for a stranger, verify, detect, manage subjects and examples, delete — and
every call's response has CompreFace's documented shape."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import requests
from compreface import CompreFace

if TYPE_CHECKING:
    from tests.service.live_fixtures import Live, StartLive

pytest_plugins = ["tests.service.live_fixtures"]

pytestmark = pytest.mark.triton

BOX_KEYS = {"probability", "x_max", "y_max", "x_min", "y_min"}


@pytest.fixture
def live(live_api: StartLive) -> Live:
    return live_api()


@pytest.fixture
def key(live: Live) -> str:
    return live.collection_with_key("cf")


def sdk(live: Live) -> CompreFace:
    return CompreFace(domain=f"http://{live.host}", port=str(live.port))


def check_face(face: dict[str, Any]) -> None:
    assert set(face["box"]) == BOX_KEYS
    assert all(isinstance(face["box"][k], int) for k in BOX_KEYS - {"probability"})
    assert 0 < face["box"]["probability"] <= 1


def test_the_recognition_flow(live: Live, key: str, photos: dict[str, Path]) -> None:
    recognition = sdk(live).init_face_recognition(key)
    examples, subjects = recognition.get_face_collection(), recognition.get_subjects()

    added = examples.add(image_path=str(photos["obama.jpg"]), subject="obama")
    assert set(added) == {"image_id", "subject"} and added["subject"] == "obama"
    biden = examples.add(image_path=photos["biden.jpg"].read_bytes(), subject="Joe Biden")  # bytes work too
    assert biden["subject"] == "Joe Biden"
    examples.add(image_path=str(photos["obama3.jpg"]), subject="obama")

    listed = examples.list()
    assert listed["total_elements"] == 3 and listed["page_number"] == 0 and listed["total_pages"] == 1
    assert sorted(f["subject"] for f in listed["faces"]) == ["Joe Biden", "obama", "obama"]
    assert subjects.list() == {"subjects": ["obama", "Joe Biden"]}

    found = recognition.recognize(image_path=str(photos["obama2.jpg"]))
    (face,) = found["result"]
    check_face(face)
    assert face["subjects"][0]["subject"] == "obama" and face["subjects"][0]["similarity"] > 0.9
    assert set(found) == {"result"}  # status=false: no plugins_versions, no execution_time
    stranger = recognition.recognize(image_path=str(photos["astronaut.png"]))
    # the nearest subject whatever its similarity, as CompreFace answers; a client tells a stranger by a
    # similarity below the collection's confidence at its threshold (docs/compat.md)
    (nearest,) = stranger["result"][0]["subjects"]
    cut = live.admin("GET", "/v1/collections/cf")["decision"]["confidence_at_threshold"]
    assert nearest["subject"] in {"obama", "Joe Biden"} and nearest["similarity"] < min(cut, 0.5)

    rich = recognition.recognize(image_path=str(photos["obama2.jpg"]), options={
        "limit": 1, "prediction_count": 2, "det_prob_threshold": 0.8, "face_plugins": "landmarks,calculator",
        "status": True})
    (face,) = rich["result"]
    assert len(face["landmarks"]) == 5 and len(face["embedding"]) == 128
    assert "face_pipeline" in face["execution_time"]
    assert rich["plugins_versions"]["calculator"]
    assert [s["subject"] for s in face["subjects"]] == ["obama", "Joe Biden"]  # prediction_count nearest
    assert face["subjects"][0]["similarity"] > 0.9 > face["subjects"][1]["similarity"]

    verified = examples.verify(image_path=str(photos["obama2.jpg"]), image_id=added["image_id"])
    assert verified["result"][0]["similarity"] > 0.9
    assert examples.verify(image_path=str(photos["biden.jpg"]), image_id=added["image_id"])["result"][0][
        "similarity"] < 0.1

    assert subjects.update(subject="obama", new_name="barack") == {"updated": True}
    assert recognition.recognize(image_path=str(photos["obama2.jpg"]))["result"][0]["subjects"][0][
        "subject"] == "barack"
    assert examples.delete(added["image_id"]) == {"image_id": added["image_id"], "subject": "barack"}
    assert examples.delete_all("barack") == {"deleted": 1}
    assert subjects.delete("barack") == {"subject": "barack"}
    assert subjects.add("Kamala") == {"subject": "Kamala"}
    assert subjects.delete_all() == {"deleted": 2}
    assert examples.list()["total_elements"] == 0


def test_rename_merges_into_an_existing_subject(live: Live, key: str, photos: dict[str, Path]) -> None:
    recognition = sdk(live).init_face_recognition(key)
    examples, subjects = recognition.get_face_collection(), recognition.get_subjects()
    examples.add(image_path=str(photos["obama.jpg"]), subject="a")
    examples.add(image_path=str(photos["obama3.jpg"]), subject="b")
    assert subjects.update(subject="a", new_name="b") == {"updated": True}
    assert subjects.list() == {"subjects": ["b"]}
    assert [f["subject"] for f in examples.list()["faces"]] == ["b", "b"]
    assert recognition.recognize(image_path=str(photos["obama2.jpg"]))["result"][0]["subjects"][0][
        "subject"] == "b"


def test_detection_and_verification(live: Live, key: str, photos: dict[str, Path]) -> None:
    detection = sdk(live).init_face_detection(key)
    found = detection.detect(str(photos["t1.jpg"]))
    assert len(found["result"]) == 6
    for face in found["result"]:
        check_face(face)
    assert len(detection.detect(str(photos["t1.jpg"]), options={"limit": 2})["result"]) == 2

    verification = sdk(live).init_face_verification(live.admin_key)  # detection/verification: any key
    same = verification.verify(str(photos["obama.jpg"]), str(photos["obama3.jpg"]))
    (match,) = same["result"]
    check_face(match["source_image_face"])
    assert match["face_matches"][0]["similarity"] > 0.9
    group = verification.verify(str(photos["obama.jpg"]), str(photos["t1.jpg"]))
    assert len(group["result"][0]["face_matches"]) == 6
    assert max(m["similarity"] for m in group["result"][0]["face_matches"]) < 0.5
    # the roles follow the field names, not the order of the parts (the target first swapped them)
    url, headers = f"{live.base}/api/v1/verification/verify", {"x-api-key": live.admin_key}
    target_first = requests.post(url, headers=headers, timeout=60, files=[
        ("target_image", ("t1.jpg", photos["t1.jpg"].read_bytes(), "image/jpeg")),
        ("source_image", ("obama.jpg", photos["obama.jpg"].read_bytes(), "image/jpeg"))])
    assert target_first.status_code == 200, target_first.text
    assert len(target_first.json()["result"][0]["face_matches"]) == 6
    two_sources = requests.post(url, headers=headers, timeout=60, files=[
        ("source_image", ("a.jpg", photos["obama.jpg"].read_bytes(), "image/jpeg")),
        ("source_image", ("b.jpg", photos["t1.jpg"].read_bytes(), "image/jpeg"))])
    assert two_sources.status_code == 400 and two_sources.json()["code"] == 34, two_sources.text


def test_errors_have_compreface_shape(live: Live, key: str, photos: dict[str, Path]) -> None:
    recognition = sdk(live).init_face_recognition(key)
    assert recognition.recognize(image_path=str(photos["coffee.png"]))["code"] == 28  # no face
    group = recognition.get_face_collection().add(image_path=str(photos["t1.jpg"]), subject="x")
    assert group["code"] == 31 and set(group) == {"message", "code"}
    assert sdk(live).init_face_recognition("frk_nope").recognize(str(photos["obama.jpg"]))["code"] == 10
    assert sdk(live).init_face_recognition(live.admin_key).get_subjects().list()["code"] == 10
    assert recognition.get_face_collection().delete("123456") == {"message": "Image 123456 not found",
                                                                   "code": 44}
    assert recognition.get_subjects().delete("nobody")["code"] == 42
    base = f"{live.base}/api/v1/recognition"
    missing = requests.get(f"{base}/subjects", timeout=30)
    assert missing.status_code == 400
    assert missing.json() == {"message": "Missing header: x-api-key", "code": 20}
    bad = requests.post(f"{base}/recognize?limit=-1", headers={"x-api-key": key},
                        files={"file": photos["obama.jpg"].read_bytes()}, timeout=30)
    assert bad.status_code == 400 and bad.json()["code"] == 26
    assert requests.post(f"{base}/subjects", json={"subject": "dup"}, headers={"x-api-key": key},
                         timeout=30).status_code == 201
    again = requests.post(f"{base}/subjects", json={"subject": "dup"}, headers={"x-api-key": key}, timeout=30)
    assert again.status_code == 400 and again.json()["code"] == 43
