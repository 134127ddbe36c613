"""Enrollment takes the obvious face: a portrait with a tiny face in the background is enrolled (the tiny
face could never pass the quality gate's minimum size, so it is not "several faces") and the response
says which faces were ignored and why; ``face`` and ``box`` work as query parameters too; unknown
parameters are a 422 instead of being silently dropped."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import cv2
import numpy as np
import pytest

if TYPE_CHECKING:
    from tests.service.fixtures import Api, StartApi

pytest_plugins = ["tests.service.fixtures"]

pytestmark = pytest.mark.triton

MIN_SIZE = 40.0  # the quality gate's default minimum face size


def side(box: dict[str, float]) -> float:
    return min(box["x2"] - box["x1"], box["y2"] - box["y1"])


def faces_of(api: Api, image: bytes) -> list[dict[str, Any]]:
    faces: list[dict[str, Any]] = api.ok(api.detect(image))["faces"]
    return faces


@pytest.fixture
def portrait_with_spectator(api: Api) -> bytes:
    """obama.jpg at 640 px wide with Biden's face shrunk to ~32 px pasted in a corner (a spectator far
    behind the subject: detected with score 0.99, but below the gate's 40 px)."""
    biden = api.photos["biden.jpg"]
    (face,) = faces_of(api, biden)
    box = face["box"]
    image = cv2.imdecode(np.frombuffer(biden, np.uint8), cv2.IMREAD_COLOR)
    pad = 0.3 * (box["x2"] - box["x1"])
    x1, y1 = int(max(0, box["x1"] - pad)), int(max(0, box["y1"] - pad))
    x2, y2 = int(box["x2"] + pad), int(box["y2"] + pad)
    area = cv2.INTER_AREA
    small = cv2.resize(image[y1:y2, x1:x2], (48, int(48 * (y2 - y1) / (x2 - x1))), interpolation=area)
    portrait = cv2.imdecode(np.frombuffer(api.photos["obama.jpg"], np.uint8), cv2.IMREAD_COLOR)
    portrait = cv2.resize(portrait, (640, portrait.shape[0] * 640 // portrait.shape[1]), interpolation=area)
    portrait[10:10 + small.shape[0], 10:10 + small.shape[1]] = small
    ok, jpeg = cv2.imencode(".jpg", portrait, [cv2.IMWRITE_JPEG_QUALITY, 95])
    assert ok
    data = jpeg.tobytes()
    sides = sorted(side(f["box"]) for f in faces_of(api, data))
    assert len(sides) == 2 and sides[0] < MIN_SIZE <= sides[1], f"not the photo it should be: {sides}"
    return data


def test_a_tiny_background_face_is_not_a_second_face(api: Api, portrait_with_spectator: bytes) -> None:
    api.create_collection("c")
    enrolled = api.ok(api.enroll("c", "obama", portrait_with_spectator, params={"create": "true"}), 201)
    (face,) = enrolled["faces"]
    assert side(face["box"]) >= MIN_SIZE
    (ignored,) = enrolled["ignored"]
    assert ignored["reason"] == "face_too_small" and ignored["image"] == 0
    assert side(ignored["box"]) < MIN_SIZE
    match = api.ok(api.identify("c", "obama2.jpg"))["faces"][0]
    assert match["decision"] == "match" and match["identity"]["external_id"] == "obama"


def test_a_tiny_face_alone_is_refused_by_the_quality_gate(api: Api) -> None:
    """With no face of enrollable size, the largest is taken and refused for its size (not several_faces)."""
    api.create_collection("c")
    image = cv2.imdecode(np.frombuffer(api.photos["t1.jpg"], np.uint8), cv2.IMREAD_COLOR)
    tiny = cv2.resize(image, (image.shape[1] // 4, image.shape[0] // 4), interpolation=cv2.INTER_AREA)
    data = cv2.imencode(".jpg", tiny)[1].tobytes()
    found = faces_of(api, data)
    if len(found) < 2 or max(side(f["box"]) for f in found) >= MIN_SIZE:
        pytest.fail(f"the shrunk group photo should hold several faces below {MIN_SIZE} px: {found}")
    details = api.error(api.enroll("c", "x", data, params={"create": "true"}), 422, "low_quality")
    assert "face_too_small" in details["reasons"]


def test_face_and_box_work_as_query_parameters(start_api: StartApi) -> None:
    # t1.jpg's largest face is turned (yaw ~ -60 with the current detector): a lenient pose gate here, the
    # face choice is what this test is about.
    api = start_api(quality={"max_yaw": 90.0, "max_pitch": 90.0})
    api.create_collection("g")
    boxes = [f["box"] for f in faces_of(api, api.photos["t1.jpg"])]
    assert len(boxes) == 6 and all(side(b) >= MIN_SIZE for b in boxes)
    largest = api.ok(api.enroll("g", "a", "t1.jpg", params={"create": "true", "face": "largest"}), 201)
    biggest = max(boxes, key=lambda b: (b["x2"] - b["x1"]) * (b["y2"] - b["y1"]))
    assert largest["faces"][0]["box"] == pytest.approx(biggest, abs=1.0)
    assert [i["reason"] for i in largest["ignored"]] == ["not_largest"] * 5

    other = next(b for b in boxes if b != biggest)
    box = ",".join(f"{other[k]:.1f}" for k in ("x1", "y1", "x2", "y2"))
    picked = api.ok(api.enroll("g", "b", "t1.jpg", params={"create": "true", "box": box}), 201)
    assert picked["faces"][0]["box"] == pytest.approx(other, abs=1.0)
    assert [i["reason"] for i in picked["ignored"]] == ["outside_box"] * 5
    # The same value in the query and the form is fine; different values are a 422.
    api.ok(api.enroll("g", "b", "t1.jpg", params={"box": box}, data={"box": box}), 201)
    api.error(api.enroll("g", "b", "t1.jpg", params={"face": "largest"}, data={"face": "only"}), 422,
              "validation_error")
    api.error(api.enroll("g", "b", "t1.jpg", params={"face": "biggest"}), 422, "validation_error")


def test_unknown_parameters_are_refused(api: Api) -> None:
    api.create_collection("u")
    url = "/v1/collections/u/identities/x/faces"
    details = api.error(api.enroll("u", "x", "obama.jpg", params={"create": "true", "faces": "largest"}), 422,
                        "validation_error")
    assert details["errors"][0]["loc"] == ["query", "faces"]
    details = api.error(api.enroll("u", "x", "obama.jpg", params={"create": "true"},
                                   data={"fase": "largest"}), 422, "validation_error")
    assert details["errors"][0]["loc"] == ["body", "fase"]
    api.error(api.post(url, json={"images": ["aGVsbG8="], "largest": True}), 422, "validation_error")
    api.error(api.get("/v1/collections/u/identities/x"), 404, "not_found")  # nothing was created


def test_the_quality_gate_and_crops_run_off_the_event_loop(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """Choosing each image's face, hashing the file and PNG-encoding its crop (0.4 ms an image) happen in the
    enrolment's worker thread: on the event loop they held every other request of the gateway meanwhile."""
    import asyncio

    from recognition import usecases

    on_loop: list[bool] = []
    choose = usecases.enrollable_face

    def recording(*args: Any, **kwargs: Any) -> Any:
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:  # no loop running in this thread: a worker thread
            on_loop.append(False)
        return choose(*args, **kwargs)

    monkeypatch.setattr(usecases, "enrollable_face", recording)
    api.create_collection("c")
    api.ok(api.enroll("c", "obama", "obama.jpg", "obama2.jpg", params={"create": "true"}), 201)
    api.error(api.enroll("c", "group", "t1.jpg", params={"create": "true"}), 422, "several_faces")
    assert on_loop == [False, False, False]


def test_creating_enroll_keeps_the_external_id_rules(api: Api) -> None:
    """``create=true`` made identities whose ids POST .../identities refuses (a leading space, over 256
    characters): they could not be addressed the same way afterwards."""
    api.create_collection("ids")
    for bad in ("%20bob", "x" * 257):
        details = api.error(api.enroll("ids", bad, "obama.jpg", params={"create": "true"}), 422,
                            "validation_error")
        assert details["errors"][0]["loc"] == ["path", "external_id"]
    assert api.ok(api.get("/v1/collections/ids/identities"))["items"] == []
    api.ok(api.enroll("ids", "bob", "obama.jpg", params={"create": "true"}), 201)
