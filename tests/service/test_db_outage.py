"""The database going away and coming back under a mixed load, on two real gateways (replicas) and the
session's real Triton.

PostgreSQL: a throwaway cluster of the test's own (``pg_cluster.py``), killed (``pg_ctl stop -m immediate``)
and started again. SQLite: its file on a small tmpfs that the test fills up (as root, permissions alone do
not stop SQLite from writing, and a read-only bind mount reaches only the connections opened after it:
a full filesystem is what fails every write of a running gateway).

While the database is down identify answers from the in-memory indexes, and writes answer 503 with
Retry-After (507 ``storage_full`` on a full disk, until space is freed) within the request timeout;
afterwards every acknowledged enroll and delete is in the database and in both gateways' indexes. The
figures (time from the database's return to the first acknowledged write, to readiness, to both replicas
agreeing with the database) are printed (``-s``) and kept in docs/deploy.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import httpx
import pytest
from sqlalchemy import create_engine, text

from tests.gallery.small_fs import fill, small_filesystem
from tests.service.outage_load import MixedLoad, Outcome
from tests.service.pg_cluster import PgCluster, unavailable

if TYPE_CHECKING:
    from tests.service.live_fixtures import Live, StartLive

pytest_plugins = ["tests.service.live_fixtures"]

pytestmark = pytest.mark.triton

#: The gateways' request timeout: a write that waited for the database longer would be a 504.
TIMEOUT_S = 10.0
WARMUP_S, OUTAGE_S = 1.5, 3.0


class Outage(Protocol):
    @property
    def url(self) -> str: ...

    def begin(self) -> None: ...

    def end(self) -> None: ...


@dataclass
class PgOutage:
    cluster: PgCluster

    @property
    def url(self) -> str:
        return self.cluster.url

    def begin(self) -> None:
        self.cluster.stop("immediate")

    def end(self) -> None:
        self.cluster.start()


@dataclass
class FullDisk:
    folder: Path

    @property
    def url(self) -> str:
        return f"sqlite:///{self.folder / 'gallery.db'}"

    def begin(self) -> None:
        fill(self.folder)

    def end(self) -> None:
        (self.folder / "ballast").unlink()


@pytest.fixture
def pg_cluster() -> Iterator[PgCluster]:
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    cluster = PgCluster.create()
    try:
        yield cluster
    finally:
        cluster.remove()


@pytest.fixture
def small_folder(tmp_path: Path) -> Iterator[Path]:
    """A 16 MB tmpfs for the SQLite file (set up before the gateways, so unmounted after them)."""
    with small_filesystem(tmp_path / "small", "16m") as folder:
        yield folder


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> float:
    """Seconds until ``check()`` held (polled every 50 ms); fails after ``timeout``."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout, f"{what}: not within {timeout} s"
        time.sleep(0.05)
    return time.monotonic() - started


def readiness(live: Live) -> dict[str, bool]:
    checks: dict[str, bool] = httpx.get(live.base + "/health/ready", timeout=10).json()["checks"]
    return checks


def database_faces(url: str) -> dict[int, str]:
    """face id -> its identity's external id, as the database holds them."""
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            rows = connection.execute(text("SELECT faces.id, identities.external_id FROM faces "
                                           "JOIN identities ON identities.id = faces.identity_id"))
            return {int(r[0]): str(r[1]) for r in rows}
    finally:
        engine.dispose()


def database_identities(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            return {str(r[0]) for r in connection.execute(text("SELECT external_id FROM identities"))}
    finally:
        engine.dispose()


def start_pair(live_api: StartLive, url: str, photos: dict[str, bytes]) -> tuple[dict[str, Live], str]:
    """Two gateways on one database, a collection with Obama enrolled, each having identified him once;
    and a key of the collection."""
    gateways = {name: live_api(db_url=url, limits={"request_timeout_s": TIMEOUT_S}) for name in "ab"}
    a = gateways["a"]
    key = a.collection_with_key("c")
    a.admin("POST", "/v1/collections/c/identities/obama/faces", params={"create": "true"},
            files=[("images", ("obama.jpg", photos["obama.jpg"], "image/jpeg"))])
    for live in gateways.values():
        def obama_found(live: Live = live) -> bool:
            body = live.admin("POST", "/v1/collections/c/identify",
                              files=[("image", ("p.jpg", photos["obama2.jpg"], "image/jpeg"))])
            return bool(body["faces"][0]["identity"])
        wait_for(obama_found, 10, "the replica serves the enrolment")
    return gateways, key


def identify_with_key(live: Live, key: str, photos: dict[str, bytes]) -> int:
    return httpx.post(live.base + "/v1/collections/c/identify", headers={"X-API-Key": key}, timeout=30,
                      files=[("image", ("p.jpg", photos["obama2.jpg"], "image/jpeg"))]).status_code


def check_outcomes(outcomes: list[Outcome], down: float, up: float, code: str, status: int) -> None:
    """Identify answered throughout; no write took the request timeout or failed otherwise than with
    ``status``/``code`` (and a Retry-After with a 503), and those entirely within the outage all failed so."""
    identified = [o for o in outcomes if o.op == "identify"]
    assert identified and all(o.status == 200 and o.decision == "obama" for o in identified), \
        [o for o in identified if o.status != 200 or o.decision != "obama"][:5]
    during = [o for o in identified if down <= o.started and o.ended <= up]
    assert len(during) >= 3, f"only {len(during)} identifies during the outage"
    writes = [o for o in outcomes if o.op != "identify"]
    failed = [o for o in writes if not o.ok]
    assert all(o.status == status and o.code == code and (status != 503 or (o.retry_after or "").isdigit())
               for o in failed), sorted({(o.op, o.status, o.code, o.retry_after) for o in failed})
    assert max(o.seconds for o in writes) < TIMEOUT_S - 1
    inside = [o for o in writes if down <= o.started and o.ended <= up]
    assert {o.op for o in inside} >= {"enroll", "create"} and not [o for o in inside if o.ok], inside


def check_acknowledged(outcomes: list[Outcome], url: str, gateways: dict[str, Live]) -> float:
    """Every acknowledged write is in the database, and both indexes hold exactly its faces (seconds the
    replicas took to agree)."""
    deleted = {o.target for o in outcomes if o.op == "delete" and o.ok}
    created = {o.target for o in outcomes if o.op == "create" and o.ok}
    enrolled = {f: o.target for o in outcomes if o.op == "enroll" and o.ok for f in o.face_ids}

    def agree() -> bool:
        truth = set(database_faces(url))
        return all(live.app.state.gallery.face_ids("c") == truth for live in gateways.values())

    converged = wait_for(agree, 15, "both indexes hold the database's faces")
    faces, identities = database_faces(url), database_identities(url)
    assert created - deleted <= identities and not deleted & identities
    kept = {f for f, target in enrolled.items() if target not in deleted}
    assert kept <= faces.keys() and not {f for f, t in enrolled.items() if t in deleted} & faces.keys()
    refused = {o.target for o in outcomes if o.op == "enroll" and o.code == "storage_full"}
    assert not refused & set(faces.values())  # nothing written (a 503 may come after a commit: no check)
    return converged


def run_outage(outage: Outage, live_api: StartLive, photos: dict[str, bytes], status: int, code: str
               ) -> None:
    gateways, key = start_pair(live_api, outage.url, photos)
    a = gateways["a"]
    load = MixedLoad(gateways, "c", photos["obama2.jpg"], photos["biden.jpg"])
    load.start()
    try:
        time.sleep(WARMUP_S)
        assert all(identify_with_key(g, key, photos) == 200 for g in gateways.values())  # now remembered
        outage.begin()
        down = time.monotonic()
        if status == 503:  # a database that does not answer (a full one still reads)
            wait_for(lambda: not readiness(a)["database"], 5, "readiness reports the database down")
            # still ready (identify answers), and a collection key seen before keeps working
            assert httpx.get(a.base + "/health/ready", timeout=10).json()["ready"] is True
            assert all(identify_with_key(g, key, photos) == 200 for g in gateways.values())
        time.sleep(max(0.0, down + OUTAGE_S - time.monotonic()))
        restarting = time.monotonic()  # it may answer before end() returns
        outage.end()
        up = time.monotonic()
        wait_for(lambda: any(o.ok for o in load.since(up, "enroll")), 30, "an enroll is acknowledged again")
        writes = min(o.ended for o in load.since(up) if o.ok and o.op != "identify") - up
        ready = wait_for(lambda: all(all(readiness(g).values()) for g in gateways.values()), 30,
                         "both gateways are ready again")
        assert all(identify_with_key(g, key, photos) == 200 for g in gateways.values())  # the keys' watch
        time.sleep(0.5)
    finally:
        outcomes = load.stop()
    check_outcomes(outcomes, down, restarting, code, status)
    converged = check_acknowledged(outcomes, outage.url, gateways)
    acknowledged = sum(o.ok for o in outcomes if o.op != "identify")
    print(f"\n{type(outage).__name__}: {len(outcomes)} requests, {acknowledged} writes acknowledged, "
          f"{sum(not o.ok for o in outcomes)} refused; after the database's return: first write "
          f"acknowledged in {writes:.2f} s, both ready within {ready:.2f} s more, replicas agreed "
          f"with the database {converged:.2f} s after the load stopped")


def test_a_postgres_outage_under_load(pg_cluster: PgCluster, live_api: StartLive,
                                      photo_bytes: dict[str, bytes]) -> None:
    run_outage(PgOutage(pg_cluster), live_api, photo_bytes, 503, "database_unavailable")


def test_a_full_disk_under_sqlite(small_folder: Path, live_api: StartLive, photo_bytes: dict[str, bytes]
                                  ) -> None:
    run_outage(FullDisk(small_folder), live_api, photo_bytes, 507, "storage_full")
