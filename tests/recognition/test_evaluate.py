"""``python -m recognition evaluate`` (recognition.evaluate, .metrics, .openset, .evaluation_report): the
statistics on synthetic embeddings whose answers are known (orthogonal identities score 0 against each
other; one planted impostor pair), the outputs and errors of the command line, and one run end to end through
the real Triton on the project's photos, checked against a brute-force recount of the same embeddings."""

from __future__ import annotations

import json
import logging
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from facecore.client import PipelineClient
from facecore.scores import GenuineScores, ScoreTail, reference_genuine, reference_tail
from facecore.spec import load_spec
from gallery.calibration import cross_identity_tail
from recognition.__main__ import main
from recognition.__main__ import parser as recognition_parser
from recognition.evaluate import Embedded, read_pairs, reference
from recognition.evaluation_report import reference_toml
from recognition.metrics import (
    Pairs,
    Weighted,
    empirical_threshold,
    genuine_pairs,
    impostor_pairs,
    impostor_total,
    rate_threshold,
    roc,
    wilson,
)
from recognition.openset import (
    BEST,
    IDENTITIES,
    TOP2,
    Calibration,
    CrossHistogram,
    Rule,
    Searches,
    decision,
    decision_changes,
    enrolled_mask,
    evaluate_size,
)
from service.launcher import TritonServer
from tests import ROOT

DIM = 64
K = 50  # identities of the planted set
FIXED = 0.363


def planted() -> tuple[np.ndarray, np.ndarray]:
    """``K`` orthogonal identities, two identical images each (genuine score 1, impostor 0), the last with
    one; identity 0's second image leans to the last identity: 0.8 with its own face, 0.6 with the last's,
    the one impostor pair above the fixed threshold."""
    identities = np.repeat(np.arange(K), 2)[:-1]
    vectors = np.eye(DIM, dtype=np.float32)[identities]
    vectors[1] = 0.0
    vectors[1, 0], vectors[1, K - 1] = 0.8, 0.6
    return vectors, identities


def embedded(folder: str = "planted") -> Embedded:
    vectors, identities = planted()
    names = tuple(f"p{i:02d}" for i in range(K))
    number = np.r_[np.tile([1, 2], K - 1), 1]
    paths = tuple(f"{names[i]}/{names[i]}_{n:04d}.jpg" for i, n in zip(identities, number, strict=True))
    return Embedded(folder, paths, names, identities.astype(np.int64), vectors, (("x/none.jpg", "no face"),),
                    "sface_2021dec", FIXED, {})


# --- 1:1 ----------------------------------------------------------------------------------------------


def test_wilson_interval_known_values() -> None:
    assert wilson(0, 10) == pytest.approx((0.0, 0.27753), abs=1e-5)
    assert wilson(10, 10) == pytest.approx((0.72247, 1.0), abs=1e-5)
    assert wilson(5, 10) == pytest.approx((0.23659, 0.76341), abs=1e-5)
    assert wilson(0, 0) == (0.0, 1.0)


def test_pairs_are_every_genuine_and_impostor_pair_or_a_seeded_sample() -> None:
    vectors, identities = planted()
    genuine = genuine_pairs(vectors, identities)
    impostor, sampled = impostor_pairs(vectors, identities, 10**9, seed=0)
    images = identities.size
    assert len(genuine) == K - 1 and not sampled
    assert len(impostor) == impostor_total(identities) == images * (images - 1) // 2 - len(genuine)
    assert np.all(genuine.first == genuine.second) and np.all(impostor.first != impostor.second)
    assert sorted(genuine.scores.round(6))[:2] == [0.8, 1.0]
    assert int((impostor.scores > 0).sum()) == 1 and impostor.scores.max() == pytest.approx(0.6)
    sample, sampled = impostor_pairs(vectors, identities, 500, seed=3)
    again, _ = impostor_pairs(vectors, identities, 500, seed=3)
    assert sampled and len(sample) == 500 and np.all(sample.first != sample.second)
    assert np.array_equal(sample.left, again.left) and np.array_equal(sample.right, again.right)


def test_rate_threshold_allows_whole_pairs_only() -> None:
    scores = np.arange(100, dtype=np.float64)
    assert (scores >= empirical_threshold(scores, 0.01)).sum() == 1
    assert (scores >= empirical_threshold(scores, 0.025)).sum() == 2
    assert empirical_threshold(scores, 0.005) is None  # below 1 / 100: not measurable
    ties = np.r_[np.ones(3), np.zeros(97)]
    assert (ties >= empirical_threshold(ties, 0.02)).sum() == 0
    descending = scores[::-1].copy()
    # each pair weighs 2: 0.01 of 200 allows one pair
    weighted = rate_threshold(descending, np.cumsum(np.full(100, 2.0)), 0.01)
    assert weighted is not None and (scores >= weighted).sum() == 1


def test_roc_on_orthogonal_identities_with_one_planted_impostor() -> None:
    vectors, identities = planted()
    genuine, (impostor, _) = genuine_pairs(vectors, identities), impostor_pairs(vectors, identities, 10**9, 0)
    result = roc(genuine, impostor, K, (1e-2, 1e-3, 1e-4), FIXED, replicates=200, seed=1)
    assert (result.genuine, result.impostor) == (K - 1, 4802)
    low, mid, unmeasurable = result.points
    for point in (low, mid):  # a few impostors may reach the threshold: those at 0, so it sits just above 0
        assert point.threshold is not None and 0 < point.threshold < 1e-6
        assert point.tar == 1.0 and point.interval == (1.0, 1.0) and point.replicates > 150
    assert unmeasurable.threshold is None and unmeasurable.tar is None and unmeasurable.interval is None
    fixed = result.fixed
    assert (fixed.accepted, fixed.genuine, fixed.false_matches, fixed.impostor) == (K - 1, K - 1, 1, 4802)
    assert fixed.fmr_interval is not None and fixed.fmr_interval[0] == 0.0  # resamples without identity 0
    assert roc(genuine, impostor, K, (1e-2,), FIXED, 200, 1) .fixed == fixed  # seeded


def test_the_bootstrap_weighs_pairs_by_the_identities_drawn() -> None:
    vectors, identities = planted()
    weighted = Weighted(genuine_pairs(vectors, identities), impostor_pairs(vectors, identities, 10**9, 0)[0])
    weight = np.ones(K)
    *_, tar, fmr = weighted.measure(weight, (), FIXED)
    assert (tar, fmr) == (1.0, pytest.approx(1 / 4802))
    weight[0] = 0.0  # identity 0 not drawn: its planted pair is gone
    assert weighted.measure(weight, (), FIXED)[3] == 0.0
    weight[0] = 2.0  # drawn twice: its pairs count twice
    total = 4802 + (2 - 1) * (2 * 97)  # identity 0's two images against the 97 others' images
    assert weighted.measure(weight, (), FIXED)[3] == pytest.approx(2 / total)


# --- 1:N ----------------------------------------------------------------------------------------------


def test_enrolled_are_the_first_images_of_each_identity() -> None:
    identities = np.array([1, 0, 1, 0, 1, 2])
    assert enrolled_mask(identities, 1).tolist() == [True, True, False, False, False, True]
    assert enrolled_mask(identities, 2).tolist() == [True, True, True, True, False, True]


def test_open_set_counts_the_planted_stranger_once_and_no_other() -> None:
    vectors, identities = planted()
    searches = Searches(vectors, identities, K, enrolled_mask(identities, 1))
    rules = [Rule("fixed", fixed=FIXED), Rule("fpir 0.01", fpir=0.01)]
    result = evaluate_size(searches, K - 1, 1, rules, (0.01, 0.02), FIXED, {}, seed=0)
    assert (result.size, result.galleries, result.faces) == (K - 1, K, (K - 1, K - 1))
    by_name = {o.rule.name: o for o in result.outcomes}
    for name in ("fixed", "fpir 0.01", "empirical 0.02"):
        outcome = by_name[name]
        # every image searched once as a stranger; identity 0's second image finds the last identity at 0.6
        assert (outcome.fpir.errors, outcome.fpir.searches, outcome.fpir.distinct) == (1, 99, 99)
        # 49 genuine probes, each in the 49 galleries that hold its identity, always found
        assert (outcome.fnir.errors, outcome.fnir.searches, outcome.fnir.distinct) == (0, 49 * 49, 49)
    assert "empirical 0.01" not in by_name  # 0.01 of 99 stranger images: not measurable
    assert 0 < by_name["empirical 0.02"].thresholds[0] < 1e-6
    product = by_name["fpir 0.01"]
    # 49 faces: 1,176 cross-identity pairs, enough for the gallery's own tail (all 0: the floor applies)
    assert product.bases == {"collection": K} and set(product.thresholds) == {FIXED}


def test_orthogonal_identities_match_no_stranger() -> None:
    identities = np.repeat(np.arange(20), 3)
    vectors = np.eye(DIM, dtype=np.float32)[identities]
    searches = Searches(vectors, identities, 20, enrolled_mask(identities, 1))
    for size in (5, 19):
        result = evaluate_size(searches, size, 4, [Rule("fixed", fixed=FIXED)], (), FIXED, {}, seed=size)
        outcome = result.outcomes[0]
        assert outcome.fpir.errors == 0 and outcome.fpir.searches > 0
        assert outcome.fnir.errors == 0 and outcome.fnir.searches > 0
    assert evaluate_size(searches, 5, 4, [], (), FIXED, {}, 5).galleries == 4


def test_a_gallerys_tail_never_holds_the_strangers_faces() -> None:
    rng = np.random.default_rng(4)
    owners = np.repeat(np.arange(30), 3)
    faces = rng.standard_normal((90, 32)).astype(np.float32)
    faces[3:6] = faces[6:9] + 0.05 * rng.standard_normal((3, 32))  # identity 1 looks like identity 2
    faces /= np.linalg.norm(faces, axis=1, keepdims=True)
    histogram = CrossHistogram(owners, faces)
    for left_out in (1, 7):
        mine = owners != left_out
        expected = cross_identity_tail(owners[mine], faces[mine])
        tail = histogram.tail(left_out)
        assert tail is not None and expected is not None and tail.pairs == expected.pairs
        assert np.allclose(tail.points, expected.points, atol=2e-3)
    everyone = histogram.tail(None)
    assert everyone is not None and everyone.points[-1][1] > histogram.tail(1).points[-1][1]


def test_the_product_threshold_counts_faces_and_falls_back_to_the_reference() -> None:
    tail = ScoreTail.from_scores(np.random.default_rng(2).normal(0.1, 0.1, 50_000))
    ref = {"impostor": tail.to_dict(), "genuine": {"mean": 0.7, "sd": 0.1, "pairs": 100}}
    faces = decision(Rule("f", fpir=0.01), Calibration(None, 2000, 1000), FIXED, ref)
    identities = decision(Rule("i", fpir=0.01, count=IDENTITIES), Calibration(None, 2000, 1000), FIXED, ref)
    assert faces.basis == "reference" and faces.threshold > identities.threshold > FIXED
    assert faces.expected_fpir == pytest.approx(0.01, rel=1e-3)
    own = decision(Rule("f", fpir=0.01), Calibration(tail, 2000, 1000), FIXED, {})
    assert own.basis == "collection" and own.threshold == pytest.approx(faces.threshold, abs=1e-3)
    assert decision(Rule("f", fpir=0.01), Calibration(None, 10, 5), FIXED, {}).basis == "fixed"


def test_top2_fusion_is_the_mean_of_an_identitys_two_best_faces() -> None:
    e = np.eye(8, dtype=np.float32)
    half = (e[0] + e[2]) / np.sqrt(2)
    # identity 0: e0 and (e0 + e2) / sqrt 2 enrolled; identity 1: e3; identity 2 (the probe): e2
    vectors = np.stack([e[0], half, e[3], e[2]])
    identities = np.array([0, 0, 1, 2])
    searches = Searches(vectors, identities, 3, enrolled_mask(identities, 2))
    assert searches.fusions == (BEST, TOP2)
    probe = 3
    assert searches.fused[BEST][probe, :2] == pytest.approx([0.70711, 0.0], abs=1e-5)
    assert searches.fused[TOP2][probe, :2] == pytest.approx([0.35355, 0.0], abs=1e-5)  # one face: its own


def test_decision_changes_list_each_probe_that_changes() -> None:
    vectors, identities = planted()
    searches = Searches(vectors, identities, K, enrolled_mask(identities, 1))
    probes, changes = decision_changes(searches, (Rule("a", fixed=FIXED), Rule("b", fixed=0.7)), FIXED, {})
    assert probes == 99 + 49
    (change,) = changes
    assert (change.row, change.stranger, change.candidate) == (1, True, K - 1)
    assert change.decisions == (K - 1, None)
    _, changes = decision_changes(searches, (Rule("a", fixed=FIXED), Rule("b", fixed=0.9)), FIXED, {})
    assert sorted((c.row, c.stranger) for c in changes) == [(1, False), (1, True)]  # 0.8 < 0.9: now unknown


# --- outputs and command line ---------------------------------------------------------------------------


def test_pairs_file_in_lfw_format(tmp_path: Path) -> None:
    data = embedded()
    pairs = tmp_path / "pairs.txt"
    pairs.write_text("10\t300\np00\t1\t2\np00\t1\tp01\t1\np00\t1\t3\np49\t1\tp99\t1\n")
    genuine, impostor, skipped = read_pairs(pairs, data)
    assert (genuine.left.tolist(), genuine.right.tolist()) == ([0], [1])
    assert (impostor.left.tolist(), impostor.right.tolist()) == ([0], [2])
    assert skipped == ["p00 1 3", "p49 1 p99 1"]
    pairs.write_text("p00 1 2\np00 one 2\n")
    with pytest.raises(ValueError, match=r"pairs.txt:2: expected"):
        read_pairs(pairs, data)


def test_reference_block_round_trips_through_a_model_description(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    genuine = Pairs(rng.normal(0.7, 0.1, 300), *np.zeros((4, 300), dtype=np.int64))
    impostor = Pairs(rng.normal(0.1, 0.09, 40_000), *np.zeros((4, 40_000), dtype=np.int64))
    block = reference(embedded('/data/Ünïcode "faces"'), genuine, impostor, False, "python -m recognition x")
    spec_file = tmp_path / "sface.toml"  # a description without a reference, and one beside it
    spec_file.write_text((ROOT / "export/specs/sface_2021dec.toml").read_text())
    assert load_spec(spec_file).score_reference == {}
    (tmp_path / "sface.scores.toml").write_text(reference_toml(block))
    loaded = load_spec(spec_file).score_reference
    assert isinstance(loaded, dict) and loaded["measured"] == block["measured"]
    assert 'Ünïcode "faces", 50 identities, 99 images' in loaded["measured"]
    assert loaded["measured"].startswith(f"{datetime.now(UTC):%Y-%m-%d}")
    assert reference_tail(loaded) == ScoreTail.from_dict(block["impostor"])
    assert reference_tail(loaded) == ScoreTail.from_dict(ScoreTail.from_scores(impostor.scores).to_dict())
    spread = GenuineScores.from_scores(genuine.scores)
    assert reference_genuine(loaded) == GenuineScores(round(spread.mean, 5), round(spread.sd, 5), 300)


def run(*args: str) -> int:
    return main(["evaluate", *args])


def test_embeddings_are_evaluated_again_without_triton(tmp_path: Path) -> None:
    embedded().save(tmp_path / "planted.npz")
    out = tmp_path / "out"
    assert run("--embeddings", str(tmp_path / "planted.npz"), "--out", str(out), "--url", "127.0.0.1:1",
               "--bootstrap", "20", "--compare", "fixed:0.363", "fixed:0.7", "--fpir", "0.01", "-q") == 0
    report = json.loads((out / "report.json").read_text())
    failed = [{"image": "x/none.jpg", "why": "no face"}]
    assert report["data"] == {"identities": K, "images": 99, "failed": failed}
    assert report["verification"]["fixed"]["false_matches"] == 1
    assert [size["size"] for size in report["identification"]["sizes"]] == [10, K - 1]  # default sizes
    largest = report["identification"]["sizes"][-1]
    fixed = next(r for r in largest["rules"] if r["name"] == "fixed 0.363")
    assert (fixed["fpir"]["errors"], fixed["fpir"]["searches"]) == (1, 99)
    assert [c["image"] for c in report["changes"]["changed"]] == ["p00/p00_0002.jpg"]
    assert report["histograms"] == "scores.png" and (out / "scores.png").stat().st_size > 1000
    text = (out / "report.md").read_text()
    for heading in ("## 1:1 verification", "## Open-set 1:N", "## Score fusion", "## Decision changes",
                    "## Images left out", "| 0.0001 | not measurable with 4802 impostor pairs"):
        assert heading in text
    assert not (out / "embeddings.npz").exists()  # nothing embedded: nothing to keep


def test_reference_out_with_too_few_pairs_still_writes_the_report(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    data = embedded()
    few = Embedded(data.folder, data.paths[:4], data.names[:2], data.identities[:4], data.vectors[:4], (),
                   data.model, data.match_threshold, {})
    few.save(tmp_path / "few.npz")
    code = run("--embeddings", str(tmp_path / "few.npz"), "--out", str(tmp_path / "out"), "--reference-out",
               str(tmp_path / "ref.toml"), "-q")
    assert code == 2 and "needs at least 20 impostor and 2 genuine pairs, got 4 and 2" in caplog.text
    assert (tmp_path / "out" / "report.md").exists() and not (tmp_path / "ref.toml").exists()


def test_errors_are_one_line_exit_2(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A missing folder, one identity, no input, Triton unreachable: one logged line, exit 2."""
    alone = tmp_path / "alone"
    (alone / "a").mkdir(parents=True)
    (alone / "a" / "a.jpg").write_bytes(b"x")
    two = tmp_path / "two"
    for name in ("a", "b"):
        (two / name).mkdir(parents=True)
        (two / name / f"{name}.jpg").write_bytes(b"x")
    out = ["--out", str(tmp_path / "out"), "--url", "127.0.0.1:1", "-q"]
    cases = {"no folder": [str(tmp_path / "missing")], "fewer than 2 identities": [str(alone)],
             "give a labelled folder": [], "Triton at 127.0.0.1:1": [str(two)],
             "not the embeddings": ["--embeddings", str(alone / "a" / "a.jpg")]}
    for message, args in cases.items():
        caplog.clear()
        assert run(*args, *out) == 2, message
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and message in errors[0].getMessage(), caplog.text


@pytest.mark.parametrize("args", [["--compare", "fixed:2", "fpir:0.01"], ["--compare", "fpir:0.9", "fixed:0"],
                                  ["--fpir", "0"], ["--sizes", "ten"], ["--enroll-per-identity", "0"],
                                  ["--bootstrap", "-1"]])
def test_bad_options_are_refused(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        recognition_parser().parse_args(["evaluate", "x", *args])
    assert exited.value.code == 2 and args[1] in capsys.readouterr().err


# --- end to end through Triton --------------------------------------------------------------------------

LAYOUT = {"Barack_Obama": ["obama.jpg", "obama2.jpg", "obama3.jpg"], "Joe_Biden": ["biden.jpg"],
          "Group": ["t1.jpg"], "Astronaut": ["astronaut.png"], "Tom_Hanks": ["Tom_Hanks_54745.png"],
          "Nobody": ["coffee.png"]}


@pytest.fixture
def people(tmp_path: Path, photos: dict[str, Path]) -> Path:
    """The project's photos in LFW's layout: name/name_0001.jpg, one folder per person (coffee: no face)."""
    root = tmp_path / "people"
    for person, files in LAYOUT.items():
        (root / person).mkdir(parents=True)
        for number, name in enumerate(files, 1):
            shutil.copy(photos[name], root / person / f"{person}_{number:04d}{Path(name).suffix}")
    return root


def largest_faces(triton: TritonServer, root: Path) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The oracle: each image's largest face through the blocking client, by box area."""
    client = PipelineClient(triton.grpc_url)
    paths, vectors, owners = [], [], []
    for number, person in enumerate(sorted(p for p in LAYOUT if p != "Nobody")):
        for image in sorted((root / person).iterdir()):
            faces = client.infer(image.read_bytes())
            paths.append(f"{person}/{image.name}")
            vectors.append(faces.embeddings[int(np.argmax(faces.areas()))])
            owners.append(number)
    client.close()
    return paths, np.array(vectors), np.array(owners)


def brute_force(vectors: np.ndarray, owners: np.ndarray, threshold: float) -> dict[str, Any]:
    """Every pair, and every leave-one-out 1:N search, counted one by one (one image enrolled each)."""
    scores = vectors @ vectors.T
    pairs = [(i, j) for i in range(len(owners)) for j in range(i + 1, len(owners))]
    same = [scores[i, j] for i, j in pairs if owners[i] == owners[j]]
    other = [scores[i, j] for i, j in pairs if owners[i] != owners[j]]
    enrolled = {o: int(np.flatnonzero(owners == o)[0]) for o in set(owners.tolist())}
    matched = missed = searches = 0
    best_score = []  # each probe once: a stranger in its own rotation, a genuine probe against everyone
    for stranger in [*enrolled, None]:
        gallery = {o: face for o, face in enrolled.items() if o != stranger}
        for probe in range(len(owners)):
            best = max(gallery, key=lambda o: scores[probe, gallery[o]])
            if owners[probe] == stranger:
                matched += scores[probe, gallery[best]] >= threshold
                best_score.append((probe, "stranger", scores[probe, gallery[best]]))
            elif probe not in enrolled.values() and stranger is not None:
                searches += 1
                missed += not (best == owners[probe] and scores[probe, gallery[best]] >= threshold)
            elif probe not in enrolled.values():
                best_score.append((probe, "genuine", scores[probe, gallery[best]]))
    return {"accepted": sum(s >= threshold for s in same), "genuine": len(same),
            "false_matches": sum(s >= threshold for s in other), "impostor": len(other),
            "matched": matched, "missed": missed, "searches": searches, "best": best_score}


@pytest.mark.triton
def test_end_to_end_on_the_projects_photos(triton: TritonServer, people: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run(str(people), "--url", triton.grpc_url, "--out", str(out), "--bootstrap", "50", "--compare",
               "fixed:0.1", "fixed:0.7", "-q") == 0
    report = json.loads((out / "report.json").read_text())
    paths, vectors, owners = largest_faces(triton, people)
    expected = brute_force(vectors, owners, FIXED)
    # the served description carries SFace's measured score reference (export/specs/sface_2021dec.scores.toml)
    assert report["model"] == {"name": "sface_2021dec", "match_threshold": FIXED, "score_reference": True}
    assert report["data"]["failed"] == [{"image": "Nobody/Nobody_0001.png", "why": "no face"}]
    assert (report["data"]["identities"], report["data"]["images"]) == (5, 7)
    kept = Embedded.load(out / "embeddings.npz")
    assert list(kept.paths) == paths and np.allclose(kept.vectors, vectors, atol=1e-5)
    fixed = report["verification"]["fixed"]
    assert {k: fixed[k] for k in ("accepted", "genuine", "false_matches", "impostor")} == {
        k: expected[k] for k in ("accepted", "genuine", "false_matches", "impostor")}
    assert (expected["genuine"], expected["impostor"]) == (3, 18)
    assert all(p["threshold"] is None for p in report["verification"]["points"])  # 18 pairs: no FMR of 1e-2
    (largest,) = report["identification"]["sizes"]
    assert (largest["size"], largest["galleries"]) == (4, 5)
    for name in ("fixed 0.363", "fpir 0.01", "fpir 0.001"):
        rule = next(r for r in largest["rules"] if r["name"] == name)
        threshold = rule["threshold"]["min"]
        assert threshold == rule["threshold"]["max"]  # every gallery holds 4 faces
        counted = brute_force(vectors, owners, threshold)
        assert (rule["fpir"]["errors"], rule["fpir"]["searches"]) == (counted["matched"], 7)
        fnir = rule["fnir"]
        assert (fnir["errors"], fnir["searches"]) == (counted["missed"], counted["searches"])
    product = next(r for r in largest["rules"] if r["name"] == "fpir 0.01")
    # 4 faces: too few pairs for the gallery's own tail, so the served model's reference decides
    assert product["basis"] == {"reference": 5} and product["threshold"]["min"] > FIXED
    obama = [i for i, p in enumerate(paths) if p.startswith("Barack_Obama")]
    changed = sorted((c["image"], c["role"]) for c in report["changes"]["changed"])
    assert report["changes"]["probes"] == len(expected["best"]) == 9
    assert changed == sorted((paths[i], role) for i, role, score in expected["best"] if 0.1 <= score < 0.7)
    assert len(changed) >= 2  # strangers between 0.1 and 0.7, and one Obama photo at 0.69
    assert (out / "report.md").read_text().count("not measurable with 18 impostor pairs") == 3

    pairs = tmp_path / "pairs.txt"
    pairs.write_text("Barack_Obama 1 2\nBarack_Obama 2 3\nBarack_Obama 1 Joe_Biden 1\n"
                     "Joe_Biden 1 Joe_Biden 2\n")
    again = tmp_path / "again"
    assert run("--embeddings", str(out / "embeddings.npz"), "--pairs", str(pairs), "--out", str(again),
               "--bootstrap", "10", "-q") == 0
    verification = json.loads((again / "report.json").read_text())["verification"]
    assert (verification["genuine"], verification["impostor"]) == (2, 1)
    assert verification["skipped"] == ["Joe_Biden 1 Joe_Biden 2"]
    scores = vectors @ vectors.T
    in_file = [scores[obama[0], obama[1]], scores[obama[1], obama[2]]]
    assert verification["fixed"]["accepted"] == sum(int(score >= FIXED) for score in in_file)
