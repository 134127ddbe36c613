"""The serving report's issue-10 targets (``bench/report.py``: each a record, judged by one function) and
the ceiling on both runtimes (``bench/ceiling.py``, against the real OpenVINO and ONNX Runtime)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import __main__ as bench_main
from bench import ceiling, latency, report
from bench import stack as stack_part
from bench.ceiling import Layout, PhotoCeiling, StageSplit
from bench.core.inputs import served_models
from bench.core.load import LoadRow
from bench.core.reporting import table
from bench.results import Results
from bench.stack import HoldCheck, MemoryRun
from facecore.runtimes import Runtime


def _ceiling(photo: str, variant: str, runtime: str, images_per_s: float, models_ms: float) -> PhotoCeiling:
    stages = dict.fromkeys(ceiling.STAGES, 1.0) | {"detector": models_ms / 2, "embedder": models_ms / 2}
    split = StageSplit(1, 1, sum(stages.values()), stages)
    return PhotoCeiling(photo, photo, "dynamic", (512, 640), 1, {1: {1: 10.0}}, {1: {1: 10.0}}, [split],
                        [Layout(2, 1, 1, 1, 1, images_per_s, 50.0)], variant, runtime)


def _row(target: str, photo: str, concurrency: int, throughput: float, p50: float = 100.0,
         p99: float = 200.0, gateway_ms: float = 2.0, triton_mib: float = 900.0) -> LoadRow:
    return LoadRow(target, photo, concurrency, 100, 0, 10.0, throughput, p50, p50 * 1.5, p99, 1.0,
                   {"gateway": gateway_ms, "triton": 50.0}, rss_mib={"gateway": 150.0, "triton": triton_mib})


def _results(**values: object) -> Results:
    return Results("python -m bench", "today", "test machine", {}, **values)  # type: ignore[arg-type]


def _judged(results: Results) -> dict[str, tuple[str, str]]:
    """Target name -> (measured, result) as the report's targets table gives them."""
    return {name: (measured, result) for name, measured, _, result in
            (report.judge(target, results) for target in report.TARGETS)}


def _ratios(results: Results) -> dict[str, str]:
    return {name: measured for name, measured, *_ in (report.judge(r, results) for r in report.RATIOS)}


def test_the_served_runtime_is_compared_with_onnx_runtime_per_photo() -> None:
    results = _results(ceiling=[
        _ceiling("obama.jpg", "served", "openvino: detector f32, embedder bf16", 40.0, 30.0),
        _ceiling("obama.jpg", "onnxruntime", "onnxruntime f32", 28.0, 50.0),
        _ceiling("t1.jpg", "served", "openvino: detector f32, embedder bf16", 12.0, 60.0),
        _ceiling("t1.jpg", "onnxruntime", "onnxruntime f32", 8.0, 90.0)])
    found = _judged(results)
    prefix = "in-process ceiling, served runtime / ONNX Runtime on the same files"
    assert found[f"{prefix}, obama.jpg"] == ("40.0 / 28.0 images/s = 1.43", "**pass**")  # >= 1.3
    assert found[f"{prefix}, t1.jpg"] == ("12.0 / 8.0 images/s = 1.50", "**falls short**")  # >= 1.7
    assert _ratios(results)["ceiling, served runtime / ONNX Runtime, t1.jpg"].endswith("= 1.50")
    # REST identify is held against the ceiling of the runtime it serves, not ONNX Runtime's
    results.stack = [_row("REST identify", "obama.jpg", 8, 30.0)]
    assert _judged(results)["REST identify at concurrency 8 / in-process ceiling of the same runtime, "
                            "obama.jpg"] == ("30.0 / 40.0 images/s = 0.75", "**falls short**")
    assert _judged(results)["REST identify at concurrency 8 / in-process ceiling of the same runtime, "
                            "t1.jpg"] == ("—", "not measured")


def test_plain_and_served_naive_baselines_per_photo() -> None:
    results = _results(naive=[_row("naive served /embed", p, 8, 10.0) for p in ("obama.jpg", "t1.jpg")],
                       naive_plain=[_row("naive plain /embed", "obama.jpg", 8, 10.0),
                                    _row("naive plain /embed", "t1.jpg", 8, 5.0)],
                       stack=[_row("REST identify", "obama.jpg", 8, 15.0),
                              _row("REST identify", "t1.jpg", 8, 9.5)])
    found = _judged(results)
    assert found["REST identify / naive plain, concurrency 8, obama.jpg"][1] == "**falls short**"  # 1.5x
    assert found["REST identify / naive plain, concurrency 8, t1.jpg"][1] == "**falls short**"  # 1.9x
    assert found["REST identify / naive served, concurrency 8, obama.jpg"][1] == "**pass**"
    assert found["REST identify / naive served, concurrency 8, t1.jpg"] == ("9.5 / 10.0 images/s = 0.95",
                                                                             "**pass**")


def test_load_memory_and_gateway_targets() -> None:
    stack = [_row("REST identify", "obama.jpg", c, t, p50=p50, p99=p99, gateway_ms=g, triton_mib=m)
             for c, t, p50, p99, g, m in ((1, 10.0, 50.0, 60.0, 2.5, 800.0),
                                          (4, 20.0, 200.0, 500.0, 2.6, 900.0),
                                          (8, 20.0, 400.0, 1300.0, 3.5, 1000.0),
                                          (16, 19.5, 800.0, 1600.0, 3.8, 1400.0))]
    load = _row("REST identify (memory run)", "obama.jpg", 16, 19.0)
    memory = MemoryRun(0.5, 16, 1.0, [0.0, 1.0, 2.0], {"gateway": [150.0, 151.0, 150.0],
                                                       "triton": [1400.0, 1500.0, 1600.0]}, load)
    found = _judged(_results(stack=stack, memory=memory))
    assert found["REST identify throughput at concurrency 16 / at its best concurrency, obama.jpg"] == (
        "19.5 / 20.0 images/s = 0.97", "**pass**")
    assert found["REST identify p99 / p50 at concurrency 8, obama.jpg"] == ("1300.0 / 400.0 ms = 3.25",
                                                                            "**falls short**")
    assert found["Triton tree PSS (server + Python-backend stubs) at concurrency 16"] == (
        "1600.0 MiB", "**falls short**")  # the memory run's largest sample
    assert found["gateway CPU per identify at concurrency 8, obama.jpg"] == ("3.5 ms", "**falls short**")
    assert found["Triton tree PSS over the memory run: largest deviation from its start"] == (
        "14.3 %", "**falls short**")  # 1400 -> 1600 MiB
    assert found["gateway PSS over the memory run: largest deviation from its start"][1] == "**pass**"
    # the in_process layout: no split of face_pipeline's time in Triton's statistics, so not measured
    name = ("face_pipeline ms outside the two networks per 1-face image, Triton statistics, gRPC at "
            "concurrency 8")
    assert found[name] == ("—", "not measured")
    grpc = _row("gRPC face_pipeline", "obama.jpg", 8, 20.0)
    grpc.triton = {"face_pipeline": {"outside_models_ms_per_image": 2.5}}
    assert _judged(_results(stack=[grpc]))[name] == ("2.5 ms", "**pass**")


def test_the_ceiling_runs_both_runtimes_on_the_served_files(photos: dict[str, Path], cpu_repository: Path,
                                                             exported_precisions: dict[str, str],
                                                             served_runtime: str) -> None:
    models = served_models(cpu_repository)
    served = models.embedder_runtime
    assert served.runtime is Runtime.OPENVINO and served.precision == exported_precisions["embedder"]
    ort = models.on_runtime(Runtime.ONNXRUNTIME)
    assert ort.runtime == "onnxruntime f32" and ort.embedder_file == models.embedder_file
    options = ceiling.CeilingOptions(seconds=0.3, repeats=1, split_repeats=1, detector_batches=(1,),
                                     embedder_batches=(1, 2), threads=(1,), layouts=((1, 1),))
    rows = ceiling.run(models, {"obama.jpg": photos["obama.jpg"].read_bytes()}, options)
    by_variant = {r.variant: r for r in rows}
    assert set(by_variant) == {"served", "onnxruntime"}
    assert by_variant["served"].runtime == served_runtime
    assert by_variant["onnxruntime"].runtime == "onnxruntime f32"
    for row in rows:
        assert row.faces == 1 and row.images_per_s > 0 and row.single_image_ms > 0
    text = table(rows, report.CEILING)
    assert f"| {served_runtime} |" in text and "| onnxruntime f32 |" in text


def test_paired_rounds_time_each_call_in_turn_after_the_warm_up() -> None:
    order: list[str] = []
    calls = {name: (lambda name=name: order.append(name)) for name in (latency.CEILING, "gRPC face_pipeline",
                                                                        "REST identify")}
    times = latency.alternate(calls, rounds=3, pause_s=0.0, warmup=2)
    assert order == [latency.CEILING, "gRPC face_pipeline", "REST identify"] * 5  # 2 warm-up + 3 kept
    assert {name: len(ms) for name, ms in times.items()} == dict.fromkeys(calls, 3)
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        latency.alternate(calls, rounds=0)

    summary = latency.summarize("obama.jpg", {latency.CEILING: [10.0, 40.0, 20.0],
                                              "gRPC face_pipeline": [11.0, 44.0, 22.0],
                                              "REST identify": [30.0, 48.0, 24.0]}, threads=2, pause_s=0.03)
    assert (summary.ceiling_ms, summary.grpc_ms, summary.rest_ms, summary.rounds) == (20.0, 22.0, 30.0, 3)
    assert summary.p50_ms("REST identify") / summary.ceiling_ms == 1.5  # the medians' ratio: the target's
    assert summary.rest_paired == pytest.approx(1.2)  # the rounds' own ratios: 3.0, 1.2, 1.2
    assert summary.grpc_paired == pytest.approx(1.1) and summary.pause_ms == 30.0


def test_the_latency_target_takes_the_paired_rounds_when_the_run_has_them() -> None:
    """The closed-loop p50 and the ceiling part were measured minutes apart (here 60 against 27 ms: short);
    the paired rounds timed them in turn (30 against 25 ms: 1.2x) and decide."""
    served = _ceiling("obama.jpg", "served", "openvino: detector bf16, embedder bf16", 25.0, 20.0)
    stack = [_row("REST identify", "obama.jpg", 1, 16.0, p50=60.0),
             _row("gRPC face_pipeline", "obama.jpg", 1, 18.0, p50=55.0)]
    name = "REST identify p50 at concurrency 1 / the ceiling's single image, obama.jpg"
    closed = ("60.0 / 27.0 ms = 2.22", "**falls short**")  # its split: 27 ms
    assert _judged(_results(ceiling=[served], stack=stack))[name] == closed
    paired = latency.PairedLatency("obama.jpg", 200, 2, 30.0, 25.0, 27.0, 30.0, 1.07, 1.19)
    results = _results(ceiling=[served], stack=stack, paired_latency=[paired])
    found = _judged(results)
    assert found[name] == ("30.0 / 25.0 ms (paired rounds) = 1.20", "**pass**")
    assert found["gRPC face_pipeline p50 at concurrency 1 / the ceiling's single image, obama.jpg"] == (
        "27.0 / 25.0 ms (paired rounds) = 1.08", "**pass**")
    ratios = _ratios(results)
    assert ratios[f"{name}, paired rounds"] == "30.0 / 25.0 ms = 1.20"
    assert ratios[f"{name}, closed loop"] == closed[0]  # beside it
    again = Results.from_json(results.to_json())  # results.json keeps them
    assert again.paired_latency == [paired]


def test_holding_at_16_is_decided_by_alternating_rounds_when_the_run_has_them() -> None:
    """The sweep's 16 (17.0 images/s) against its best window (20.0 at 8) says 85 %; the two alternating
    back to back say 98 % and decide."""
    stack = [_row("REST identify", "obama.jpg", c, t) for c, t in ((4, 18.0), (8, 20.0), (16, 17.0))]
    name = "REST identify throughput at concurrency 16 / at its best concurrency, obama.jpg"
    assert _judged(_results(stack=stack))[name] == ("17.0 / 20.0 images/s = 0.85", "**falls short**")
    check = HoldCheck("obama.jpg", 8, 16, 5.0, [20.0, 19.0, 21.0], [19.6, 18.8, 20.0])
    assert [round(s, 3) for s in check.shares] == [0.98, 0.989, 0.952] and check.share == pytest.approx(0.98)
    assert _judged(_results(stack=stack, hold=[check]))[name] == ("0.98, the median of 0.98 / 0.99 / 0.95",
                                                                  "**pass**")
    sinking = HoldCheck("obama.jpg", 8, 16, 5.0, [20.0, 20.0, 20.0], [17.0, 18.0, 18.5])
    assert _judged(_results(stack=stack, hold=[sinking]))[name][1] == "**falls short**"
    again = Results.from_json(_results(stack=stack, hold=[check]).to_json())
    assert again.hold == [check]


def test_the_hold_check_alternates_the_two_concurrencies(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[int] = []

    def measure_rest(running: object, name: str, data: bytes, concurrency: int, seconds: float) -> LoadRow:
        sent.append(concurrency)
        return _row("REST identify", name, concurrency, 10.0 + concurrency / 16, p50=seconds)

    monkeypatch.setattr(stack_part, "measure_rest", measure_rest)
    check = stack_part.hold_check(None, "t1.jpg", b"jpeg", best=4, high=16, seconds=2.0, rounds=3)  # type: ignore[arg-type]
    assert sent == [4, 16] * 3
    assert check.best == [10.25] * 3 and check.high == [11.0] * 3 and check.errors == 0
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        stack_part.hold_check(None, "t1.jpg", b"jpeg", best=4, high=16, seconds=2.0, rounds=0)  # type: ignore[arg-type]

    checked: list[tuple[str, int, int]] = []

    def hold_check(running: object, name: str, data: bytes, best: int, high: int, seconds: float,
                   rounds: int = stack_part.HOLD_ROUNDS) -> HoldCheck:
        checked.append((name, best, high))
        return HoldCheck(name, best, high, seconds, [1.0], [1.0])

    monkeypatch.setattr(stack_part, "hold_check", hold_check)
    sweep = [_row("REST identify", "obama.jpg", 8, 20.0), _row("REST identify", "obama.jpg", 16, 19.0),
             _row("REST identify", "t1.jpg", 8, 9.0), _row("REST identify", "t1.jpg", 16, 10.0)]
    photos = {"obama.jpg": b"1", "t1.jpg": b"6"}

    def hold(*argv: str) -> list[HoldCheck]:
        run = bench_main.Run(bench_main.plan(bench_main.arguments().parse_args(["--quick", *argv])),
                             _results(stack=sweep), photos, None, Path(), Path(), stack=object())  # type: ignore[arg-type]
        bench_main.hold(run)
        return run.results.hold

    checks = hold()
    assert checked == [("obama.jpg", 8, 16)]  # t1.jpg was best at 16 already
    assert [c.seconds for c in checks] == [1.0]  # half the --quick plan's 2 s
    assert hold("--concurrency", "1", "8") == []
