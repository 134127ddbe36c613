"""Errors every client can read: a 4xx decided before the body was consumed still reads the body (up to
the body-size limit) before answering, so a plain ``urllib`` client sees the error instead of
"connection reset by peer" (issue: 30 photos, 8 MB, to /v1/detect got a 413 that only curl could read).
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from tests.service.live_fixtures import StartLive

pytest_plugins = ["tests.service.live_fixtures"]

NO_TRITON = "127.0.0.1:1"  # these requests are refused before anything reaches Triton


def multipart(field: str, files: list[bytes]) -> tuple[bytes, str]:
    boundary = "readable-errors-boundary"
    parts = [(f"--{boundary}\r\nContent-Disposition: form-data; name=\"{field}\"; filename=\"p{i}.jpg\"\r\n"
              "Content-Type: image/jpeg\r\n\r\n").encode() + data + b"\r\n" for i, data in enumerate(files)]
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def post(url: str, body: bytes, content_type: str, key: str | None) -> tuple[int, dict[str, Any]]:
    """POST with urllib (no retries, no special handling); the status and JSON body of the answer."""
    headers = {"Content-Type": content_type, **({"X-API-Key": key} if key else {})}
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def photos_8mb() -> list[bytes]:
    """30 JPEG-looking uploads of ~300 KB (9 MB in all, under the 10 MiB body limit)."""
    return [b"\xff\xd8\xff\xe0" + os.urandom(300_000) for _ in range(30)]


@pytest.mark.parametrize("repeat", range(3))
def test_too_many_images_is_readable_by_urllib(live_api: StartLive, repeat: int) -> None:
    live = live_api(triton_url=NO_TRITON)
    body, content_type = multipart("image", photos_8mb())
    assert len(body) > 8_000_000
    status, answer = post(f"{live.base}/v1/detect", body, content_type, live.admin_key)
    assert status == 413 and answer["code"] == "too_many_images", answer


def test_missing_key_on_a_large_upload_is_readable_by_urllib(live_api: StartLive) -> None:
    live = live_api(triton_url=NO_TRITON)
    body, content_type = multipart("images", photos_8mb())
    status, answer = post(f"{live.base}/v1/collections/c/identities/x/faces", body, content_type, None)
    assert status == 401 and answer["code"] == "unauthorized", answer


def test_a_body_over_the_limit_is_still_refused(live_api: StartLive) -> None:
    """Draining stops at the limit: a declared oversized body is answered 413 (read up to the limit)."""
    live = live_api(triton_url=NO_TRITON, limits={"max_upload_bytes": 1_000_000})
    body, content_type = multipart("image", [b"\xff\xd8\xff\xe0" + os.urandom(1_500_000)])
    try:
        status, answer = post(f"{live.base}/v1/detect", body, content_type, live.admin_key)
    except (ConnectionError, urllib.error.URLError):  # past the limit a reset is allowed
        return
    assert status == 413 and answer["code"] == "payload_too_large", answer
