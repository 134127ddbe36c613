"""``bench.tune``'s sweep: the issue-10 dimensions (runtime, layout, instances x threads per network) and the
budget logic, with a stand-in for the measurement (a real trial starts a tritonserver per candidate)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from bench import tune
from export.profiles import Profile, ProfileTuning


def _fake_measure(calls: list[str]) -> tune.Measure:
    """Throughput rises with the in_process layout and with 2 embedder threads; ONNX Runtime is slower;
    3 pipelines would be fastest but blows the latency budget."""

    def measure(tuning: ProfileTuning, name: str, payloads: list[bytes], seconds: float, work: Path
                ) -> tune.Trial:
        calls.append(name)
        throughput = 10.0 + 5 * (tuning.layout == "in_process") + 3 * (tuning.embedder_threads == 2)
        throughput -= 4 * (tuning.runtime == "onnxruntime")
        p99 = 2000.0 if tuning.pipeline.instances == 3 else 500.0
        throughput += 20 * (tuning.pipeline.instances == 3)
        return tune.Trial(name, tuning, 50.0, p99, throughput, 0)

    return measure


def test_the_sweep_keeps_the_best_configuration_within_the_budget(tmp_path: Path) -> None:
    start = replace(ProfileTuning.builtin(Profile.CPU), embedder_threads=1, layout="bls")
    calls: list[str] = []
    best, trials = tune.sweep(start, [b"jpeg"], 1.0, 1000.0, 0.03, tmp_path,
                              ["runtime", "layout", "spinning", "embedder instances x threads",
                               "pipeline instances"], _fake_measure(calls))
    assert best.tuning.runtime == "openvino" and best.tuning.layout == "in_process"
    assert best.tuning.embedder_threads == 2 and best.tuning.embedder.instances == 1
    assert best.tuning.pipeline.instances != 3  # faster, but p99 over the budget
    assert best.throughput_c8 == 18.0
    assert "runtime: ONNX Runtime f32" in calls and not any(c.startswith("spinning") for c in calls)
    assert "pipeline instances: 3 pipelines" in calls  # measured, then refused
    assert len(trials) == len(calls)
    text = tune.report(best, trials, 1000.0)
    assert f"Chosen: **{best.name}**" in text
    assert "| runtime: ONNX Runtime f32 | 50.0 | 500.0 | 6.00 | 0 |" in text


def test_every_dimension_changes_the_tuning_it_names() -> None:
    start = ProfileTuning.builtin(Profile.CPU)
    assert {"runtime", "layout", "detector instances x threads", "embedder instances x threads"} <= set(
        tune.DIMENSIONS)
    changed = tune.DIMENSIONS["embedder instances x threads"]["2 embedder(s) x 1 thread(s)"](start)
    assert (changed.embedder.instances, changed.embedder_threads) == (2, 1)
    assert changed.detector == start.detector
    in_process = tune.DIMENSIONS["layout"]["in_process: both networks inside face_pipeline"](start)
    assert in_process.layout == "in_process"
    assert tune.applies("spinning", replace(start, runtime="onnxruntime"))
    assert not tune.applies("spinning", replace(start, runtime="openvino"))


def test_a_candidate_over_the_memory_budget_is_not_kept(tmp_path: Path) -> None:
    """Two embedder instances are faster here but take Triton's tree over the memory budget: refused."""

    def measure(tuning: ProfileTuning, name: str, payloads: list[bytes], seconds: float, work: Path
                ) -> tune.Trial:
        two = tuning.embedder.instances == 2
        return tune.Trial(name, tuning, 50.0, 500.0, 20.0 if two else 10.0, 0, 1900.0 if two else 1100.0)

    start = replace(ProfileTuning.builtin(Profile.CPU), embedder=replace(
        ProfileTuning.builtin(Profile.CPU).embedder, instances=1), embedder_threads=1)
    best, trials = tune.sweep(start, [b"jpeg"], 1.0, 1000.0, 0.03, tmp_path, ["embedder instances x threads"],
                              measure)
    assert best.tuning.embedder.instances == 1 and best.rss_mib == 1100.0
    assert any(t.tuning.embedder.instances == 2 and t.rss_mib > tune.MEMORY_BUDGET_MIB for t in trials)


def test_equal_throughput_in_clearly_less_memory_is_kept(tmp_path: Path) -> None:
    """The figures of the recorded sweep (docs/benchmarks/tuning.md): the small-batch candidate is 1.4 %
    slower (within the 3 % margin) in 967 instead of 1,363 MiB, and is kept; one 10 % slower is not,
    however lean. Before the memory rule the sweep kept the big-batch default (chosen by hand since)."""
    small = tune.DIMENSIONS["batching"]["small batches: pipeline max 2, embedder max 16"]

    def measure(tuning: ProfileTuning, name: str, payloads: list[bytes], seconds: float, work: Path
                ) -> tune.Trial:
        if tuning == small(start):
            return tune.Trial(name, tuning, 25.0, 171.0, 77.96, 0, 967.0)
        if name.startswith("batching: pipeline delay 0"):
            return tune.Trial(name, tuning, 24.0, 200.0, 70.0, 0, 500.0)  # lean but 10 % slower
        return tune.Trial(name, tuning, 25.4, 229.3, 79.09, 0, 1363.0)

    default = ProfileTuning.default(Profile.CPU)  # the big batches the sweep started from
    start = replace(default, pipeline=replace(default.pipeline, max_batch_size=8, preferred=(4, 8)),
                    embedder=replace(default.embedder, max_batch_size=32, preferred=(16, 32)))
    best, _ = tune.sweep(start, [b"jpeg"], 1.0, 1000.0, 0.03, tmp_path, ["batching"], measure)
    assert best.name == "batching: small batches: pipeline max 2, embedder max 16"
    assert best.rss_mib == 967.0
    assert not tune.improves(tune.Trial("x", start, 24.0, 200.0, 70.0, 0, 500.0), best, 0.03)


def test_equal_throughput_with_a_clearly_quicker_lone_request_is_kept(tmp_path: Path) -> None:
    """Measured on a 2-core Xeon (`python -m bench.stack --concurrency 1 8`, gRPC): both networks on two
    threads answer a lone request in 23 instead of 34 ms at the same throughput (64.3 vs 65.5 images/s
    at concurrency 8) and memory: kept. Not when it costs clearly more memory, nor when it is slower."""
    two = tune.DIMENSIONS["embedder instances x threads"]["1 embedder(s) x 2 thread(s)"]

    def sweep_with(quick: tune.Trial) -> tune.Trial:
        def measure(tuning: ProfileTuning, name: str, payloads: list[bytes], seconds: float, work: Path
                    ) -> tune.Trial:
            if tuning == two(start):
                return replace(quick, name=name, tuning=tuning)
            return tune.Trial(name, tuning, 34.0, 190.0, 65.5, 0, 945.0)

        best, _ = tune.sweep(start, [b"jpeg"], 1.0, 1000.0, 0.03, tmp_path, ["embedder instances x threads"],
                             measure)
        return best

    start = replace(ProfileTuning.builtin(Profile.CPU), embedder=replace(
        ProfileTuning.builtin(Profile.CPU).embedder, instances=1), embedder_threads=1)
    assert sweep_with(tune.Trial("", start, 23.0, 192.0, 64.3, 0, 942.0)).tuning.embedder_threads == 2
    assert sweep_with(tune.Trial("", start, 23.0, 192.0, 64.3, 0, 1300.0)).tuning.embedder_threads == 1
    assert sweep_with(tune.Trial("", start, 23.0, 192.0, 60.0, 0, 942.0)).tuning.embedder_threads == 1
