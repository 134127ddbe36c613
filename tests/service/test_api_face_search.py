"""Search by a stored face (``POST /v1/collections/{c}/faces/{face_id}/search``): the top-k identities for
an enrolled face, the face itself left out, with the usual threshold decision; duplicates of a person
enrolled twice are found without uploading the photo again."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from tests.service.fixtures import Api

pytest_plugins = ["tests.service.fixtures"]

pytestmark = pytest.mark.triton


@pytest.fixture
def people(api: Api) -> dict[str, int]:
    """Collection ``p``: obama (obama.jpg, obama3.jpg), biden, and obama enrolled again as ``dup``."""
    api.create_collection("p")
    ids = {}
    for external_id, photos in {"obama": ["obama.jpg", "obama3.jpg"], "biden": ["biden.jpg"],
                                "dup": ["obama2.jpg"]}.items():
        enrolled = api.ok(api.enroll("p", external_id, *photos, params={"create": "true"}), 201)
        for photo, face in zip(photos, enrolled["faces"], strict=True):
            ids[photo] = face["id"]
    return ids


def search(api: Api, face_id: int, key: str | None = None, **params: Any) -> Any:
    return api.post(f"/v1/collections/p/faces/{face_id}/search", key, params=params)


def cosine(api: Api, a: int, b: int) -> float:
    records = api.app.state.recognition.faces
    return float(records.get("p", a).vector @ records.get("p", b).vector)


def test_the_face_itself_is_left_out(api: Api, people: dict[str, int]) -> None:
    found = api.ok(search(api, people["obama.jpg"], k=3))
    assert found["face_id"] == people["obama.jpg"] and found["external_id"] == "obama"
    scores = {c["external_id"]: c["score"] for c in found["candidates"]}
    assert set(scores) == {"obama", "dup", "biden"}
    # obama's score is its OTHER face's (obama3), not the searched face's own 1.0.
    assert scores["obama"] == pytest.approx(cosine(api, people["obama.jpg"], people["obama3.jpg"]), abs=1e-5)
    assert scores["dup"] == pytest.approx(cosine(api, people["obama.jpg"], people["obama2.jpg"]), abs=1e-5)
    assert scores["obama"] < 0.99
    assert [c["score"] for c in found["candidates"]] == sorted(scores.values(), reverse=True)
    assert found["decision"] == "match" and found["identity"]["external_id"] in {"obama", "dup"}
    assert found["threshold"] == pytest.approx(api.ok(api.get("/v1/collections/p"))["decision"]["threshold"],
                                               abs=1e-6)


def test_duplicates_are_found_when_the_identity_is_left_out(api: Api, people: dict[str, int]) -> None:
    found = api.ok(search(api, people["obama.jpg"], k=5, exclude_identity="true"))
    assert [c["external_id"] for c in found["candidates"]] == ["dup", "biden"]
    assert found["decision"] == "match" and found["identity"]["external_id"] == "dup"
    # Biden has no look-alike: unknown, though candidates are listed.
    alone = api.ok(search(api, people["biden.jpg"], k=2))
    assert alone["decision"] == "unknown" and alone["identity"] is None
    assert {c["external_id"] for c in alone["candidates"]} == {"obama", "dup"}
    # The threshold decides as usual: at -1 everything matches.
    assert api.ok(search(api, people["biden.jpg"], threshold=-1))["decision"] == "match"


def test_a_single_face_collection_gives_no_candidates(api: Api) -> None:
    api.create_collection("p")
    face = api.ok(api.enroll("p", "solo", "obama.jpg", params={"create": "true"}), 201)["faces"][0]
    found = api.ok(search(api, face["id"]))
    assert found["candidates"] == [] and found["decision"] == "unknown"


def test_search_errors(api: Api, people: dict[str, int]) -> None:
    api.error(search(api, 999_999), 404, "not_found")
    api.create_collection("other")
    api.error(api.post(f"/v1/collections/other/faces/{people['obama.jpg']}/search"), 404, "not_found")
    api.error(search(api, people["obama.jpg"], k=0), 422, "validation_error")
    api.error(search(api, people["obama.jpg"], k=10_000), 422, "validation_error")
    api.error(search(api, people["obama.jpg"], kk=3), 422, "validation_error")
    api.error(search(api, 0), 422, "validation_error")
    other_key = api.create_key("other")["key"]
    api.error(search(api, people["obama.jpg"], key=other_key), 403, "forbidden")
    api.error(search(api, people["obama.jpg"], key=""), 401, "unauthorized")
    own_key = api.create_key("p")["key"]
    assert api.ok(search(api, people["obama.jpg"], key=own_key))["external_id"] == "obama"
