"""The web demo at ``/``: served assets (no Triton), and an end-to-end run in headless Chromium.

The end-to-end test starts the real gateway with uvicorn in a thread (real Triton, temporary SQLite
database), then drives Debian's Chromium through Playwright: upload, box, enroll by clicking the
face, identify, delete, identify again. It asserts on DOM text (``data-testid``), never on pixels,
and keeps two screenshots and the step timings in ``artifacts/test-output/``.

Needs ``/usr/bin/chromium`` (``apt-get install chromium``) and ``pip install playwright``; the
browser bundled by ``playwright install`` is not used. Without them the test fails (CI installs them).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient

from facecore.settings import (
    DatabaseSettings,
    GallerySettings,
    GatewaySettings,
    SecuritySettings,
    TritonSettings,
)
from service.app import create_app
from tests import ROOT
from tests.conftest import ARTIFACTS, free_ports

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
OUTPUT = ARTIFACTS / "test-output"
STATIC = ROOT / "service" / "static"
ADMIN_KEY = "demo-admin-key-for-tests-0123456789"
COLLECTION = "demo"
TIMEOUT_MS = 60_000


def settings_for(tmp_path: Path, triton_url: str = "127.0.0.1:1") -> GatewaySettings:
    return GatewaySettings(triton=TritonSettings(url=triton_url),
                    database=DatabaseSettings(url=f"sqlite:///{tmp_path / 'gallery.db'}"),
                    gallery=GallerySettings(snapshot_dir=tmp_path / "index"),
                    security=SecuritySettings(admin_key=ADMIN_KEY),  # type: ignore[arg-type]
                    log_json=False)


# ------------------------------------------------------------------ the page and its assets (no Triton)

def test_page_and_assets_are_served_without_auth(tmp_path: Path) -> None:
    client = TestClient(create_app(settings_for(tmp_path)))  # no lifespan: these routes need no clients
    page = client.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert '<script type="module" src="/static/demo.js">' in page.text
    for name, media in (("demo.js", "javascript"), ("demo.css", "text/css"), ("index.html", "text/html")):
        asset = client.get(f"/static/{name}")
        assert asset.status_code == 200, name
        assert media in asset.headers["content-type"]
        assert asset.headers["x-content-type-options"] == "nosniff"


@pytest.mark.parametrize("path", ["/static/nope.js", "/static/..%2Fapp.py", "/static/../app.py",
                                  "/static/%2E%2E/routers/demo.py", "/static/"])
def test_only_the_static_files_are_served(tmp_path: Path, path: str) -> None:
    client = TestClient(create_app(settings_for(tmp_path)))
    response = client.get(path)
    assert response.status_code == 404
    assert response.json()["code"] == "not_found"


def test_demo_routes_are_not_in_the_openapi_schema(tmp_path: Path) -> None:
    paths = create_app(settings_for(tmp_path)).openapi()["paths"]
    assert "/" not in paths
    assert not [p for p in paths if p.startswith("/static")]


def test_the_page_fetches_nothing_from_elsewhere() -> None:
    for path in STATIC.iterdir():
        text = path.read_text(encoding="utf-8")
        assert not re.findall(r"(?:src|href)\s*=\s*[\"']?(?:https?:)?//", text), path.name
        assert not re.findall(r"url\(\s*[\"']?(?:https?:)?//", text), path.name
        assert not re.findall(r"@import", text), path.name


# ------------------------------------------------------------------ end to end in Chromium

@pytest.fixture
def gateway(triton: Any, tmp_path: Path) -> Iterator[str]:
    """The real gateway on a free port, served by uvicorn in a thread."""
    port = free_ports(1)[0]
    app = create_app(settings_for(tmp_path, triton.grpc_url))
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="demo-gateway", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            pytest.fail("the gateway did not start (see the log above)")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def require_browser() -> None:
    """Fail (not skip) with the fix when Chromium or Playwright is missing: CI installs both."""
    if not CHROMIUM.is_file():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's Chromium with "
                    "`apt-get install -y chromium chromium-driver` (the demo browser test drives it through "
                    "Playwright; `playwright install` is not used)", pytrace=False)
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.fail("Playwright for Python is missing: `pip install playwright` (its driver ships in the "
                    "wheel; do not run `playwright install`, the test uses /usr/bin/chromium)", pytrace=False)


class Steps:
    """Wall time of each step, written next to the screenshots."""

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}
        self._last = time.perf_counter()

    def done(self, name: str) -> None:
        now = time.perf_counter()
        self.timings[name] = round(now - self._last, 3)
        self._last = now


@pytest.mark.triton
def test_demo_enroll_identify_delete_in_chromium(request: pytest.FixtureRequest,
                                                 photos: dict[str, Path]) -> None:
    require_browser()  # before Triton starts: a missing browser fails fast
    from playwright.sync_api import Route, expect, sync_playwright

    steps = Steps()
    base = request.getfixturevalue("gateway")
    steps.done("gateway_start")
    admin = {"X-API-Key": ADMIN_KEY}
    with httpx.Client(base_url=base, headers=admin, timeout=30) as api:
        api.post("/v1/collections", json={"name": COLLECTION}).raise_for_status()
        created = api.post(f"/v1/collections/{COLLECTION}/keys", json={"label": "browser"})
        created.raise_for_status()
        collection_key = created.json()["key"]
    OUTPUT.mkdir(parents=True, exist_ok=True)

    page_errors: list[str] = []
    console_errors: list[str] = []
    foreign: list[str] = []
    origin = urlsplit(base).netloc

    def local_only(route: Route) -> None:
        url = urlsplit(route.request.url)
        if url.scheme in ("http", "https", "ws", "wss") and url.netloc != origin:
            foreign.append(route.request.url)
            route.abort()
        else:
            route.continue_()

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 1000}, service_workers="block")
            context.route("**/*", local_only)
            page = context.new_page()
            page.set_default_timeout(TIMEOUT_MS)
            expect.set_options(timeout=TIMEOUT_MS)
            page.on("pageerror", lambda exc: page_errors.append(str(exc)))
            page.on("console", lambda msg: console_errors.append(msg.text) if msg.type == "error" else None)
            page.on("dialog", lambda dialog: dialog.accept())  # "Delete ... ?" confirmation

            page.goto(f"{base}/")
            expect(page).to_have_title("facerec-triton demo")
            page.get_by_label("Collection", exact=True).fill(COLLECTION)
            key_field = page.get_by_label("API key", exact=True)
            key_field.fill("frk_not_a_key")  # API errors are shown as they come: status, code, message
            key_field.press("Enter")
            error = page.get_by_test_id("error")
            expect(error.get_by_test_id("error-code")).to_have_text("401 unauthorized")
            expect(error.get_by_test_id("error-message")).to_have_text("the API key is not valid")
            key_field.fill(collection_key)
            key_field.press("Enter")
            error.get_by_role("button", name="Dismiss").click()
            expect(error).to_be_hidden()
            expect(page.get_by_test_id("identities-count")).to_have_text(f"0 in {COLLECTION}")
            stored = page.evaluate("[localStorage.getItem('facerec.demo.collection'), "
                                   "localStorage.getItem('facerec.demo.apiKey')]")
            assert stored == [COLLECTION, collection_key]
            steps.done("page_load")

            result = page.get_by_test_id("result")
            faces = page.get_by_test_id("face")
            names = page.get_by_test_id("face-name")

            # 1. obama.jpg: one face, nobody enrolled yet
            page.get_by_test_id("file").set_input_files(photos["obama.jpg"])
            expect(result).to_have_attribute("data-state", "done")
            expect(faces).to_have_count(1)
            expect(names).to_have_text(["unknown"])
            steps.done("identify_unknown")

            # 2. click the box on the canvas, enroll it as a new identity
            canvas = page.get_by_test_id("canvas")
            x1, y1, x2, y2 = (float(v) for v in str(faces.first.get_attribute("data-box")).split(","))
            width = float(str(result.get_attribute("data-width")))
            height = float(str(result.get_attribute("data-height")))
            shown = canvas.bounding_box()
            assert shown is not None
            canvas.click(position={"x": (x1 + x2) / 2 / width * shown["width"],
                                   "y": (y1 + y2) / 2 / height * shown["height"]})
            form = page.get_by_test_id("enroll-form")
            expect(form).to_be_visible()
            expect(page.get_by_test_id("face-button")).to_have_attribute("aria-pressed", "true")
            page.get_by_label("Name", exact=True).fill("Barack Obama")
            page.screenshot(path=OUTPUT / "demo-enroll.png", full_page=True)
            form.get_by_role("button", name="Enroll").click()
            expect(page.get_by_test_id("identity-name")).to_have_text(["Barack Obama"])
            expect(page.get_by_test_id("identities-count")).to_have_text(f"1 in {COLLECTION}")
            expect(page.get_by_test_id("status")).to_contain_text("as Barack Obama")
            expect(form).to_be_hidden()
            expect(names).to_have_text(["Barack Obama"])  # the photo is identified again after enrolling
            steps.done("enroll")

            # 3. another photo of him: labelled with his name and a score
            page.get_by_test_id("file").set_input_files(photos["obama2.jpg"])
            expect(result).to_have_attribute("data-image", "obama2.jpg")
            expect(result).to_have_attribute("data-state", "done")
            match = faces.filter(has=page.locator("[data-testid=face-name]", has_text="Barack Obama"))
            expect(match).to_have_count(1)
            expect(match.get_by_test_id("face-score")).to_have_text(re.compile(r"^(0\.\d\d|1\.00)$"))
            expect(match).to_have_attribute("data-decision", "match")
            expect(match.get_by_test_id("face-detail")).to_contain_text("id barack-obama")
            expect(error).to_be_hidden()
            page.screenshot(path=OUTPUT / "demo-labelled.png", full_page=True)
            steps.done("identify_match")

            # 4. delete him from the list, then the same photo is unknown
            page.get_by_role("button", name="Delete Barack Obama").click()
            expect(page.get_by_test_id("identity")).to_have_count(0)
            expect(page.get_by_test_id("identities-count")).to_have_text(f"0 in {COLLECTION}")
            expect(page.get_by_test_id("status")).to_contain_text("Deleted Barack Obama")
            steps.done("delete")
            page.get_by_test_id("file").set_input_files(photos["obama2.jpg"])
            expect(result).to_have_attribute("data-state", "done")
            expect(faces).not_to_have_count(0)
            expect(names).to_have_text(["unknown"] * faces.count())
            expect(faces.filter(has_text="Barack Obama")).to_have_count(0)
            expect(error).to_be_hidden()
            page.screenshot(path=OUTPUT / "demo-final.png", full_page=True)
            steps.done("identify_after_delete")
        finally:
            print(f"page errors: {page_errors}\nconsole: {console_errors}\nforeign requests: {foreign}")
            browser.close()

    (OUTPUT / "demo-timings.json").write_text(json.dumps(steps.timings, indent=1) + "\n")
    assert not page_errors, page_errors
    unexpected = [m for m in console_errors if "status of 401" not in m]  # the bad key, on purpose
    assert not unexpected, unexpected
    assert not foreign, f"the page fetched from elsewhere: {foreign}"
