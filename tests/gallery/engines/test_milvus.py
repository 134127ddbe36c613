"""What is particular to the Milvus engine (the real one: milvus-lite 2.4): its recorded position,
erasure with compaction, isolation, re-embedding, settings, and gateways that hold no index.

The behaviour shared with FAISS (search equal to brute force, thresholds, erasure, restarts, SIGKILL
crashes, replicas) runs on both engines in tests/gallery/engines/test_index.py and
tests/gallery/test_consistency.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy import Engine

from facecore.settings import Settings, load_settings
from gallery.engines.base import IndexInfo
from gallery.engines.milvus import MilvusEngine, MilvusIndex
from gallery.engines.milvus_lite import MilvusLite
from gallery.gallery import Gallery, open_gallery
from gallery.store.store import GalleryStore
from tests.gallery.helpers import MODEL, OTHER_MODEL, assert_gallery_matches_db, new_faces, unit_vectors

pytest_plugins = ["tests.gallery.fixtures"]

DIM = 16


@pytest.fixture
def engines(milvus_uri: str) -> Any:
    """``engines(prefix)``: MilvusEngines on the session's server; their collections dropped after."""
    made: list[MilvusEngine] = []

    def make(prefix: str) -> MilvusEngine:
        made.append(MilvusEngine(milvus_uri, prefix=prefix))
        return made[-1]

    yield make
    for engine in made:
        engine.prune(set())
        engine.client.drop_collection(engine.state_name)


def enroll(store: GalleryStore, collection: str, people: int, rng: np.random.Generator, dim: int = DIM,
           model: str = MODEL) -> None:
    for number in range(people):
        faces = new_faces(unit_vectors(rng, 2, dim), tag=f"{collection}{number}")
        store.add_faces(collection, f"p{number}", faces, model, create=(f"P{number}", {}))


def test_position_is_recorded_and_a_second_gateway_applies_nothing_twice(store: GalleryStore, engine: Engine,
                                                                           engines: Any) -> None:
    rng = np.random.default_rng(1)
    store.create_collection("c", MODEL, DIM, 0.5)
    enroll(store, "c", 5, rng)
    first, second = Gallery(store, engine=engines("pos")), Gallery(store, engine=engines("pos"))
    first.load()
    assert first.engine.position() == store.last_seq()
    second.load()  # opens the collection the first one built
    assert isinstance(second.replica.entry("c").index, MilvusIndex)
    enroll(store, "c", 3, rng)
    store.delete_identity("c", "p0")
    assert first.sync() > 0 and first.engine.position() == store.last_seq()
    calls: list[object] = []
    original = MilvusIndex.add
    MilvusIndex.add = lambda self, *a: calls.append(a) or original(self, *a)  # type: ignore[method-assign]
    try:
        second.sync()  # it reads the log, finds Milvus already at its end
    finally:
        MilvusIndex.add = original  # type: ignore[method-assign]
    assert calls == []
    assert_gallery_matches_db(second, engine, "c", DIM)


def test_changes_to_a_collection_another_gateway_opened_reach_milvus(store: GalleryStore, engine: Engine,
                                                                      engines: Any) -> None:
    """Gateway ``first`` loaded before collection ``c`` was used, ``second`` opened it in Milvus; ``first``
    applies the enrolment and the erasure that follow. They reach Milvus whichever gateway applies them:
    before, ``first`` skipped ``c`` (not open there) yet recorded the shared position past them, so
    ``second`` never applied them either (the enrolled faces missing, the erased ones found for ever)."""
    rng = np.random.default_rng(10)
    store.create_collection("a", MODEL, DIM, 0.5)
    enroll(store, "a", 2, rng)
    first = Gallery(store, engine=engines("lost"))
    first.load()
    store.create_collection("c", MODEL, DIM, 0.5)
    enroll(store, "c", 3, rng)
    second = Gallery(store, engine=engines("lost"))
    second.load()  # builds c in Milvus
    store.add_faces("c", "late", new_faces(unit_vectors(rng, 2, DIM), tag="late"), MODEL, create=("Late", {}))
    erased = set(store.delete_identity("c", "p1"))
    assert first.sync() > 0 and first.engine.position() == store.last_seq()
    second.sync()
    assert not second.face_ids("c") & erased
    assert_gallery_matches_db(second, engine, "c", DIM)
    assert_gallery_matches_db(first, engine, "c", DIM)


def test_rebuilding_one_collection_applies_the_others_changes(store: GalleryStore, engine: Engine,
                                                              engines: Any) -> None:
    """``python -m gallery rebuild --collection c`` (a gallery that loaded nothing) applies the log from
    Milvus's position: the changes to ``a`` in it reach Milvus too (before, they were skipped and the
    position recorded past them)."""
    rng = np.random.default_rng(11)
    for name in ("a", "c"):
        store.create_collection(name, MODEL, DIM, 0.5)
        enroll(store, name, 3, rng)
    gateway = Gallery(store, engine=engines("cli"))
    gateway.load()
    erased = set(store.delete_identity("a", "p0"))
    store.add_faces("a", "late", new_faces(unit_vectors(rng, 2, DIM), tag="late"), MODEL, create=("Late", {}))
    Gallery(store, engine=engines("cli")).rebuild("c")
    assert gateway.engine.position() == store.last_seq()
    gateway.sync()
    assert not gateway.face_ids("a") & erased
    assert_gallery_matches_db(gateway, engine, "a", DIM)


def test_an_idle_follower_asks_neither_milvus_nor_the_database_lock(store: GalleryStore, engine: Engine,
                                                                   engines: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(7)
    store.create_collection("c", MODEL, DIM, 0.5)
    enroll(store, "c", 3, rng)
    first, second = Gallery(store, engine=engines("idle")), Gallery(store, engine=engines("idle"))
    first.load()
    second.load()
    asked: list[str] = []
    for gallery in (first, second):
        position, exclusive = gallery.engine.position, gallery.store.db.exclusive
        monkeypatch.setattr(gallery.engine, "position", lambda p=position: asked.append("position") or p())
        monkeypatch.setattr(gallery.store.db, "exclusive",
                            lambda key, e=exclusive: asked.append("lock") or e(key))
    for _ in range(5):  # a follower's intervals with nothing new in the log
        assert first.sync() == 0 and second.sync() == 0
    assert asked == []
    enroll(store, "c", 1, rng)  # another process's change: the next interval applies it, through the lock
    assert second.sync() == 2 and "position" in asked and "lock" in asked
    assert second.engine.position() == store.last_seq()
    assert_gallery_matches_db(second, engine, "c", DIM)


def test_a_sync_that_failed_is_run_again_in_full(store: GalleryStore, engine: Engine, engines: Any,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(8)
    store.create_collection("c", MODEL, DIM, 0.5)
    enroll(store, "c", 2, rng)
    gallery = Gallery(store, engine=engines("failed"))
    gallery.load()
    enroll(store, "c", 1, rng)
    record = gallery.engine.record

    def unreachable(seq: int) -> None:
        raise ConnectionError("Milvus went away")

    monkeypatch.setattr(gallery.engine, "record", unreachable)
    with pytest.raises(ConnectionError):
        gallery.sync()  # applied, but Milvus's position not recorded
    monkeypatch.setattr(gallery.engine, "record", record)
    gallery.sync()  # nothing new in the log since, yet the position is recorded now
    assert gallery.engine.position() == store.last_seq()
    assert_gallery_matches_db(gallery, engine, "c", DIM)


def test_an_identify_asks_milvus_one_search_and_no_count(store: GalleryStore, engines: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(9)
    store.create_collection("c", MODEL, DIM, 0.5)
    enroll(store, "c", 12, rng)
    gallery = Gallery(store, engine=engines("calls"))
    gallery.load()
    asked: list[str] = []
    client = gallery.engine.client
    search, query = client.search, client.query
    monkeypatch.setattr(client, "search", lambda *a, **kw: asked.append("search") or search(*a, **kw))
    monkeypatch.setattr(client, "query", lambda *a, **kw: asked.append("query") or query(*a, **kw))
    (result,) = gallery.search("c", unit_vectors(rng, 1, DIM), k=3)
    assert len(result.candidates) == 3 and asked == ["search"]  # the faces found were enough: no count(*)
    asked.clear()
    (result,) = gallery.search("c", unit_vectors(rng, 1, DIM), k=12)  # 24 faces, 12 people: all of them
    assert len(result.candidates) == 12 and asked == ["search"]  # fewer faces came back than asked for


def test_gateways_hold_no_vectors(store: GalleryStore, engines: Any) -> None:
    rng = np.random.default_rng(2)
    store.create_collection("c", MODEL, DIM, 0.5)
    enroll(store, "c", 20, rng)
    gallery = Gallery(store, engine=engines("mem"))
    gallery.load()
    index = gallery.replica.entry("c").index
    assert isinstance(index, MilvusIndex) and len(index) == 40
    # Milvus indexes its segments itself: nothing is chosen again in the background
    assert gallery.describe("c") == (IndexInfo("milvus", "FLAT", faces=40), False)
    held = [value for value in vars(index).values() if isinstance(value, np.ndarray | list | dict | set)]
    assert all(len(v) == 0 for v in held if not isinstance(v, dict)) and not any(
        isinstance(v, np.ndarray) for v in held)


def test_erasure_deletes_then_compacts(store: GalleryStore, engines: Any) -> None:
    rng = np.random.default_rng(3)
    store.create_collection("c", MODEL, DIM, 0.5)
    enroll(store, "c", 4, rng)
    milvus = engines("erase")
    gallery = Gallery(store, engine=milvus)
    gallery.load()
    erased = store.delete_identity("c", "p1")
    gallery.sync()
    assert gallery.snapshot_erasures() == []  # Milvus writes no files
    name = milvus.name(store.get_collection("c").id)
    rows = milvus.client.query(name, filter=f"face_id in {sorted(erased)}", output_fields=["face_id"],
                               consistency_level="Strong")
    assert rows == []
    # milvus-lite has no compaction (UNIMPLEMENTED): asked for, and reported as such
    assert milvus.compactions == [(name, "unsupported by the server")]


class FakeCompactingClient:
    """A stand-in for a Milvus server that does compact (standalone/cluster), for the waiting logic."""

    def __init__(self) -> None:
        self.states = ["Executing", "Executing", "Completed"]
        self.asked: list[str] = []

    def has_collection(self, name: str) -> bool:
        return True

    def list_collections(self) -> list[str]:
        return ["facerec_state"]

    def compact(self, name: str) -> int:
        self.asked.append(name)
        return 42

    def get_compaction_state(self, job: int) -> str:
        assert job == 42
        return self.states.pop(0)


def test_compaction_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    client = FakeCompactingClient()
    engine = MilvusEngine("", client=client)
    monkeypatch.setattr("gallery.engines.milvus.time.sleep", lambda _s: None)
    assert engine.compact("facerec_c1") == "completed"
    assert client.asked == ["facerec_c1"] and client.states == [] and engine.compactions[-1][1] == "completed"


def test_collections_and_deployments_are_isolated(store: GalleryStore, engines: Any) -> None:
    rng = np.random.default_rng(4)
    for name in ("a", "b"):
        store.create_collection(name, MODEL, DIM, 0.5)
        enroll(store, name, 5, rng)
    gallery = Gallery(store, engine=engines("iso"))
    gallery.load()
    b_vectors = np.stack(list(store.vectors(sorted(gallery.face_ids("b")), DIM).values()))
    for result in gallery.search("a", b_vectors, k=20):
        assert {c.face_id for c in result.candidates} <= gallery.face_ids("a")
    other = engines("iso2")  # another deployment on the same server sees none of it
    assert other.position() is None
    assert not [n for n in other.client.list_collections() if n.startswith("iso2_c")]


def test_reembedding_rebuilds_the_milvus_collection(store: GalleryStore, engine: Engine,
                                                    engines: Any) -> None:
    rng = np.random.default_rng(5)
    store.create_collection("c", MODEL, DIM, 0.5)
    enroll(store, "c", 6, rng)
    milvus = engines("reembed")
    gallery = Gallery(store, engine=milvus)
    gallery.load()
    ids, _ = store.stored_crops("c")
    store.replace_embeddings("c", ids, unit_vectors(rng, len(ids), 32), OTHER_MODEL, 32, 0.4)
    gallery.sync()
    assert gallery.collection_info("c").dimension == 32
    described = milvus.client.describe_collection(milvus.name(store.get_collection("c").id))
    vector = next(f for f in described["fields"] if f["name"] == "embedding")
    assert vector["params"]["dim"] == 32
    assert_gallery_matches_db(gallery, engine, "c", 32)
    assert gallery.search("c", unit_vectors(rng, 1, 32), embedding_model=OTHER_MODEL)[0].candidates


def test_settings_select_the_engine(monkeypatch: pytest.MonkeyPatch, store: GalleryStore, milvus_uri: str
                                    ) -> None:
    monkeypatch.setenv("FACEREC_GALLERY__BACKEND", "milvus")
    with pytest.raises(SystemExit, match="FACEREC_GALLERY__MILVUS_URI"):
        load_settings(Settings)
    monkeypatch.setenv("FACEREC_GALLERY__MILVUS_URI", milvus_uri)
    monkeypatch.setenv("FACEREC_GALLERY__MILVUS_PREFIX", "settings")
    monkeypatch.setenv("FACEREC_GALLERY__BATCH_WINDOW_MS", "2")
    settings = load_settings(Settings)
    gallery = open_gallery(store, settings)
    try:
        assert isinstance(gallery.engine, MilvusEngine) and gallery.engine.prefix == "settings"
        assert gallery.batcher.window_s == pytest.approx(0.002)
    finally:
        gallery.engine.client.drop_collection(gallery.engine.state_name)  # type: ignore[attr-defined]
    monkeypatch.setenv("FACEREC_GALLERY__BACKEND", "faiss")
    assert type(open_gallery(store, load_settings(Settings)).engine).__name__ == "FaissEngine"


# --- writes are read back: milvus-lite stamps its inserts ahead of its reads and deletes ------------

#: Rows a refused insert request makes milvus-lite count: its stamps then run 5e6 / 2**18 = 19 ms ahead.
DRIFT_ROWS = 5_000_000


def tiny_collection(client: Any, name: str, key: str) -> None:
    """A collection of an int64 primary key ``key`` and a 2-d vector, Strong consistency."""
    from pymilvus import DataType

    schema = client.create_schema(auto_id=False, enable_dynamic_field=False)
    schema.add_field(key, DataType.INT64, is_primary=True)
    schema.add_field("vector", DataType.FLOAT_VECTOR, dim=2)
    params = client.prepare_index_params()
    params.add_index("vector", index_type="FLAT", metric_type="IP")
    client.create_collection(name, schema=schema, index_params=params, consistency_level="Strong")


def drive_insert_stamps_forward(uri: str, rows: int) -> None:
    """Put a milvus-lite server in the state a long-running one reaches after inserting ``rows`` rows:
    it stamps an insert ``(ms << 18) + rows inserted so far`` and a read or a delete ``ms << 18``.
    Inserting millions of rows takes minutes; one insert request that claims ``rows`` rows and carries
    one is refused, but milvus-lite 2.4 counts the claimed rows before it checks them."""
    from pymilvus import MilvusClient
    from pymilvus.grpc_gen import milvus_pb2, schema_pb2

    client = MilvusClient(uri=uri)
    tiny_collection(client, "drift", "key")
    request = milvus_pb2.InsertRequest(collection_name="drift", num_rows=rows)
    key = request.fields_data.add(field_name="key", type=schema_pb2.DataType.Int64)
    key.scalars.long_data.data.append(1)
    vector = request.fields_data.add(field_name="vector", type=schema_pb2.DataType.FloatVector)
    vector.vectors.dim = 2
    vector.vectors.float_vector.data.extend([0.5, 0.5])
    answer = client._get_connection()._stub.Insert(request)
    assert "num_rows" in answer.status.reason, answer.status  # refused, after counting
    client.drop_collection("drift")
    client.close()


@pytest.fixture(scope="module")
def drifted_milvus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A milvus-lite server whose inserts are stamped ~19 ms ahead of its reads and deletes (the next
    test shows the condition with the plain client)."""
    with MilvusLite(tmp_path_factory.mktemp("drifted") / "milvus.db") as server:
        drive_insert_stamps_forward(server.uri, DRIFT_ROWS)
        yield server.uri


def test_a_drifted_milvus_lite_hides_fresh_inserts_and_loses_early_deletes(drifted_milvus: str) -> None:
    """The server condition the engine is built for, shown with the plain client: the row inserted is
    not read back at once, and a delete sent at once is lost (the row shows later)."""
    from pymilvus import MilvusClient

    client = MilvusClient(uri=drifted_milvus)
    tiny_collection(client, "raw", "face_id")

    def rows() -> list[int]:
        found = client.query("raw", filter="face_id >= 0", output_fields=["face_id"], limit=10,
                             consistency_level="Strong")
        return sorted(int(row["face_id"]) for row in found)

    client.insert("raw", [{"face_id": 7, "vector": [0.1, 0.2]}, {"face_id": 8, "vector": [0.1, 0.2]}])
    assert rows() == []
    client.delete("raw", ids=[7])
    time.sleep(0.2)
    assert rows() == [7, 8]  # the delete is lost
    client.drop_collection("raw")
    client.close()


def test_writes_are_read_back_on_a_drifted_milvus_lite(store: GalleryStore, engine: Engine, tmp_path: Path,
                                                       drifted_milvus: str) -> None:
    """Enrolled faces are found by the search that follows, erased ones never come back, and a restart
    opens what was built (its state row read back): the CI failures of erasure and SIGKILL tests on
    milvus-lite. Failed before writes were read back (the erased faces came back, the search was empty)."""
    rng = np.random.default_rng(6)
    store.create_collection("c", MODEL, DIM, 0.5)
    enroll(store, "c", 4, rng)
    milvus = MilvusEngine(drifted_milvus, prefix="drift")
    gallery = Gallery(store, engine=milvus)
    try:
        gallery.load()
        _, _, enrolled = store.collection_vectors(store.get_collection("c").id, DIM)
        probe = enrolled[:1]
        assert gallery.search("c", probe, k=1)[0].candidates, "the built collection is not searchable"
        faces = new_faces(unit_vectors(rng, 3, DIM), tag="late")
        _, stored = store.add_faces("c", "late", faces, MODEL, create=("Late", {}))
        erased = store.delete_identity("c", "p1")  # an erasure right behind an enrollment
        gallery.sync()
        late = np.stack(list(store.vectors([f.id for f in stored], DIM).values()))
        found = gallery.search("c", late, k=1)
        assert all(r.candidates and r.candidates[0].external_id == "late" for r in found)
        for pause in (0.0, 0.1):
            time.sleep(pause)
            assert not gallery.face_ids("c") & set(erased)
        assert_gallery_matches_db(gallery, engine, "c", DIM)
        reopened = Gallery(store, engine=MilvusEngine(drifted_milvus, prefix="drift"))
        reopened.load()
        assert isinstance(reopened.replica.entry("c").index, MilvusIndex)
        assert_gallery_matches_db(reopened, engine, "c", DIM)
    finally:
        milvus.prune(set())
        milvus.client.drop_collection(milvus.state_name)


class NeverDeletingClient:
    """A server whose deletes never take: the engine must give up with a clear error, not hang."""

    def delete(self, name: str, ids: list[int]) -> None:
        pass

    def query(self, name: str, filter: str, **_: Any) -> list[dict[str, int]]:
        return [{"face_id": 3}]


def test_a_delete_that_never_shows_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("gallery.engines.milvus.VISIBLE_S", 0.05)
    index = MilvusIndex(NeverDeletingClient(), "facerec_c1", DIM, {})
    with pytest.raises(TimeoutError, match="deletion of 1 rows from facerec_c1 within"):
        index.remove(np.array([3]))


class StampingClient:
    """milvus-lite 2.4's stamping rule, for the barrier: an insert is stamped ``now + drift``, a delete and
    a read ``now``; a delete masks the versions of its keys stamped before it; ``drift`` only grows (it
    is the rows inserted so far). Time is this fake's own clock, moved by ``sleep``."""

    def __init__(self) -> None:
        self.now, self.drift = 0.0, 5.0
        self.versions: list[tuple[str, int, float, dict[str, Any]]] = []  # (collection, key, stamp, row)
        self.deletes: list[tuple[str, int, float]] = []

    def sleep(self, seconds: float) -> None:
        self.now += seconds * 1000

    def upsert(self, name: str, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            key = int(row.get("face_id", row.get("key", 0)))
            self.deletes.append((name, key, self.now))
            self.versions.append((name, key, self.now + self.drift, row))

    def delete(self, name: str, ids: list[int]) -> None:
        self.deletes.extend((name, int(key), self.now) for key in ids)

    def _visible(self, name: str) -> list[tuple[int, dict[str, Any]]]:
        return [(key, row) for n, key, stamp, row in self.versions if n == name and stamp <= self.now
                and not any(d == name and k == key and stamp < at <= self.now for d, k, at in self.deletes)]

    def query(self, name: str, filter: str, limit: int = 16_384, **_: Any) -> list[dict[str, Any]]:
        """Every visible version, in write order, up to ``limit`` rows."""
        field, _, value = filter.partition(" in " if " in " in filter else " == ")
        keys = {int(v) for v in value.strip("[]").split(",") if v.strip()}
        return [{field.strip(): key, **row} for key, row in self._visible(name) if key in keys][:limit]

    def has_collection(self, name: str) -> bool:
        return True

    def list_collections(self) -> list[str]:
        return ["facerec_state"]


def test_a_delete_waits_for_a_version_still_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer killed right after its insert (stamped ahead) and the replay of the same add: the replayed
    version is stamped further ahead. The add returns once the first version shows; a delete then masks it
    but not the replayed one, which shows later and stays. The barrier after the delete waits until both
    show, and the delete is repeated. Failed before the barrier (the face came back)."""
    client = StampingClient()
    monkeypatch.setattr("gallery.engines.milvus.time.sleep", client.sleep)
    monkeypatch.setattr("gallery.engines.milvus.time.monotonic", lambda: client.now / 1000)
    engine = MilvusEngine("", client=client)
    index = MilvusIndex(client, "facerec_c1", 2, {}, engine.barrier)
    killed = {"face_id": 9, "identity_id": 1, "embedding": [0.0, 1.0]}
    client.upsert("facerec_c1", [killed])  # the killed writer's insert, stamped ahead
    client.drift = 40.0  # the rows inserted since: the replay is stamped further ahead
    index.add(np.array([9]), np.array([1]), np.array([[0.0, 1.0]], np.float32))
    index.remove(np.array([9]))
    client.sleep(1.0)
    assert index.present([9]) == set()


def test_two_versions_of_a_row_do_not_hide_another_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """A replayed add of a face whose killed writer's insert was still ahead leaves two versions of it;
    the read-back of that add and of a second face must still find the second (failed when the
    read-back asked for one row per face: it timed out)."""
    client = StampingClient()
    monkeypatch.setattr("gallery.engines.milvus.time.sleep", client.sleep)
    monkeypatch.setattr("gallery.engines.milvus.time.monotonic", lambda: client.now / 1000)
    index = MilvusIndex(client, "facerec_c1", 2, {})
    client.upsert("facerec_c1", [{"face_id": 9, "identity_id": 1, "embedding": [0.0, 1.0]}])
    index.add(np.array([9, 10]), np.array([1, 2]), np.array([[0.0, 1.0], [1.0, 0.0]], np.float32))
    assert index.present([9, 10]) == {9, 10}
    assert [row["face_id"] for row in client.query("facerec_c1", "face_id in [9, 10]")] == [9, 9, 10]


def test_a_name_milvus_lite_cannot_index_gets_a_variant(milvus_uri: str) -> None:
    """milvus-lite writes an index description into SQL unescaped: under some names (about 1 in 128, always
    the same) creating the index fails with "internal error". ``t1f1e88d5_c8`` is one (it failed a CI
    run); the engine builds, finds, opens and prunes the collection under a variant of it. Failed before."""
    from datetime import UTC, datetime

    from gallery.store.store import CollectionInfo

    engine = MilvusEngine(milvus_uri, prefix="t1f1e88d5")
    info = CollectionInfo(8, "c", MODEL, DIM, 0.5, False, datetime.now(UTC))
    vectors = unit_vectors(np.random.default_rng(7), 3, DIM)
    try:
        index = engine.build(info, np.array([1, 2, 3]), np.array([1, 1, 2]), vectors)
        assert index.name == "t1f1e88d5_c8v1" and engine.name(8) == index.name
        _, ids, owners = index.search(vectors[:1], 1)
        assert ids[0, 0] == 1 and owners[0, 0] == 1
        opened = MilvusEngine(milvus_uri, prefix="t1f1e88d5").open(info, lambda: (np.zeros(0), np.zeros(0)))
        assert opened is not None and opened[0].name == index.name
        engine.prune(set())
        assert not [n for n in engine.client.list_collections() if n.startswith("t1f1e88d5_c")]
    finally:
        engine.prune(set())
        engine.client.drop_collection(engine.state_name)
