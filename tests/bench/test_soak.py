"""bench/soak.py: the verdict's rules on made-up windows, and a short soak of the real stack (python -m
service: the gateway and its bundled Triton, which the soak kills halfway) with no unexpected answer."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.soak import soak, verdict


def window(began: int, answers: dict[str, int], gateway: float = 160, triton: float = 1100,
           p50: float | None = 100.0) -> dict[str, object]:
    return {"began_s": began, "answers": answers, "requests": sum(answers.values()), "p50_ms": p50,
            "p99_ms": 300.0, "gateway_mib": gateway, "triton_mib": triton}


def test_the_verdict_allows_the_restarts_503s_and_nothing_else() -> None:
    windows = [window(0, {"200": 50}, triton=900), window(20, {"200": 60, "404 not_found": 3}),
               window(40, {"200": 10, "503 triton_unavailable": 400}, triton=700),  # killed at 41 s
               window(60, {"200": 55, "500 internal_error": 1}), window(80, {"200": 60}, triton=1140)]
    judged = verdict(windows, killed_at=41.0)
    assert judged["unexpected"] == {"500 internal_error": 1}
    assert judged["memory_drift"]["triton_mib"] < 0.05  # warm-up and the kill's window left out
    assert judged["p50_after_over_before"] == 1.0
    assert verdict(windows, killed_at=None)["unexpected"] == {"503 triton_unavailable": 400,
                                                              "500 internal_error": 1}
    leaking = [window(0, {"200": 1}),
               *[window(20 * n, {"200": 1}, gateway=160 * (1 + n / 10)) for n in (1, 2, 3)]]
    assert verdict(leaking, None)["memory_drift"]["gateway_mib"] > 0.05


@pytest.mark.triton
def test_a_short_soak_of_the_real_stack(tmp_path: Path) -> None:
    result = soak(minutes=0.75, window_s=9, clients=2, kill=True, workdir=tmp_path)
    assert result["killed_at_s"] is not None
    assert result["verdict"]["unexpected"] == {}, result["windows"]
    answered = [w for w in result["windows"] if w["answers"].get("200")]
    assert len(answered) >= 3 and answered[-1]["began_s"] > result["killed_at_s"]  # served again after it
