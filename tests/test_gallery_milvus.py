"""What is particular to the Milvus engine (the real one: milvus-lite 2.4): its recorded position,
erasure with compaction, isolation, re-embedding, settings, and gateways that hold no index.

The behaviour shared with FAISS (search equal to brute force, thresholds, erasure, restarts, SIGKILL
crashes, replicas) runs on both engines in tests/test_gallery_index.py and test_gallery_consistency.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from sqlalchemy import Engine

from facecore.settings import Settings, load_settings
from gallery.gallery import Gallery, open_gallery
from gallery.milvus import MilvusEngine, MilvusIndex
from gallery.store import GalleryStore
from tests.gallery_helpers import MODEL, OTHER_MODEL, assert_gallery_matches_db, new_faces, unit_vectors

pytest_plugins = ["tests.gallery_fixtures"]

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
        engine.client.drop_collection(f"{engine.prefix}_state")


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
    assert isinstance(second._entry("c").index, MilvusIndex)
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


def test_gateways_hold_no_vectors(store: GalleryStore, engines: Any) -> None:
    rng = np.random.default_rng(2)
    store.create_collection("c", MODEL, DIM, 0.5)
    enroll(store, "c", 20, rng)
    gallery = Gallery(store, engine=engines("mem"))
    gallery.load()
    index = gallery._entry("c").index
    assert isinstance(index, MilvusIndex) and len(index) == 40
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

    def compact(self, name: str) -> int:
        self.asked.append(name)
        return 42

    def get_compaction_state(self, job: int) -> str:
        assert job == 42
        return self.states.pop(0)


def test_compaction_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    client = FakeCompactingClient()
    engine = MilvusEngine("", client=client)
    monkeypatch.setattr("gallery.milvus.time.sleep", lambda _s: None)
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
        gallery.engine.client.drop_collection("settings_state")  # type: ignore[attr-defined]
    monkeypatch.setenv("FACEREC_GALLERY__BACKEND", "faiss")
    assert type(open_gallery(store, load_settings(Settings)).engine).__name__ == "FaissEngine"
