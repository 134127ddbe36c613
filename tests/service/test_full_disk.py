"""The gateway's snapshots on a filesystem that fills up (a 2 MB tmpfs under its snapshot folder): it keeps
answering, the failures are logged, the snapshot on disk stays the last whole one, the next one succeeds
once space returns, and a shutdown on a full disk still closes the gateway's clients.

(The database's own disk full, crops included (they are stored in the database): test_db_outage.py.)
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.gallery.small_fs import fill, small_filesystem

if TYPE_CHECKING:
    from tests.service.fixtures import Api, StartApi

pytest_plugins = ["tests.service.fixtures"]

pytestmark = pytest.mark.triton


@pytest.fixture
def small_folder(tmp_path: Path) -> Iterator[Path]:
    """Set up before the gateway (so unmounted after it)."""
    with small_filesystem(tmp_path / "index", "2m") as folder:
        yield folder


def snapshot_seq(folder: Path) -> int:
    """The change-log position of the collection's snapshot on disk (-1: none yet)."""
    found = list(folder.glob("collection-*.json"))
    return int(json.loads(found[0].read_text())["seq"]) if found else -1


def wait_for_snapshot(api: Api, folder: Path, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while snapshot_seq(folder) != api.app.state.store.last_seq():
        assert time.monotonic() < deadline, "no snapshot of the database's last change"
        time.sleep(0.05)


def snapshot_failures(caplog: pytest.LogCaptureFixture) -> int:
    return sum(r.name == "service.app" and r.levelno >= logging.ERROR for r in caplog.records)


def test_the_gateway_answers_while_its_snapshots_hit_a_full_disk(small_folder: Path, start_api: StartApi,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    api = start_api(gallery={"snapshot_dir": small_folder, "snapshot_interval_s": 0.5,
                             "erasure_snapshot_delay_s": 0.1})
    api.create_collection("c")
    for person, photo in (("obama", "obama.jpg"), ("biden", "biden.jpg")):
        api.ok(api.enroll("c", person, photo, params={"create": "true"}), 201)
    wait_for_snapshot(api, small_folder)
    ballast = fill(small_folder)
    kept = snapshot_seq(small_folder)

    api.ok(api.delete("/v1/collections/c/identities/biden"), 204)
    api.ok(api.enroll("c", "obama", "obama3.jpg"), 201)
    deadline = time.monotonic() + 1.5  # three full snapshots' time, and the erasure's
    while time.monotonic() < deadline:
        matched = api.ok(api.identify("c", "obama2.jpg"))["faces"][0]["identity"]
        assert matched["external_id"] == "obama"
    assert snapshot_failures(caplog) >= 2
    assert snapshot_seq(small_folder) == kept and not list(small_folder.glob("*.partial"))

    ballast.unlink()
    wait_for_snapshot(api, small_folder)  # the next one succeeds

    fill(small_folder)
    failures = snapshot_failures(caplog)
    api.close()  # its last snapshot fails: logged, and the clients are closed all the same
    assert snapshot_failures(caplog) > failures
    assert api.app.state.store.db.engine.pool.checkedin() == 0  # disposed
