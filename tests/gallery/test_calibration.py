"""A collection's match policy (``gallery.calibration``, ``gallery.store.policies``,
``gallery.recalibration``): a fixed threshold, or one derived for a false-positive identification rate at
the collection's size from the model's reference or the collection's own cross-identity scores, measured
in the background and followed by every replica. Real SQLite and PostgreSQL, FAISS and Milvus."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from sqlalchemy import text

from facecore.scores import ScoreTail, expected_fpir, threshold_for
from gallery.calibration import MIN_PAIRS, cross_identity_tail, decide, one_to_one, refit_due
from gallery.store.db import Database, create_db_engine, migrate
from gallery.store.models import ChangeOp
from gallery.store.store import GalleryStore
from tests.gallery.helpers import MODEL, GalleryFactory, new_faces

pytest_plugins = ["tests.gallery.fixtures"]

DIM = 32


def reference(mean: float = 0.1, sd: float = 0.1, seed: int = 1) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    tail = ScoreTail.from_scores(rng.normal(mean, sd, 20_000))
    return {"impostor": tail.to_dict(), "genuine": {"mean": 0.75, "sd": 0.1, "pairs": 50}}


def people(rng: np.random.Generator, identities: int, faces: int, spread: float = 0.3) -> np.ndarray:
    """``identities`` random centres with ``faces`` noisy faces each, [identities, faces, DIM]."""
    centres = rng.standard_normal((identities, 1, DIM))
    vectors = centres + spread * rng.standard_normal((identities, faces, DIM))
    return (vectors / np.linalg.norm(vectors, axis=2, keepdims=True)).astype(np.float32)


def enroll(store: GalleryStore, collection: str, vectors: np.ndarray) -> None:
    for number, faces in enumerate(vectors):
        store.add_faces(collection, f"p{number}", new_faces(faces, tag=f"{collection}{number}"), MODEL,
                        create=("", {}))


def test_a_fixed_policy_decides_at_its_threshold_and_says_what_that_lets_through(
        store: GalleryStore) -> None:
    info = store.create_collection("fixed", MODEL, DIM, 0.363)
    ref = reference()
    small, large = decide(info, 10, ref), decide(info, 100_000, ref)
    assert (small.policy, small.threshold, small.basis) == ("fixed", 0.363, "fixed")
    assert large.threshold == 0.363  # decisions identical to a fixed threshold's, whatever the size
    tail = ScoreTail.from_dict(ref["impostor"])
    assert small.expected_fpir == pytest.approx(expected_fpir(tail, 0.363, 10))
    assert large.expected_fpir is not None and large.expected_fpir > 0.5
    assert large.warning is not None and "fixed threshold" in large.warning and small.warning is None


def test_an_fpir_policy_derives_its_threshold_for_the_collections_size(store: GalleryStore) -> None:
    info = store.create_collection("door", MODEL, DIM, 0.3, target_fpir=0.01)
    assert (info.match_policy, info.target_fpir) == ("fpir", 0.01)
    ref = reference()
    tail = ScoreTail.from_dict(ref["impostor"])
    thresholds = []
    for faces in (10, 1_000, 100_000):
        decision = decide(info, faces, ref)
        assert decision.basis == "reference"
        assert decision.threshold == pytest.approx(threshold_for(tail, 0.01, faces))
        assert decision.expected_fpir == pytest.approx(0.01, rel=1e-6)
        assert decision.confidence(0.0) < 0.01 < decision.confidence(decision.threshold) < 0.999
        assert decision.confidence(0.95) == 0.9999  # never a certainty
        thresholds.append(decision.threshold)
    assert thresholds == sorted(thresholds)
    floored = decide(replace(info, match_threshold=0.9), 10, ref)
    assert floored.threshold == 0.9  # never below the collection's floor
    without = decide(info, 10, {})  # a model with no score reference: its fixed threshold, said so
    assert without.threshold == 0.3 and without.warning is not None
    assert "no impostor score model" in without.warning
    assert 0.49 < without.confidence(0.3) < 0.51  # the stand-in logistic


def test_a_weak_model_says_it_cannot_keep_the_target_usefully(store: GalleryStore) -> None:
    info = store.create_collection("weak", MODEL, DIM, 0.3, target_fpir=0.001)
    weak = reference(mean=0.4, sd=0.15)  # impostors that look like the genuine scores (mean 0.75)
    decision = decide(info, 1_000_000, weak)
    assert decision.genuine_rejected is not None and decision.genuine_rejected > 0.5
    assert decision.warning is not None and "rejects about" in decision.warning


def test_the_collections_own_scores_replace_the_reference(store: GalleryStore) -> None:
    info = store.create_collection("own", MODEL, DIM, 0.0, target_fpir=0.01)
    rng = np.random.default_rng(3)
    vectors = people(rng, 60, 3)
    identities = np.repeat(np.arange(60), 3)
    tail = cross_identity_tail(identities, vectors.reshape(-1, DIM))
    assert tail is not None and tail.pairs == (180 * 179 // 2) - 60 * 3  # every cross-identity pair once
    measured = replace(info, calibration={"impostor": tail.to_dict(), "faces": 180})
    decision = decide(measured, 180, reference(mean=0.5))
    assert decision.basis == "collection"
    assert decision.threshold == pytest.approx(threshold_for(tail, 0.01, 180))


def test_cross_identity_scores_leave_out_each_identitys_own_faces() -> None:
    """Two identities whose faces are alike within and orthogonal across: their cross-identity tail holds
    no genuine score (a tail with the same-identity pairs in it would reach 1)."""
    basis = np.eye(DIM, dtype=np.float32)
    faces = np.concatenate([np.repeat(basis[i:i + 1], 30, axis=0) for i in range(30)])
    identities = np.repeat(np.arange(30), 30)
    tail = cross_identity_tail(identities, faces)
    assert tail is not None and tail.score_at(0.5 / tail.pairs) < 0.01
    assert cross_identity_tail(np.zeros(100, np.int64), faces[:100]) is None  # one identity: no pairs
    sampled = cross_identity_tail(identities, faces, max_pairs=12_000)
    assert sampled is not None and sampled.pairs < 30 * 30 * 30 * 30 / 2


def test_one_to_one_decisions_count_the_faces_compared(store: GalleryStore) -> None:
    ref = reference()
    one, twenty = one_to_one(0.363, ref), one_to_one(0.363, ref, 20)
    assert one.threshold == twenty.threshold == 0.363
    assert one.expected_fpir is not None and twenty.expected_fpir is not None
    assert twenty.expected_fpir > 10 * one.expected_fpir
    assert one.confidence(0.45) > twenty.confidence(0.45)


def test_policies_are_stored_logged_and_followed_by_replicas(store: GalleryStore,
                                                             make_gallery: GalleryFactory) -> None:
    store.create_collection("c", MODEL, DIM, 0.363)
    enroll(store, "c", people(np.random.default_rng(4), 3, 1))
    writer, replica = make_gallery(store), make_gallery(store)
    writer.load()
    replica.load()
    assert replica.decision("c", reference()).policy == "fixed"
    updated = writer.policies.set_policy("c", 0.001)
    assert (updated.match_policy, updated.target_fpir, updated.match_threshold) == ("fpir", 0.001, 0.363)
    assert store.changes_since(0)[-1].op is ChangeOp.POLICY
    replica.sync()
    decided = replica.decision("c", reference())
    assert (decided.policy, decided.target_fpir) == ("fpir", 0.001)
    writer.policies.set_policy("c", None, 0.5)
    replica.sync()
    assert replica.decision("c", reference()).threshold == 0.5
    with pytest.raises(ValueError):
        writer.policies.set_policy("c", 0.9)


def test_a_growing_collection_measures_its_own_scores_in_the_background(
        store: GalleryStore, make_gallery: GalleryFactory) -> None:
    store.create_collection("grow", MODEL, DIM, 0.0, target_fpir=0.01)
    gallery, replica = make_gallery(store), make_gallery(store)
    gallery.load()
    replica.load()
    rng = np.random.default_rng(7)
    enroll(store, "grow", people(rng, 2, 30))  # 60 faces, 900 cross-identity pairs: too few
    gallery.sync()
    gallery.join_reselections(60)
    info = store.get_collection("grow")
    assert info.calibration == {"faces": 60}  # measured: too few pairs, so the reference decides
    assert gallery.decision("grow", reference()).basis == "reference"
    assert not refit_due(info, 60) and not refit_due(info, 89) and refit_due(info, 90)
    enroll(store, "grow", people(rng, 40, 1))  # 100 faces
    gallery.sync()
    gallery.join_reselections(60)
    info = store.get_collection("grow")
    assert info.calibration is not None and info.calibration["faces"] == 100
    assert info.calibration["impostor"]["pairs"] >= MIN_PAIRS
    replica.sync()
    mine, theirs = gallery.decision("grow", reference()), replica.decision("grow", reference())
    assert mine.basis == theirs.basis == "collection" and mine.threshold == theirs.threshold


def test_a_reembedded_collection_forgets_its_measured_scores(store: GalleryStore) -> None:
    store.create_collection("r", MODEL, DIM, 0.4, target_fpir=0.01)
    enroll(store, "r", people(np.random.default_rng(8), 2, 1))
    owner = store.get_collection("r")
    from gallery.store.policies import CollectionPolicies

    assert CollectionPolicies(store.db).save_calibration(owner.id, MODEL, {"faces": 2})
    assert not CollectionPolicies(store.db).save_calibration(owner.id, "another-model", {"faces": 3})
    ids, _, vectors = store.collection_vectors(owner.id, DIM)
    store.replace_embeddings("r", ids.tolist(), vectors, "model-v2", DIM, 0.5)
    assert store.get_collection("r").calibration is None


def test_collections_that_existed_keep_their_fixed_threshold_after_the_upgrade(db_url: str) -> None:
    """The migration gives every collection created before it the fixed policy: decisions do not change."""
    engine = create_db_engine(db_url)
    try:
        migrate(engine, "0002")
        with engine.begin() as connection:
            connection.execute(text("INSERT INTO collections (name, embedding_model, dimension, "
                                    "match_threshold, keep_crops, created_at) VALUES ('old', :model, 128, "
                                    "0.363, true, CURRENT_TIMESTAMP)"), {"model": MODEL})
        migrate(engine)
        info = GalleryStore(Database(engine)).get_collection("old")
        assert (info.match_policy, info.target_fpir, info.calibration, info.match_threshold) == (
            "fixed", None, None, 0.363)
    finally:
        engine.dispose()


def test_the_command_line_creates_each_policy_and_shows_it(tmp_path: Any, capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    from gallery.__main__ import main as gallery_main

    url = f"sqlite:///{tmp_path / 'cli.db'}"
    common = ["--database-url", url, "create-collection", "--model", MODEL, "--dimension", str(DIM)]
    assert gallery_main([*common, "default", "--threshold", "0.3", "--fpir", "0.01"]) == 0
    assert gallery_main([*common, "fixed", "--threshold", "0.4"]) == 0
    assert gallery_main([*common, "zero", "--threshold", "0.4", "--fpir", "0"]) == 0
    out = capsys.readouterr().out
    assert "default: test-model-v1, 32-d, at most 1 % of strangers matched" in out
    assert "fixed: test-model-v1, 32-d, fixed threshold 0.4" in out
    store = GalleryStore(Database(create_db_engine(url)))
    assert [(c.name, c.match_policy, c.target_fpir) for c in store.list_collections()] == [
        ("default", "fpir", 0.01), ("fixed", "fixed", None), ("zero", "fixed", None)]
    assert gallery_main(["--database-url", url, "--snapshot-dir", str(tmp_path / "index"), "stats"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("default\t") and "of strangers matched" in line for line in lines), lines


def test_a_sampled_tail_is_close_to_every_pairs_tail() -> None:
    """Beyond the pair budget, a square sample of faces against faces measures the tail every pair gives:
    look-alike groups (a fifth of the people share a direction) make the far tail depend on which faces
    are sampled, and a sample spread over many faces follows it."""
    rng = np.random.default_rng(11)
    centres = rng.standard_normal((3000, DIM))
    groups = rng.standard_normal((15, DIM))
    centres[:600] += 1.5 * groups[rng.integers(0, 15, 600)]
    faces = (centres / np.linalg.norm(centres, axis=1, keepdims=True)).astype(np.float32)
    identities = np.arange(3000, dtype=np.int64)
    exact = cross_identity_tail(identities, faces)
    sampled = cross_identity_tail(identities, faces, max_pairs=400_000)
    assert exact is not None and sampled is not None
    assert exact.pairs == 3000 * 2999 // 2 and 350_000 < sampled.pairs <= 400_000
    for q in (1e-2, 1e-3, 1e-4):
        assert sampled.score_at(q) == pytest.approx(exact.score_at(q), abs=0.02), q


def test_a_weak_model_says_from_the_start_how_large_it_can_grow(store: GalleryStore) -> None:
    info = store.create_collection("early", MODEL, DIM, 0.3, target_fpir=0.01)
    weak = reference(mean=0.45, sd=0.12)
    fresh, grown = decide(info, 0, weak), decide(info, 100_000, weak)
    assert fresh.useful_up_to is not None and fresh.useful_up_to < 1_000
    assert fresh.warning is not None and f"only up to {fresh.useful_up_to} faces" in fresh.warning
    assert grown.warning is not None and "rejects about" in grown.warning
    strong = decide(info, 0, reference())
    assert strong.useful_up_to is not None and strong.useful_up_to > 10**6 and strong.warning is None
    assert decide(store.create_collection("plain", MODEL, DIM, 0.3), 0, weak).useful_up_to is None
