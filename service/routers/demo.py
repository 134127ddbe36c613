"""The web demo: ``GET /`` serves ``service/static/index.html``, ``GET /static/<file>`` its assets.

The page is plain HTML, JavaScript and CSS (no build step, nothing fetched from elsewhere). It needs no
authentication itself: the API calls it makes carry the key typed into the page. Only the files that
are in ``service/static/`` when the module is imported are served (a fixed allow-list, so no path can
reach outside the folder), and none of these routes appears in the OpenAPI schema.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from service.errors import ApiError

STATIC = Path(__file__).resolve().parent.parent / "static"
# A wheel built without the static files only loses the demo (404s), not the API.
ASSETS: dict[str, Path] = {p.name: p for p in sorted(STATIC.iterdir() if STATIC.is_dir() else ())
                           if p.is_file() and not p.name.startswith(".")}

# The page talks to the API base typed into it (same origin by default), so connect-src stays open;
# scripts, styles and images come only from this origin (images also from blob: for the photo).
_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' blob: data:; "
        "media-src 'self' blob: mediastream:; connect-src 'self' http: https:; object-src 'none'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_HEADERS = {"Content-Security-Policy": _CSP, "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}

router = APIRouter(include_in_schema=False)


@router.get("/", include_in_schema=False)
async def index() -> FileResponse:
    return _serve("index.html", "text/html; charset=utf-8")


@router.get("/static/{name}", include_in_schema=False)
async def asset(name: str) -> FileResponse:
    return _serve(name)


def _serve(name: str, media_type: str | None = None) -> FileResponse:
    path = ASSETS.get(name)
    if path is None:
        raise ApiError(f"no static file {name!r}", code="not_found", status=404)
    return FileResponse(path, media_type=media_type, headers=_HEADERS)
