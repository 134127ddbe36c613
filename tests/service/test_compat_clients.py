"""The compatible APIs as the originals behave, for clients other than the two SDKs, with plain HTTP requests
shaped as those clients send them, against the real gateway, Triton and database:

- DeepStack registers every file of a form and matches any two (a client names each image ``image<uuid>``);
- DeepStack and CodeProject.AI clients that send no key, where the operator allowed it
  (``FACEREC_DEEPSTACK__KEYLESS``: loopback only, or the network);
- CompreFace answers the nearest subjects whatever their similarity (apps read ``subjects[0]``)."""

from __future__ import annotations

import logging
import socket
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

if TYPE_CHECKING:
    from tests.service.live_fixtures import Live, StartLive

pytest_plugins = ["tests.service.live_fixtures"]

pytestmark = pytest.mark.triton

FACE = "/v1/vision/face"


def outside_address() -> str | None:
    """An address of this machine that is not loopback (the source of a call over the network)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            address = str(probe.getsockname()[0])
        except OSError:
            return None
    return None if address.startswith("127.") else address


def jpeg(photos: dict[str, Path], name: str) -> tuple[str, bytes, str]:
    return (name, photos[name].read_bytes(), "image/jpeg")


def test_deepstack_takes_any_file_field(live_api: StartLive, photos: dict[str, Path]) -> None:
    live = live_api(deepstack={"collection": "home"})
    key = live.collection_with_key("home")
    # a client that names each image field image<uuid>, two photos of one person in one call
    files = {f"image{uuid.uuid4().hex}": jpeg(photos, name) for name in ("obama.jpg", "obama3.jpg")}
    registered = httpx.post(f"{live.base}{FACE}/register", data={"userid": "obama", "api_key": key},
                            files=files, timeout=60)
    assert registered.status_code == 200 and registered.json()["message"] == "face added", registered.text
    assert len(live.admin("GET", "/v1/collections/home/identities/obama/faces")) == 2
    recognized = httpx.post(f"{live.base}{FACE}/recognize", data={"api_key": key},
                            files={"image": jpeg(photos, "obama2.jpg")}, timeout=60).json()
    assert recognized["predictions"][0]["userid"] == "obama"
    # match: any two files, in their order
    same = httpx.post(f"{live.base}{FACE}/match", data={"api_key": key}, timeout=60,
                      files=[("a", jpeg(photos, "obama.jpg")), ("b", jpeg(photos, "obama2.jpg"))]).json()
    other = httpx.post(f"{live.base}{FACE}/match", data={"api_key": key}, timeout=60,
                       files=[("first", jpeg(photos, "obama.jpg")), ("x", jpeg(photos, "biden.jpg"))]).json()
    assert same["success"] and other["success"] and same["similarity"] > 0.9 > other["similarity"]
    # a text field sent as a file is still refused, not taken for an image; one image is not a match
    as_file = httpx.post(f"{live.base}{FACE}/register", data={"api_key": key}, timeout=60,
                         files={"userid": ("u.txt", b"obama", "text/plain"),
                                "img": jpeg(photos, "obama.jpg")})
    assert as_file.status_code == 400 and "userid must be a text field" in as_file.json()["error"]
    one = httpx.post(f"{live.base}{FACE}/match", data={"api_key": key}, timeout=60,
                     files={"anything": jpeg(photos, "obama.jpg")})
    assert one.status_code == 400 and "two images" in one.json()["error"]
    none = httpx.post(f"{live.base}{FACE}/register", timeout=60,  # a multipart form of text fields only
                      files=[("api_key", (None, key.encode())), ("userid", (None, b"x"))])
    assert none.status_code == 400 and "send each image as a file" in none.json()["error"]


def test_keyless_deepstack_calls_only_where_the_operator_allowed_them(
        live_api: StartLive, photos: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    outside = outside_address()
    if outside is None:
        pytest.skip("this machine has no address but loopback: the network case cannot be told apart")

    def recognize(live: Live, address: str, **data: str) -> httpx.Response:
        # as Home Assistant's integration with api_key left at "", and CodeProject.AI clients (no key)
        return httpx.post(f"http://{address}:{live.port}{FACE}/recognize", data=data, timeout=60,
                          files={"image": jpeg(photos, "obama2.jpg")})

    with caplog.at_level(logging.WARNING, logger="service.app"):
        loopback = live_api(deepstack={"collection": "home", "keyless": "loopback"}, host="0.0.0.0")
    assert "DeepStack calls WITHOUT a key act on collection 'home'" in caplog.text
    loopback.collection_with_key("home")
    assert recognize(loopback, "127.0.0.1").status_code == 200
    assert recognize(loopback, "127.0.0.1", api_key="").status_code == 200
    refused = recognize(loopback, outside)
    assert refused.status_code == 401
    assert refused.json() == {"success": False, "error": "an api_key is required", "code": 401}
    assert recognize(loopback, "127.0.0.1", api_key="frk_wrong").status_code == 401  # a key sent is checked

    network = live_api(deepstack={"collection": "home", "keyless": "network"}, host="0.0.0.0")
    network.collection_with_key("home")
    assert recognize(network, outside).status_code == 200
    listed = httpx.post(f"http://{outside}:{network.port}{FACE}/list", timeout=60)
    assert listed.status_code == 200 and listed.json()["faces"] == []

    keyed = live_api(deepstack={"collection": "home"}, host="0.0.0.0")  # the default: off
    keyed.collection_with_key("home")
    assert recognize(keyed, "127.0.0.1").status_code == 401


def test_compreface_answers_the_nearest_subjects_of_a_stranger(live_api: StartLive,
                                                               photos: dict[str, Path]) -> None:
    live = live_api()
    key = live.collection_with_key("cf")
    headers = {"x-api-key": key}
    for subject, name in (("obama", "obama.jpg"), ("biden", "biden.jpg")):
        added = httpx.post(f"{live.base}/api/v1/recognition/faces", params={"subject": subject},
                           headers=headers, files={"file": jpeg(photos, name)}, timeout=60)
        assert added.status_code == 201, added.text
    answer = httpx.post(f"{live.base}/api/v1/recognition/recognize", params={"prediction_count": 2},
                        headers=headers, files={"file": jpeg(photos, "t1.jpg")}, timeout=60).json()
    cut = live.admin("GET", "/v1/collections/cf")["decision"]["confidence_at_threshold"]
    assert len(answer["result"]) == 6
    for face in answer["result"]:  # strangers all: app code reading subjects[0] works, and tells them apart
        assert [s["subject"] for s in face["subjects"]] in (["obama", "biden"], ["biden", "obama"])
        assert all(s["similarity"] < min(cut, 0.5) for s in face["subjects"])
