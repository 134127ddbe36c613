"""``bench/compare.py``: candidates from field=value changes, and a side-by-side run on the real server."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import compare
from export.profiles import Profile, ProfileTuning


def test_changes_reach_tuning_batching_and_pipeline_options() -> None:
    current = ProfileTuning.default(Profile.CPU)
    tuning = compare.changed(current, ["detector_threads=3", "solo_threads=0", "layout=bls", "spinning=false",
                                       "pipeline.instances=2", "pipeline.preferred=2,4",
                                       "option.decode_min_side=0"])
    assert (tuning.detector_threads, tuning.solo_threads) == (3, 0)
    assert (tuning.layout, tuning.spinning) == ("bls", False)
    assert tuning.pipeline.instances == 2 and tuning.pipeline.preferred == (2, 4)
    assert tuning.pipeline.max_batch_size == current.pipeline.max_batch_size
    assert tuning.pipeline_options["decode_min_side"] == "0"
    assert tuning.embedder == current.embedder
    for bad, message in (("threads", "field=value"), ("nosuch=1", "no tuning field"),
                         ("pipeline.nosuch=1", "no batching field"), ("detector=1", "no tuning field")):
        with pytest.raises(ValueError, match=message):
            compare.changed(current, [bad])


def test_two_servers_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The recorded tuning and one candidate, both served by real tritonservers at once: a row each."""
    report = tmp_path / "report.md"
    assert compare.main(["--candidate", "one pipeline", "pipeline.instances=1", "--single", "3",
                         "--rounds", "2", "--seconds", "0.5", "--concurrency", "2",
                         "--report", str(report)]) == 0
    text = report.read_text()
    assert "python -m bench.compare --candidate 'one pipeline' pipeline.instances=1" in text
    rows = [line for line in text.splitlines() if line.startswith(("| current", "| one pipeline"))]
    assert len(rows) == 2
    cells = [row.split("|")[1:-1] for row in rows]
    for cell in cells:
        assert float(cell[2]) > 0 and float(cell[4]) > 0 and float(cell[6]) > 100  # p50, images/s, MiB
        assert len(cell[5].split(" / ")) == 2  # one window per round
    assert "`pipeline.instances=1`" in rows[1]
    assert "| current" in capsys.readouterr().out
