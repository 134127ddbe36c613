"""Bad and oversized input at the edge: precise 4xx codes in the one error model, never a 500.

Size limits (declared and streamed bodies, pixels, batch sizes), media types, broken images, broken
base64/JSON, query validation, the request timeout, and the request id on every response.
"""

from __future__ import annotations

import base64
import io
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

import cv2
import httpx
import numpy as np
import pytest
from PIL import Image

if TYPE_CHECKING:
    from tests.service.fixtures import Api, StartApi

pytest_plugins = ["tests.service.fixtures"]

pytestmark = pytest.mark.triton

MAX_BYTES = 200_000
MAX_PIXELS = 1_500_000  # t1.jpg (1280x886) fits, a 4000x4000 image does not
MAX_IMAGES = 3


@pytest.fixture
def small(start_api: StartApi) -> Api:
    """An app with small limits and a collection ``c`` holding identity ``obama`` (no faces)."""
    api = start_api(
        limits={"max_upload_bytes": MAX_BYTES, "max_pixels": MAX_PIXELS, "max_batch_images": MAX_IMAGES}
    )
    api.create_collection("c")
    api.create_identity("c", "obama", "Barack Obama")
    return api


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def encode(fmt: str, size: tuple[int, int] = (64, 48), mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    Image.new(mode, size).save(out, format=fmt)
    return out.getvalue()


def reencode(data: bytes, ext: str) -> bytes:
    ok, encoded = cv2.imencode(ext, cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR))
    assert ok
    return encoded.tobytes()


def chunks(data: bytes, size: int = 32_768) -> Iterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


def multipart(field: str, filename: str, data: bytes) -> tuple[bytes, str]:
    """A multipart body built by httpx (to stream it ourselves) and its content type."""
    request = httpx.Request("POST", "http://testserver/", files={field: (filename, data, "image/jpeg")})
    return request.read(), request.headers["content-type"]


def test_body_size_limit_declared(small: Api) -> None:
    assert len(small.photos["obama.jpg"]) > MAX_BYTES > len(small.photos["obama2.jpg"])
    details = small.error(small.identify("c", "obama.jpg"), 413, "payload_too_large")
    assert details["max_bytes"] == MAX_BYTES
    small.error(small.enroll("c", "obama", "obama.jpg"), 413, "payload_too_large")
    small.error(
        small.post("/v1/collections/c/identify", json={"image": b64(small.photos["obama2.jpg"])}),
        413,
        "payload_too_large",
    )
    small.error(
        small.post(
            "/v1/collections/c/identities", json={"external_id": "big", "metadata": {"x": "y" * MAX_BYTES}}
        ),
        413,
        "payload_too_large",
    )
    # Refused before authentication: an oversized anonymous body is a 413 too.
    small.error(
        small.post("/v1/detect", key="", files=small.files("image", "obama.jpg")), 413, "payload_too_large"
    )
    assert small.ok(small.get("/v1/collections/c/identities/obama/faces")) == []


def test_body_size_limit_streamed(small: Api) -> None:
    """A chunked body without Content-Length is cut off as soon as it passes the limit."""
    body, content_type = multipart("images", "obama.jpg", small.photos["obama.jpg"])
    response = small.post(
        "/v1/collections/c/identities/obama/faces",
        content=chunks(body),
        headers={"Content-Type": content_type},
    )
    assert "content-length" not in response.request.headers
    small.error(response, 413, "payload_too_large")

    big_json = ('{"image": "' + b64(small.photos["obama.jpg"]) + '"}').encode()
    small.error(
        small.post(
            "/v1/collections/c/identify",
            content=chunks(big_json),
            headers={"Content-Type": "application/json"},
        ),
        413,
        "payload_too_large",
    )
    identity = ('{"external_id": "streamed", "name": "' + "n" * MAX_BYTES + '"}').encode()
    small.error(
        small.post(
            "/v1/collections/c/identities",
            content=chunks(identity),
            headers={"Content-Type": "application/json"},
        ),
        413,
        "payload_too_large",
    )
    small.error(small.get("/v1/collections/c/identities/streamed"), 404, "not_found")
    assert small.ok(small.get("/v1/collections/c/identities/obama/faces")) == []

    # Under the limit, a streamed body is read whole and works.
    fits = ('{"image": "' + b64(small.photos["t1.jpg"]) + '"}').encode()
    assert len(fits) < MAX_BYTES
    found = small.ok(
        small.post("/v1/detect", content=chunks(fits), headers={"Content-Type": "application/json"})
    )
    assert len(found["faces"]) == 6


def test_pixel_limit(small: Api) -> None:
    bomb = cv2.imencode(".png", np.zeros((4000, 4000, 3), np.uint8))[1].tobytes()
    assert len(bomb) < MAX_BYTES
    details = small.error(small.detect(bomb), 413, "too_many_pixels")
    assert details["max_pixels"] == MAX_PIXELS
    small.error(small.post("/v1/collections/c/identify", json={"image": b64(bomb)}), 413, "too_many_pixels")
    small.error(small.enroll("c", "obama", bomb), 413, "too_many_pixels")
    results = small.ok(
        small.post("/v1/collections/c/identify/batch", files=small.files("images", bomb, b"junk"))
    )
    assert [r["error"]["code"] for r in results["results"]] == ["too_many_pixels", "unsupported_media_type"]


@pytest.mark.parametrize("kind", ["gif", "tiff", "pdf", "text", "svg"])
def test_unsupported_formats(small: Api, kind: str) -> None:
    data = {
        "gif": encode("GIF"),
        "tiff": encode("TIFF"),
        "pdf": b"%PDF-1.4\n1 0 obj << /Type /Catalog >> endobj\ntrailer << /Root 1 0 R >>\n%%EOF\n",
        "text": b"just some text, not an image\n",
        "svg": b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>',
    }[kind]
    small.error(small.detect(data), 415, "unsupported_media_type")
    small.error(
        small.post("/v1/collections/c/identify", json={"image": b64(data)}), 415, "unsupported_media_type"
    )
    small.error(small.enroll("c", "obama", data), 415, "unsupported_media_type")


def test_webp_and_bmp_are_accepted(small: Api) -> None:
    for ext in (".webp", ".bmp"):
        data = reencode(small.photos["obama2.jpg"], ext)
        if len(data) > MAX_BYTES:  # BMP is uncompressed: shrink it
            image = cv2.imdecode(np.frombuffer(small.photos["obama2.jpg"], np.uint8), cv2.IMREAD_COLOR)
            data = cv2.imencode(ext, cv2.resize(image, (240, 250)))[1].tobytes()
        assert len(small.ok(small.detect(data))["faces"]) == 1, ext


def test_wrong_content_types(small: Api) -> None:
    url = "/v1/collections/c/identify"
    photo = small.photos["obama2.jpg"]
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "image/jpeg", "application/xml"):
        details = small.error(
            small.post(url, content=photo, headers={"Content-Type": content_type}),
            415,
            "unsupported_media_type",
        )
        assert details["content_type"] == content_type
    small.error(small.post(url, content=photo), 415, "unsupported_media_type")  # no Content-Type at all
    small.error(small.post(url), 415, "unsupported_media_type")


def test_broken_images(small: Api) -> None:
    for call in (
        small.detect,
        lambda data: small.identify("c", data),
        lambda data: small.enroll("c", "obama", data),
    ):
        small.error(call(b""), 400, "invalid_image")
        small.error(call(small.photos["obama2.jpg"][:300]), 400, "invalid_image")
        small.error(call(b"\xff\xd8\xff" + b"\x00" * 500), 400, "invalid_image")
        small.error(call(b"\x89PNG\r\n\x1a\n" + b"garbage" * 20), 400, "invalid_image")
    # A truncated image whose header is intact gets past the gateway; the pipeline refuses it (400).
    photo = small.photos["obama2.jpg"]
    small.error(small.detect(photo[: len(photo) // 10]), 400, "invalid_image")
    assert small.ok(small.get("/v1/collections/c/identities/obama/faces")) == []


def test_broken_json_and_base64(small: Api) -> None:
    url = "/v1/collections/c/identify"
    json_headers = {"Content-Type": "application/json"}
    for body in (b"{", b'{"image": ', b"\xff\xfe", b"", b"{'image': 'x'}"):
        small.error(small.post(url, content=body, headers=json_headers), 400, "invalid_json")
    for encoded in ("not base64!!", "QUJ", "data:image/png;base64,%%%", "Q", "QUJD\n"):
        small.error(small.post(url, json={"image": encoded}), 400, "invalid_base64")
    for body in (
        {},
        {"images": [b64(small.photos["t1.jpg"])]},
        {"image": ""},
        {"image": None},
        {"image": 42},
    ):
        small.error(small.post(url, json=body), 422, "validation_error")
    small.error(small.post(url, json=[1, 2]), 422, "validation_error")
    small.error(small.post(url, json="string"), 422, "validation_error")
    small.error(
        small.post("/v1/collections/c/identities/obama/faces", json={"images": []}), 422, "validation_error"
    )
    small.error(
        small.post("/v1/collections/c/identities/obama/faces", json={"images": ["QUJD"], "box": [1, 2]}),
        422,
        "validation_error",
    )
    small.error(
        small.post("/v1/verify", json={"image_a": b64(small.photos["t1.jpg"])}), 422, "validation_error"
    )
    # Multipart without the image field, or with the image as a plain field.
    small.error(small.post(url, files={"other": ("a.jpg", b"x", "image/jpeg")}), 400, "missing_image")
    small.error(
        small.post(url, files=small.files("image", "t1.jpg"), data={"image": "x"}), 400, "invalid_image"
    )
    # Bodies parsed by FastAPI get the same codes.
    for parsed in ("/v1/collections", "/v1/collections/c/identities", "/v1/collections/c/keys"):
        small.error(small.post(parsed, content=b"{", headers=json_headers), 400, "invalid_json")
        small.error(small.post(parsed, json=[1]), 422, "validation_error")
    small.error(
        small.patch("/v1/collections/c/identities/obama", content=b'{"name": ', headers=json_headers),
        400,
        "invalid_json",
    )
    # Broken multipart bodies.
    multipart_headers = {"Content-Type": "multipart/form-data"}  # no boundary
    small.error(small.post(url, content=b"garbage", headers=multipart_headers), 400, "invalid_multipart")
    fields = {f"field{i}": "x" for i in range(40)}
    small.error(
        small.post("/v1/detect", files=small.files("image", "t1.jpg"), data=fields), 400, "invalid_multipart"
    )


def test_deeply_nested_json(small: Api) -> None:
    """Nesting that breaks the parser or the serializer is refused up front (it was a 500, and stored
    metadata that could not be serialized made every later listing of the collection fail)."""
    json_headers = {"Content-Type": "application/json"}
    for depth in (25, 300, 900):
        nested = "[" * depth + "]" * depth
        body = ('{"external_id": "deep-' + str(depth) + '", "metadata": {"a": ' + nested + "}}").encode()
        small.error(
            small.post("/v1/collections/c/identities", content=body, headers=json_headers),
            422,
            "validation_error",
        )
    small.ok(
        small.post(
            "/v1/collections/c/identities", json={"external_id": "nested", "metadata": {"a": [[[1]]]}}
        ),
        201,
    )
    for depth in (2_000, 50_000):
        nested = ("[" * depth + "]" * depth).encode()
        small.error(
            small.post(
                "/v1/collections/c/identify", content=b'{"image": ' + nested + b"}", headers=json_headers
            ),
            400,
            "invalid_json",
        )
        small.error(
            small.post(
                "/v1/collections/c/identities", content=b'{"metadata": ' + nested + b"}", headers=json_headers
            ),
            400,
            "invalid_json",
        )
    listed = small.ok(small.get("/v1/collections/c/identities"))
    assert sorted(i["external_id"] for i in listed["items"]) == ["nested", "obama"]
    not_utf8 = small.post("/v1/collections", content=b'{"name": "\xff"}', headers=json_headers)
    small.error(not_utf8, 400, "invalid_json")


def test_metadata_size_is_bounded(small: Api) -> None:
    """Metadata had no bound but the body's 10 MiB: 500 identities of 10 MiB each, listed in one page, would
    load gigabytes into the gateway."""
    from service.schemas import MAX_METADATA_BYTES

    url = "/v1/collections/c/identities"
    fits = {"notes": "é" * ((MAX_METADATA_BYTES - 20) // 2)}  # two bytes a character in UTF-8
    small.ok(small.post(url, json={"external_id": "fits", "metadata": fits}), 201)
    too_big = {"notes": "é" * (MAX_METADATA_BYTES // 2)}
    refused = small.post(url, json={"external_id": "too-big", "metadata": too_big})
    small.error(refused, 422, "validation_error")
    small.error(small.patch(f"{url}/fits", json={"metadata": too_big}), 422, "validation_error")
    assert small.ok(small.get(f"{url}/fits"))["metadata"] == fits


def test_non_finite_numbers_are_refused(small: Api) -> None:
    """JSON parsers accept NaN/Infinity; the API must not store or match with them."""
    json_headers = {"Content-Type": "application/json"}
    small.error(
        small.post(
            "/v1/collections/c/identities",
            content=b'{"external_id": "n", "metadata": {"v": NaN}}',
            headers=json_headers,
        ),
        422,
        "validation_error",
    )
    small.error(
        small.patch(
            "/v1/collections/c/identities/obama",
            content=b'{"metadata": {"v": [Infinity]}}',
            headers=json_headers,
        ),
        422,
        "validation_error",
    )
    assert small.ok(small.get("/v1/collections/c/identities/obama"))["metadata"] == {}
    for threshold in ("nan", "inf", "-inf"):
        small.error(small.identify("c", "t1.jpg", params={"threshold": threshold}), 422, "validation_error")
    for box in ("nan,nan,nan,nan", "0,0,inf,inf", "nan,0,nan,10"):
        small.error(small.enroll("c", "obama", "t1.jpg", data={"box": box}), 422, "validation_error")
    small.error(
        small.post(
            "/v1/collections/c/identities/obama/faces",
            headers=json_headers,
            content=('{"images": ["' + b64(small.photos["t1.jpg"]) + '"], "box": [NaN, 0, NaN, 9]}').encode(),
        ),
        422,
        "validation_error",
    )
    assert small.ok(small.get("/v1/collections/c/identities/obama/faces")) == []


def test_nul_characters_never_500(start_api: StartApi, db_url: str) -> None:
    """PostgreSQL refuses NUL in text: a 422 there (SQLite stores it), never a 500."""
    api = start_api(db_url=db_url)
    api.create_collection("c")
    api.create_identity("c", "someone")
    calls = [
        api.get("/v1/collections/%00"),
        api.get("/v1/collections/c/identities/a%00b"),
        api.get("/v1/collections/c/identities/a%00b/faces"),
        api.get("/v1/collections/c/identities", params={"name": "a\x00"}),
        api.post("/v1/collections/c/identities", json={"external_id": "x\x00", "name": "n"}),
        api.post("/v1/collections/c/identities", json={"external_id": "y", "name": "a\x00b"}),
        api.patch("/v1/collections/c/identities/someone", json={"name": "a\x00b"}),
        api.post("/v1/collections/c/keys", json={"label": "a\x00"}),
        api.delete("/v1/collections/c/identities/%00"),
        api.post("/v1/collections/%00/keys", json={}),
        api.get("/v1/collections/c", key="frk_\x00"),
    ]
    for response in calls:
        assert response.status_code < 500, f"{response.request.url}: {response.status_code} {response.text}"
        if response.status_code >= 400:
            assert set(response.json()) == {"code", "message", "details"}
        if "postgresql" in db_url:
            assert response.status_code in {401, 404, 422}, f"{response.request.url}: {response.text}"
    if "postgresql" in db_url:
        assert api.ok(api.get("/v1/collections/c/identities/someone"))["name"] == ""


def test_too_many_images(small: Api) -> None:
    tiny = encode("PNG")
    details = small.post(
        "/v1/collections/c/identify/batch", files=small.files("images", *[tiny] * (MAX_IMAGES + 1))
    )
    small.error(details, 413, "too_many_images")
    small.error(
        small.post("/v1/collections/c/identify/batch", json={"images": [b64(tiny)] * (MAX_IMAGES + 1)}),
        413,
        "too_many_images",
    )
    small.error(small.enroll("c", "obama", *[tiny] * (MAX_IMAGES + 1)), 413, "too_many_images")
    small.error(small.post("/v1/detect", files=small.files("image", tiny, tiny)), 413, "too_many_images")
    # Far above the limit too (the form parser's own file limit used to answer 400 "http_error").
    for count in (MAX_IMAGES + 2, 10 * MAX_IMAGES):
        many = small.files("images", *[tiny] * count)
        small.error(small.post("/v1/collections/c/identify/batch", files=many), 413, "too_many_images")
        small.error(
            small.post("/v1/collections/c/identities/obama/faces", files=many), 413, "too_many_images"
        )
    small.error(
        small.post("/v1/detect", files=small.files("image", tiny, tiny, tiny)), 413, "too_many_images"
    )
    small.error(
        small.post("/v1/verify", files=small.files("image_a", tiny, tiny) + small.files("image_b", tiny)),
        413,
        "too_many_images",
    )
    small.error(small.post("/v1/collections/c/identify/batch", json={"images": []}), 422, "validation_error")


def test_query_validation(small: Api) -> None:
    for params in (
        {"k": 0},
        {"k": 1000},
        {"k": 101},
        {"k": "many"},
        {"threshold": 2},
        {"threshold": -1.01},
        {"threshold": "high"},
    ):
        for url in ("/v1/collections/c/identify", "/v1/collections/c/identify/batch"):
            details = small.error(
                small.post(url, params=params, json={"image": "x"}), 422, "validation_error"
            )
            assert details["errors"][0]["loc"][0] == "query"
    small.error(small.post("/v1/verify", params={"threshold": 1.5}, json={}), 422, "validation_error")
    small.error(
        small.post(
            "/v1/collections/c/identities/obama/faces",
            params={"create": "perhaps"},
            files=small.files("images", "t1.jpg"),
        ),
        422,
        "validation_error",
    )


def test_top_k_follows_the_max_k_setting(start_api: StartApi) -> None:
    """The k bound is the setting, not a number fixed in the route: above it 422, up to it accepted."""
    wide = start_api(limits={"max_k": 150})
    wide.create_collection("c")
    assert wide.ok(wide.identify("c", "obama.jpg", params={"k": 150}))["faces"][0]["decision"] == "unknown"
    wide.error(wide.identify("c", "obama.jpg", params={"k": 151}), 422, "validation_error")
    wide.close()
    narrow = start_api(limits={"max_k": 7})
    details = narrow.error(narrow.identify("c", "obama.jpg", params={"k": 8}), 422, "validation_error")
    assert details["errors"][0]["loc"] == ["query", "k"]
    narrow.ok(narrow.identify("c", "obama.jpg", params={"k": 7}))


def test_request_timeout(start_api: StartApi) -> None:
    api = start_api(limits={"request_timeout_s": 0.001})
    # The admin key needs no database, so the timeout is reached whatever the route does first.
    response = api.post("/v1/collections/c/identify", files=api.files("image", "obama2.jpg"))
    details = api.error(response, 504, "timeout")
    assert details == {}
    api.error(api.post("/v1/detect", files=api.files("image", "t1.jpg")), 504, "timeout")


def test_request_ids(small: Api) -> None:
    responses = [
        small.client.get("/health/live"),
        small.get("/v1/collections/c"),
        small.get("/v1/collections/nowhere"),
        small.client.get("/v1/collections"),
        small.client.get("/no/such/route"),
        small.client.put("/v1/collections"),
        small.identify("c", "obama.jpg"),
    ]
    ids = [r.headers.get("x-request-id") for r in responses]
    assert all(i and re.fullmatch(r"[0-9a-f]{32}", i) for i in ids), ids
    assert len(set(ids)) == len(ids)
    small.error(responses[4], 404, "not_found")
    small.error(responses[5], 405, "method_not_allowed")

    for incoming in ("abc-123_X.y", "a" * 64):
        assert (
            small.get("/v1/collections/c", headers={"X-Request-ID": incoming}).headers["x-request-id"]
            == incoming
        )
        streamed = small.post(
            "/v1/detect",
            headers={"X-Request-ID": incoming, "Content-Type": "application/json"},
            content=chunks(b"x" * (MAX_BYTES + 1)),
        )
        small.error(streamed, 413, "payload_too_large")
        assert streamed.headers["x-request-id"] == incoming
        declared = small.post(
            "/v1/detect", headers={"X-Request-ID": incoming}, content=b"x" * (MAX_BYTES + 1)
        )
        small.error(declared, 413, "payload_too_large")
        assert declared.headers["x-request-id"] == incoming
    for invalid in ("has space", "a" * 65, "semi;colon", "<script>", ""):
        got = small.get("/v1/collections/c", headers={"X-Request-ID": invalid})
        assert got.headers["x-request-id"] != invalid and re.fullmatch(
            r"[0-9a-f]{32}", got.headers["x-request-id"]
        )
