"""Smoke test of the gallery index benchmark on a tiny synthetic gallery (no wall-clock thresholds)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.gallery import (
    COLUMNS,
    benchmark_case,
    document,
    main,
    probe_set,
    result_table,
    synthetic_faces,
)


def test_synthetic_faces_look_like_face_embeddings() -> None:
    vectors = synthetic_faces(2_000, 64)
    assert vectors.shape == (2_000, 64) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    same = (vectors[0:2000:10] * vectors[1:2000:10]).sum(axis=1)  # faces 10i and 10i+1: one identity
    other = (vectors[0:1000:10] * vectors[1000:2000:10]).sum(axis=1)
    assert abs(float(same.mean()) - 0.75) < 0.03
    assert abs(float(other.mean())) < 0.03
    probes, sources = probe_set(vectors, 50)
    np.testing.assert_allclose((probes * vectors[sources]).sum(axis=1), 0.75, atol=1e-3)
    np.testing.assert_array_equal(synthetic_faces(2_000, 64), vectors)  # deterministic


def test_benchmark_case_reports_plausible_figures() -> None:
    stats, (exact, approximate) = benchmark_case(2_000, 32, queries=50)
    assert 0.7 < stats.genuine_cos < 0.8 and abs(stats.impostor_cos) < 0.05
    assert stats.probe_best_impostor < 0.75 and 0.0 <= stats.probe_impostor_wins <= 1.0

    assert exact.index == "exact" and exact.recall_at_10 == 1.0
    assert exact.true_match_at_10 == 1.0  # the source face (cosine 0.75) always beats the impostors here
    assert exact.p50_ms is not None and exact.p99_ms is not None and 0 < exact.p50_ms <= exact.p99_ms
    assert exact.batch_qps is not None and exact.batch_qps > 0
    assert exact.snapshot_bytes is not None and exact.snapshot_bytes >= 2_000 * 32 * 4
    assert exact.build_s > 0 and exact.save_s is not None and exact.load_s is not None

    assert approximate.index in {"ivf", "refused"}
    assert approximate.nlist is not None and approximate.nlist >= 16
    assert approximate.tuning_recall is not None and 0.0 <= approximate.tuning_recall <= 1.0
    if approximate.index == "ivf":
        assert approximate.tuning_recall >= 0.99
        assert approximate.nprobe is not None and approximate.nprobe >= 1
        assert approximate.recall_at_10 is not None and 0.0 <= approximate.recall_at_10 <= 1.0
        assert approximate.true_match_at_10 is not None and 0.0 <= approximate.true_match_at_10 <= 1.0
        assert approximate.p50_ms is not None and approximate.p50_ms > 0
    else:
        assert approximate.p50_ms is None and "refused" in approximate.label

    table = result_table([exact, approximate])
    header, _, *rows = table.splitlines()
    assert [c.strip() for c in header.strip("|").split("|")] == list(COLUMNS)
    assert len(rows) == 2 and all(row.count("|") == len(COLUMNS) + 1 for row in rows)
    assert "exact (Flat)" in rows[0] and "| 1.0000 | 1.0000 |" in rows[0]
    text = document("python -m bench.gallery", [exact, approximate], [(2_000, 32, stats)], "test machine")
    assert "How to read this" in text and "Machine: test machine" in text


def test_command_line_writes_the_report(tmp_path: Path) -> None:
    out, results = tmp_path / "gallery.md", tmp_path / "gallery.json"
    argv = ["--sizes", "1000", "--dims", "16", "--queries", "20", "--out", str(out), "--json", str(results)]
    assert main(argv) == 0
    text = out.read_text()
    assert "python -m bench.gallery --sizes 1000" in text and "| 1,000 | 16 | exact (Flat) |" in text
    assert '"recall_at_10": 1.0' in results.read_text()
