"""The request-batching ceiling benchmark: its timing arithmetic on a fake clock, its int8 reference
against numpy, its bound, and a small real run (no wall-clock thresholds)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench import gallery_ceiling
from bench.core.reporting import read_section
from bench.gallery import synthetic_faces
from bench.gallery_ceiling import BLOCK, Ceiling, bound, int8_product, int8_top, main, time_kernel


def test_time_kernel_alternates_one_query_and_blocks_and_turns_medians_into_rates(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    calls: list[int] = []
    monkeypatch.setattr(gallery_ceiling.time, "perf_counter", lambda: clock[0])

    def kernel(queries: Any) -> None:  # 1 ms per lone query, 8 ms per block: 1,000 and 4,000 q/s
        calls.append(len(queries))
        clock[0] += 0.001 if len(queries) == 1 else 0.008

    queries = synthetic_faces(400, 16)
    alone, block = time_kernel(kernel, queries, alone=6, blocks=3, rounds=3)
    assert alone == pytest.approx(1000) and block == pytest.approx(BLOCK / 0.008)
    # a warm-up of each, then three rounds of two lone queries and one block
    assert calls == [1, BLOCK] + [1, 1, BLOCK] * 3


def test_int8_reference_scores_are_the_int8_dot_products() -> None:
    vectors = synthetic_faces(500, 32)
    queries = synthetic_faces(40, 32, seed=3)
    scores = int8_product(vectors)(queries)
    expected = (np.rint(queries * 127).astype(np.int32) @ np.rint(vectors * 127).astype(np.int32).T)
    np.testing.assert_array_equal(scores, expected)
    # and they rank as the float scores do, up to rounding
    assert (np.argmax(scores, axis=1) == np.argmax(queries @ vectors.T, axis=1)).mean() > 0.9


def test_int8_top_picks_the_best_int8_scores_of_each_query() -> None:
    vectors = synthetic_faces(700, 32)
    queries = synthetic_faces(40, 32, seed=5)
    best, rows = int8_top(vectors, 8)(queries)
    scores = np.rint(queries * 127).astype(np.int32) @ np.rint(vectors * 127).astype(np.int32).T
    assert best.shape == rows.shape == (40, 8)
    # the 8 best scores, best first, and the rows they belong to (ties: any of the tied rows)
    np.testing.assert_array_equal(best, -np.sort(-scores, axis=1)[:, :8])
    np.testing.assert_array_equal(np.take_along_axis(scores, rows, 1), best)


def test_bound_takes_the_fastest_block_of_any_kernel_and_the_fastest_complete_lone_search() -> None:
    rows = [Ceiling(128, "codes alone", 2000, 5000, complete=False),
            Ceiling(128, "codes + re-rank", 800, 1600),
            Ceiling(128, "served", 900, 9000, served=True),  # requests, not calls: never a bound
            Ceiling(128, "exact", 50, 100),
            Ceiling(512, "codes + re-rank", 700, 1400)]
    block, alone = bound(rows, 128) or (None, None)
    assert block is rows[0] and alone is rows[1]
    assert bound(rows, 64) is None
    assert bound([Ceiling(128, "codes alone", 1, 2, complete=False)], 128) is None


def test_a_small_run_writes_its_section_and_json(tmp_path: Path) -> None:
    out, results = tmp_path / "gallery.md", tmp_path / "ceiling.json"
    out.write_text("# Gallery benchmarks\n\nkept text\n")
    assert main(["--size", "3000", "--dims", "32", "--candidates", "pq4fs-fine", "--out", str(out),
                 "--json", str(results)]) == 0
    text = out.read_text()
    assert "kept text" in text
    section = read_section(text, "bench.gallery_ceiling")
    assert "int8 matrix product" in section and "exact (Flat)" in section and "at most" in section
    data = json.loads(results.read_text())
    kernels = [row["kernel"] for row in data["rows"]]
    assert any(k.startswith("exact") for k in kernels) and any(k.startswith("int8") for k in kernels)
    assert any(k.startswith("int8 matrix product + top 32") for k in kernels)
    assert all(row["alone_qps"] > 0 and row["block_qps"] > 0 for row in data["rows"])
    assert set(data["bounds"]) == {"32"} and data["bounds"]["32"]["gain"] > 0
