"""``python -m recognition import --api URL --key KEY``: the same importer (classification, resume by sha256,
bounded concurrency, per-file report, all or nothing per identity) through a deployed stack's REST API,
against the real gateway over HTTP, the real Triton and a real database."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests import ROOT

if TYPE_CHECKING:
    from tests.service.live_fixtures import Live, StartLive

pytest_plugins = ["tests.service.live_fixtures"]

pytestmark = pytest.mark.triton

#: What the local import reports for the same folder (tests/recognition/test_importer.py).
EXPECTED = {"obama.jpg": "imported", "obama2.jpg": "imported", "obama3.jpg": "imported",
            "biden.jpg": "imported", "t1.jpg": "several_faces", "coffee.png": "no_face",
            "broken.jpg": "unreadable"}


@pytest.fixture
def folder(tmp_path: Path, photos: dict[str, Path]) -> Path:
    root = tmp_path / "people"
    layout = {"obama": ["obama.jpg", "obama2.jpg", "obama3.jpg"], "biden": ["biden.jpg"],
              "group": ["t1.jpg"], "empty": ["coffee.png"]}
    for person, names in layout.items():
        (root / person).mkdir(parents=True)
        for name in names:
            shutil.copy(photos[name], root / person / name)
    (root / "empty" / "broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    return root


def gallery_import(live: Live, key: str, *args: str,
                   env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "recognition", "import", "--api", live.base, "--key", key, *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, **(env or {})})


def report(path: Path) -> dict[str, str]:
    with path.open() as handle:
        return {Path(row["path"]).name: row["status"] for row in csv.DictReader(handle)}


def test_import_over_rest(live_api: StartLive, folder: Path, tmp_path: Path, photos: dict[str, Path]) -> None:
    live = live_api()
    result = gallery_import(live, live.admin_key, "--collection", "staff", "--folder", str(folder),
                            "--create-collection", "--concurrency", "3", "--report", str(tmp_path / "r.csv"))
    assert result.returncode == 0, result.stderr
    assert report(tmp_path / "r.csv") == EXPECTED
    assert "imported: 4" in result.stdout and "several_faces: 1" in result.stdout

    identities = live.admin("GET", "/v1/collections/staff/identities")
    assert sorted(i["external_id"] for i in identities["items"]) == ["biden", "obama"]
    assert len(live.admin("GET", "/v1/collections/staff/identities/obama/faces")) == 3
    identify = live.admin("POST", "/v1/collections/staff/identify",
                          files={"image": photos["obama2.jpg"].read_bytes()})
    assert identify["faces"][0]["identity"]["external_id"] == "obama"

    # Resumed by sha256, with a collection key: nothing is imported twice.
    key = live.admin("POST", "/v1/collections/staff/keys", json={"label": "import"})["key"]
    again = gallery_import(live, key, "--collection", "staff", "--folder", str(folder), "--report",
                           str(tmp_path / "again.csv"), "-q")
    assert again.returncode == 0, again.stderr
    statuses = report(tmp_path / "again.csv")
    assert {statuses[n] for n in ("obama.jpg", "obama2.jpg", "obama3.jpg", "biden.jpg")} == {"duplicate"}
    assert len(live.admin("GET", "/v1/collections/staff/identities/obama/faces")) == 3

    # Dry run: classified, nothing written.
    dry = gallery_import(live, key, "--collection", "staff", "--manifest", str(manifest(tmp_path, photos)),
                         "--dry-run", "-q")
    assert dry.returncode == 0 and "ready: 1" in dry.stdout, dry.stdout + dry.stderr
    assert live.admin("GET", "/v1/collections/staff/identities")["total"] == 2


def manifest(tmp_path: Path, photos: dict[str, Path]) -> Path:
    shutil.copy(photos["astronaut.png"], tmp_path / "astronaut.png")
    path = tmp_path / "people.csv"
    path.write_text("path,external_id,name\nastronaut.png,eileen,Eileen Collins\n")
    return path


def test_an_identity_is_all_or_nothing(live_api: StartLive, folder: Path, tmp_path: Path) -> None:
    """The server's own quality gate refuses obama's faces at enrollment: obama is not half enrolled."""
    live = live_api(quality={"min_face_size": 300})  # obama's faces are 229-274 px; the client's gate is 40
    result = gallery_import(live, live.admin_key, "--collection", "staff", "--folder", str(folder),
                            "--create-collection", "-q", "--report", str(tmp_path / "r.json"))
    assert result.returncode == 1  # failed files
    rows = {Path(r["path"]).name: r for r in json.loads((tmp_path / "r.json").read_text())}
    obama = {rows[n]["status"] for n in ("obama.jpg", "obama2.jpg", "obama3.jpg")}
    assert obama == {"failed"} and "low_quality" in rows["obama.jpg"]["detail"]
    live.admin("GET", "/v1/collections/staff")
    identities = live.admin("GET", "/v1/collections/staff/identities")["items"]
    assert "obama" not in {i["external_id"] for i in identities}


def test_bad_key_and_missing_collection(live_api: StartLive, folder: Path) -> None:
    live = live_api()
    refused = gallery_import(live, "frk_wrong", "--collection", "staff", "--folder", str(folder), "-q")
    assert refused.returncode == 2 and "401 unauthorized" in refused.stderr, refused.stderr
    missing = gallery_import(live, live.admin_key, "--collection", "nope", "--folder", str(folder), "-q")
    assert missing.returncode == 2 and "404 not_found" in missing.stderr, missing.stderr
    no_key = subprocess.run([sys.executable, "-m", "recognition", "import", "--api", live.base,
                             "--collection", "x", "--folder", str(folder)], cwd=ROOT, capture_output=True,
                            text=True, timeout=60, check=False)
    assert no_key.returncode == 2 and "--key" in no_key.stderr


def test_api_down_is_one_line_exit_2(folder: Path) -> None:
    down = subprocess.run([sys.executable, "-m", "recognition", "import", "--api", "http://127.0.0.1:1",
                           "--key", "frk_any", "--collection", "staff", "--folder", str(folder), "-q"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert down.returncode == 2 and "cannot reach the API" in down.stderr, down.stderr
    assert "Traceback" not in down.stderr


def test_enroll_calls_fit_the_upload_limit(live_api: StartLive, folder: Path, tmp_path: Path,
                                          photos: dict[str, Path]) -> None:
    """The three obama photos (1.06 MB) need two calls under a 700 kB body limit; a file over the limit is
    reported as such, not sent."""
    live = live_api(limits={"max_upload_bytes": 700_000})
    (folder / "huge").mkdir()
    (folder / "huge" / "huge.jpg").write_bytes(photos["biden.jpg"].read_bytes() + bytes(400_000))
    result = gallery_import(live, live.admin_key, "--collection", "staff", "--folder", str(folder),
                            "--create-collection", "-q", "--report", str(tmp_path / "r.json"),
                            env={"FACEREC_LIMITS__MAX_UPLOAD_BYTES": "700000"})
    rows = {Path(r["path"]).name: r for r in json.loads((tmp_path / "r.json").read_text())}
    assert {name: rows[name]["status"] for name in EXPECTED} == EXPECTED, result.stderr
    assert rows["huge.jpg"]["status"] == "unreadable" and "file too large" in rows["huge.jpg"]["detail"]
    assert result.returncode == 0, result.stderr
    assert len(live.admin("GET", "/v1/collections/staff/identities/obama/faces")) == 3


def test_a_failed_second_call_fails_only_its_files(live_api: StartLive, folder: Path, tmp_path: Path) -> None:
    """Two images per call: obama2.jpg and obama3.jpg (faces of 265 and 274 px) are stored by the first call,
    the server's gate refuses obama9.jpg (229 px) in the second; the report says which were written."""
    (folder / "obama" / "obama.jpg").rename(folder / "obama" / "obama9.jpg")
    live = live_api(quality={"min_face_size": 250})
    result = gallery_import(live, live.admin_key, "--collection", "staff", "--folder", str(folder),
                            "--create-collection", "-q", "--report", str(tmp_path / "r.csv"),
                            env={"FACEREC_LIMITS__MAX_BATCH_IMAGES": "2"})
    assert result.returncode == 1, result.stderr
    statuses = report(tmp_path / "r.csv")
    assert {n: statuses[n] for n in ("obama2.jpg", "obama3.jpg", "obama9.jpg")} == {
        "obama2.jpg": "imported", "obama3.jpg": "imported", "obama9.jpg": "failed"}
    assert len(live.admin("GET", "/v1/collections/staff/identities/obama/faces")) == 2
