"""Smoke test of the gallery index benchmark on a tiny synthetic gallery (no wall-clock thresholds)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

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
    exact, pq, milvus = benchmark_case(2_000, 32, queries=50, candidates=("pq4fs",), milvus_max=2_000)

    for row in (exact, milvus):  # both exact: recall and agreement 1 by definition
        assert row.recall_at_10 == 1.0 and row.genuine_agreement == row.impostor_agreement == 1.0
        assert row.true_match_at_10 == 1.0  # the source face (cosine 0.75) always beats the impostors here
        assert row.p50_ms is not None and row.p99_ms is not None and 0 < row.p50_ms <= row.p99_ms
        assert set(row.qps) == {"1", "8", "32"} and all(v > 0 for v in row.qps.values())
        assert row.build_s > 0 and row.load_s is not None and row.load_s > 0
    assert exact.snapshot_bytes is not None and exact.snapshot_bytes >= 2_000 * 32 * 4
    assert milvus.label.startswith("Milvus-lite") and milvus.memory_bytes is not None

    assert pq.index == "pq4fs" and pq.effort is not None and pq.build_recall_bound is not None
    if pq.accurate:
        assert pq.build_recall_bound >= 0.99 and pq.recall_at_10 is not None and pq.recall_bound is not None
        assert pq.p50_ms is not None and pq.genuine_agreement is not None
    else:
        assert pq.p50_ms is None and "refused" in pq.label

    table = result_table([exact, pq, milvus])
    header, _, *rows = table.splitlines()
    assert [c.strip() for c in header.strip("|").split("|")] == [name for name, _ in COLUMNS]
    assert len(rows) == 3 and all(row.count("|") == len(COLUMNS) + 1 for row in rows)
    assert "exact (Flat)" in rows[0] and "| 1.0000 (1.0000) | 100.00% / 100.00% | 1.0000 |" in rows[0]
    text = document("python -m bench.gallery", [exact, pq], "test machine")
    assert "Command: `python -m bench.gallery`" in text and "Machine: test machine" in text


def test_without_the_milvus_extra_its_rows_are_skipped_and_said_so(monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """`pip install -e '.[server,cpu,bench]'` has no milvus_lite: the benchmark runs without its rows."""
    monkeypatch.setitem(sys.modules, "milvus_lite", None)  # its import now fails
    rows = benchmark_case(1_000, 16, queries=20, candidates=(), milvus_max=1_000)
    assert [row.index for row in rows] == ["exact"]
    assert "Milvus-lite rows skipped: milvus_lite" in caplog.text and "`milvus` extra" in caplog.text


def test_command_line_writes_the_report(tmp_path: Path) -> None:
    out, results = tmp_path / "gallery.md", tmp_path / "gallery.json"
    argv = ["--sizes", "1000", "--dims", "16", "--queries", "20", "--milvus-max", "0", "--out", str(out),
            "--json", str(results)]
    assert main(argv) == 0
    text = out.read_text()
    assert "python -m bench.gallery --sizes 1000" in text and "| 1,000 | 16 | exact (Flat) |" in text
    assert '"recall_at_10": 1.0' in results.read_text()
