"""The gateway's multipart split (service/multipart.py) against Starlette's parser, on bodies encoded by
real clients (httpx, urllib3 as used by requests): wherever the split answers, it says what Starlette
says; and it answers for what those clients send."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
import urllib3
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.datastructures import Headers, UploadFile
from starlette.formparsers import MultiPartParser

from service.multipart import MAX_FIELD_BYTES, boundary_of, split_form

Seen = list[tuple[str, str | None, bytes]]


def starlette_parts(body: bytes, content_type: str) -> Seen:
    async def stream() -> AsyncIterator[bytes]:
        for start in range(0, len(body), 4096):  # chunked, as a server receives it
            yield body[start:start + 4096]

    async def parse() -> Seen:
        form = await MultiPartParser(Headers({"content-type": content_type}), stream(),
                                     max_files=1000, max_fields=1000).parse()
        seen: Seen = []
        for name, value in form.multi_items():
            if isinstance(value, UploadFile):
                seen.append((name, value.filename, await value.read()))
            else:
                seen.append((name, None, value.encode("utf-8")))
        return seen

    return asyncio.run(parse())


def split(body: bytes, content_type: str) -> Seen | None:
    parts = split_form(body, content_type, 1000)
    return None if parts is None else [(p.name, p.filename, p.data) for p in parts]


def httpx_body(files: list[tuple[str, str, bytes]], data: dict[str, str]) -> tuple[bytes, str]:
    request = httpx.Request("POST", "http://x/", files=[(n, (f, d, "image/jpeg")) for n, f, d in files],
                            data=data)
    return request.read(), request.headers["content-type"]


def urllib3_body(files: list[tuple[str, str, bytes]], data: dict[str, str]) -> tuple[bytes, str]:
    fields: list[tuple[str, str | tuple[str, bytes, str]]] = [(n, (f, d, "image/jpeg")) for n, f, d in files]
    fields += list(data.items())
    body, content_type = urllib3.encode_multipart_formdata(fields)
    return body, content_type


#: Names clients send as they are (they escape quotes, backslashes, percent signs and control characters,
#: which the split leaves to Starlette).
names = st.text(st.characters(codec="utf-8", exclude_categories=("Cc", "Cs"), exclude_characters='"\\%'),
                min_size=1, max_size=12)
payloads = st.binary(max_size=3000) | st.sampled_from([b"", b"\r\n", b"--", b"\r\n\r\n--x"])


@settings(max_examples=150, deadline=None)
@given(files=st.lists(st.tuples(names, names, payloads), min_size=1, max_size=3),
       data=st.dictionaries(names, st.text(max_size=40), max_size=3),
       encoder=st.sampled_from([httpx_body, urllib3_body]))
def test_the_split_says_what_starlette_says(files: list[tuple[str, str, bytes]], data: dict[str, str],
                                            encoder: object) -> None:
    body, content_type = encoder(files, data)  # type: ignore[operator]
    fast = split(body, content_type)
    assert fast is not None  # these clients' bodies are plain
    assert fast == starlette_parts(body, content_type)


def test_an_image_upload_is_split() -> None:
    jpeg = b"\xff\xd8\xff" + bytes(range(256)) * 40
    for encoder in (httpx_body, urllib3_body):
        body, content_type = encoder([("image", "obama.jpg", jpeg)], {"k": "5"})
        parts = sorted(split(body, content_type) or [], key=str)
        assert parts == [("image", "obama.jpg", jpeg), ("k", None, b"5")]


#: The start of a plain first part named "a".
A = b'--B\r\nContent-Disposition: form-data; name="a"'


@pytest.mark.parametrize("body, reason", [
    (b"preamble\r\n--B\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\nx\r\n--B--", "preamble"),
    (A + b"\r\nContent-Transfer-Encoding: base64\r\n\r\nx\r\n--B--", "another header"),
    (b"--B\r\nContent-Disposition: form-data; name=a\r\n\r\nx\r\n--B--", "unquoted name"),
    (b"--B\r\nContent-Disposition: form-data; name=\"a%22b\"\r\n\r\nx\r\n--B--", "escaped name"),
    (A + b"; filename*=UTF-8''x.jpg\r\n\r\nx\r\n--B--", "RFC 2231"),
    (A + b"\r\n\r\nx\r\n--B", "no closing delimiter"),
    (A + b"\r\n\r\nx", "cut"),
    (b"--B\r\nContent-Disposition: attachment; name=\"a\"\r\n\r\nx\r\n--B--", "not form-data"),
    (A + b"; name=\"b\"\r\n\r\nx\r\n--B--", "two names"),
    (b'--B\r\nContent-Disposition : form-data; name="a"\r\n\r\nx\r\n--B--', "space before the colon"),
])
def test_anything_unusual_is_left_to_starlette(body: bytes, reason: str) -> None:
    assert split(body, "multipart/form-data; boundary=B") is None, reason


def test_the_content_type_must_be_plain() -> None:
    assert boundary_of("multipart/form-data; boundary=abc") == b"abc"
    assert boundary_of('multipart/form-data; boundary="a b"') == b"a b"
    assert boundary_of("multipart/form-data; boundary=abc; charset=latin-1") is None
    assert boundary_of("multipart/form-data") is None
    assert boundary_of("application/json") is None
    big = A + b"\r\n\r\n" + b"x" * (MAX_FIELD_BYTES + 1) + b"\r\n--B--"
    assert split(big, "multipart/form-data; boundary=B") is None  # Starlette refuses a field this large
    many = b"".join(A + b"\r\n\r\nx\r\n" for _ in range(5)) + b"--B--"
    assert split_form(many, "multipart/form-data; boundary=B", 4) is None
    assert len(split_form(many, "multipart/form-data; boundary=B", 5) or []) == 5
