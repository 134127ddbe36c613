"""``bench.gateway``: the gateway's own CPU per identify and per gRPC call, on the real Triton."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.launcher import TritonServer

pytestmark = pytest.mark.triton


def test_the_gateway_benchmark_measures_identify_and_both_grpc_clients(triton: TritonServer,
                                                                      tmp_path: Path) -> None:
    from bench.gateway import IDENTIFY, OURS, TRITONCLIENT, main

    out = tmp_path / "README.md"
    argv = ["--requests", "12", "--rounds", "2", "--concurrency", "4", "--triton-url", triton.grpc_url,
            "--out", str(out)]
    assert main(argv) == 0
    text = out.read_text()
    assert "<!-- bench.gateway:start -->" in text
    assert f"Command: `python -m bench.gateway {' '.join(argv)}`" in text
    for name in (IDENTIFY, OURS, TRITONCLIENT):
        row = next(line for line in text.splitlines() if line.startswith(f"| {name} |"))
        median, rounds = row.split(" | ")[1:3]
        assert float(median) > 0 and len(rounds.split(", ")) == 2, row
    assert main([*argv[:-2], "--parts", "identify", "--out", str(out)]) == 0
    assert f"| {OURS} |" not in out.read_text() and f"| {IDENTIFY} |" in out.read_text()
    with pytest.raises(SystemExit):
        main(["--requests", "2", "--concurrency", "8"])


def test_the_gateways_of_two_trees_are_served_side_by_side(triton: TritonServer, tmp_path: Path) -> None:
    """``--trees``: each tree's whole gateway process served on the one Triton, alternating load; here the
    same tree twice (an A/A run), each with a CPU figure per round and the second with its paired
    difference; a folder that is not a source tree of the project is refused."""
    from bench.core.inputs import ROOT
    from bench.gateway import main

    out = tmp_path / "README.md"
    argv = ["--trees", str(ROOT), str(ROOT), "--rounds", "2", "--seconds", "1", "--concurrency", "2",
            "--triton-url", triton.grpc_url, "--out", str(out)]
    assert main(argv) == 0
    text = out.read_text()
    assert "<!-- bench.gateway.trees:start -->" in text
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith(("| 1. ", "| 2. "))]
    assert [row[0].split(" (")[0] for row in rows] == [f"| 1. {ROOT}", f"| 2. {ROOT}"]
    assert rows[0][0] == rows[1][0].replace("| 2.", "| 1.") and "(not a git checkout)" not in rows[0][0]
    assert float(rows[0][1]) > 0 and rows[0][2] == "—" and float(rows[1][1]) > 0
    assert abs(float(rows[1][2])) < 100 and len(rows[1][3].split(", ")) == 2
    with pytest.raises(SystemExit):
        main(["--trees", str(tmp_path)])
