"""The DeepStack-compatible face API driven by ``deepstack-python==0.9`` (the client of Home Assistant's
DeepStack face integration; over HTTP with ``requests``) against the real gateway, Triton and database:
register, recognise the same person in another photo, "unknown" for a stranger, detect, list, delete."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import requests
from deepstack.core import DeepstackException, DeepstackFace, get_recognized_faces

if TYPE_CHECKING:
    from tests.service.live_fixtures import Live, StartLive

pytest_plugins = ["tests.service.live_fixtures"]

pytestmark = pytest.mark.triton

BOX = {"x_min", "y_min", "x_max", "y_max"}


@pytest.fixture
def live(live_api: StartLive) -> Live:
    return live_api(deepstack={"collection": "home"})


@pytest.fixture
def key(live: Live) -> str:
    return live.collection_with_key("home")


def client(live: Live, key: str, min_confidence: float = 0.6) -> DeepstackFace:
    return DeepstackFace(ip=live.host, port=live.port, api_key=key, timeout=60, min_confidence=min_confidence)


def test_the_face_flow(live: Live, key: str, photos: dict[str, Path]) -> None:
    face = client(live, key)
    assert face.register("obama", photos["obama.jpg"].read_bytes()) == "face added"
    assert face.register("obama", photos["obama3.jpg"].read_bytes()) == "face updated"
    assert face.register("biden", photos["biden.jpg"].read_bytes()) == "face added"
    assert face.get_registered_faces() == ["obama", "biden"]

    (prediction,) = face.recognize(photos["obama2.jpg"].read_bytes())
    assert prediction["userid"] == "obama" and prediction["confidence"] > 0.9 and set(prediction) >= BOX
    assert get_recognized_faces([prediction]) == {"obama": round(prediction["confidence"] * 100, 1)}
    (stranger,) = face.recognize(photos["astronaut.png"].read_bytes())
    assert stranger["userid"] == "unknown" and stranger["confidence"] == 0
    group = face.recognize(photos["t1.jpg"].read_bytes())
    assert len(group) == 6 and get_recognized_faces(group) == {}
    # min_confidence only ever makes the decision stricter than the collection's threshold.
    (strict,) = client(live, key, min_confidence=1.0).recognize(photos["obama2.jpg"].read_bytes())
    assert strict["userid"] == "unknown"

    detected = face.detect(photos["t1.jpg"].read_bytes())
    assert len(detected) == 6 and all(set(p) >= BOX and 0.5 <= p["confidence"] <= 1 for p in detected)
    assert all(isinstance(p[k], int) for p in detected for k in BOX)

    deleted = requests.post(f"{live.base}/v1/vision/face/delete", data={"userid": "obama", "api_key": key},
                            timeout=30)
    assert deleted.status_code == 200 and deleted.json()["success"] is True
    assert face.get_registered_faces() == ["biden"]
    (gone,) = face.recognize(photos["obama2.jpg"].read_bytes())
    assert gone["userid"] == "unknown"


def test_keys_and_errors(live: Live, key: str, live_api: StartLive, photos: dict[str, Path]) -> None:
    image = photos["obama.jpg"].read_bytes()
    with pytest.raises(DeepstackException, match="status code: 401"):
        client(live, "frk_not_a_key").recognize(image)
    with pytest.raises(DeepstackException, match="status code: 401"):
        client(live, "").detect(image)
    other = live.collection_with_key("other")
    with pytest.raises(DeepstackException, match="status code: 403"):
        client(live, other).register("x", image)
    assert client(live, live.admin_key).get_registered_faces() == []  # the admin key works too
    with pytest.raises(DeepstackException, match="status code: 422"):
        client(live, key).register("nobody", photos["coffee.png"].read_bytes())  # no face
    answer = requests.post(f"{live.base}/v1/vision/face/register", data={"api_key": key},
                           files={"image": image}, timeout=30)
    assert answer.status_code == 400 and answer.json()["success"] is False
    assert "userid" in answer.json()["error"]
    broken = requests.post(f"{live.base}/v1/vision/face/recognize", data={"api_key": key},
                           files={"image": b"not an image"}, timeout=30)
    assert broken.status_code == 415 and broken.json()["success"] is False
    off = live_api()  # FACEREC_DEEPSTACK__COLLECTION unset: the API is off
    answer = requests.post(f"{off.base}/v1/vision/face/list", data={"api_key": off.admin_key}, timeout=30)
    assert answer.status_code == 404 and answer.json()["success"] is False


def test_match(live: Live, key: str, photos: dict[str, Path]) -> None:
    def match(a: str, b: str) -> float:
        answer = requests.post(f"{live.base}/v1/vision/face/match", data={"api_key": key}, timeout=60,
                               files={"image1": photos[a].read_bytes(), "image2": photos[b].read_bytes()})
        assert answer.status_code == 200, answer.text
        return float(answer.json()["similarity"])

    assert match("obama.jpg", "obama3.jpg") > 0.9 > 0.1 > match("obama.jpg", "biden.jpg")
    twice = requests.post(f"{live.base}/v1/vision/face/match", data={"api_key": key}, timeout=60,
                          files=[("image1", photos["obama.jpg"].read_bytes()),
                                 ("image1", photos["biden.jpg"].read_bytes())])
    assert twice.status_code == 400 and twice.json()["success"] is False, twice.text
