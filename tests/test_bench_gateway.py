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
    assert "less CPU per call" in text
    assert main([*argv[:-2], "--parts", "identify", "--out", str(out)]) == 0
    assert f"| {OURS} |" not in out.read_text() and f"| {IDENTIFY} |" in out.read_text()
    with pytest.raises(SystemExit):
        main(["--requests", "2", "--concurrency", "8"])
