"""Smoke tests of the serving benchmarks (``python -m bench``) at tiny durations.

No wall-clock thresholds: they check that every part runs, that the report has its structure, that the
ratios and targets are computed from measured numbers, and that perf_analyzer either measured or the
report says why not (never a made-up figure).
"""

from __future__ import annotations

import base64
import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest

import facecore.pipeline as pipeline_module
from bench import __main__ as bench_main
from bench import ceiling, perf_analyzer, report
from bench.common import LoadRow, served_models, statistics_delta
from bench.stack import MemoryRun
from facecore.onnx_runtime import OnnxDetector, OnnxEmbedder, create_session
from facecore.processing import letterbox


def test_triton_statistics_give_time_outside_the_networks() -> None:
    """face_pipeline's executions took 100 ms for 4 images; its BLS calls waited 30 + 50 ms."""
    zero = {"items": 0.0, "executions": 0.0, "requests": 0.0, "request_ns": 0.0, "queue_ns": 0.0,
            "compute_ns": 0.0, "exec_compute_ns": 0.0}
    after = {
        "face_pipeline": {**zero, "items": 4, "executions": 2, "requests": 4, "request_ns": 4 * 60e6,
                          "queue_ns": 4 * 5e6, "compute_ns": 4 * 50e6, "exec_compute_ns": 100e6},
        "face_detector": {**zero, "items": 4, "executions": 2, "requests": 2, "request_ns": 30e6,
                          "queue_ns": 2e6, "exec_compute_ns": 28e6},
        "face_embedder": {**zero, "items": 4, "executions": 2, "requests": 2, "request_ns": 50e6,
                          "queue_ns": 2e6, "exec_compute_ns": 48e6},
    }
    rows = statistics_delta({name: zero for name in after}, after)
    pipeline = rows["face_pipeline"]
    assert pipeline["avg_batch"] == 2 and pipeline["queue_ms_per_request"] == pytest.approx(5)
    assert pipeline["compute_ms_per_exec"] == pytest.approx(50) and pipeline["compute_ms_per_item"] == 25
    assert pipeline["outside_models_ms_per_image"] == pytest.approx((100 - 30 - 50) / 4)
    assert rows["face_embedder"]["request_ms"] == pytest.approx(25)


def test_stage_split_times_the_real_pipeline(photos: dict[str, Path], cpu_repository: Path) -> None:
    models = served_models(cpu_repository)
    data = photos["obama.jpg"].read_bytes()
    split = ceiling.stage_split(models, models.settings, data, threads=1, repeats=2)
    assert split.faces == 1 and set(split.stages_ms) == set(ceiling.STAGES)
    assert all(split.stages_ms[s] > 0 for s in ceiling.STAGES if s != "other")
    assert 0 < split.outside_models_ms < split.total_ms
    assert vars(pipeline_module)["letterbox"] is letterbox  # the timers are gone again
    # process() is face_pipeline's work: the same faces as the served pipeline would return
    detector = OnnxDetector(models.settings.detector, create_session(models.detector_file, 1))
    embedder = OnnxEmbedder(models.settings.embedder, create_session(models.embedder_file, 1))
    (result,) = ceiling.process([data], models.settings, detector, embedder)
    np.testing.assert_allclose(np.linalg.norm(result.embeddings, axis=1), 1.0, rtol=1e-5)


def test_memory_flatness_and_quick_plan() -> None:
    load = LoadRow("REST identify", "obama.jpg", 8, 10, 0, 1.0, 10.0, 1, 2, 3, 1.0)
    run = MemoryRun(1.0, 8, 5.0, [0, 30, 60], {"gateway": [100.0, 108.0, 105.0]}, load)
    flat = run.flatness("gateway")
    assert flat["max_deviation_pct"] == pytest.approx(8.0) and flat["end_change_pct"] == pytest.approx(5.0)
    quick = bench_main.plan(bench_main.arguments().parse_args(["--quick"]))
    assert quick.seconds == 2 and quick.memory_minutes == 0.5 and quick.ceiling.embedder_batches == (1, 4, 16)
    full = bench_main.plan(bench_main.arguments().parse_args([]))
    assert full.seconds == 10 and full.memory_minutes == 10 and full.gallery_args == ("--quick",)
    assert full.ceiling.layouts == ((1, 1), (1, 2), (2, 1)) and full.pa.concurrency == (1, 2, 4, 8)


def test_perf_analyzer_is_fetched_by_pin_and_gets_real_jpeg_data(tmp_path: Path,
                                                                  photos: dict[str, Path]) -> None:
    binary = perf_analyzer.install()
    assert binary.exists() and binary.stat().st_mode & 0o111
    assert (binary.parent.parent / "lib" / "libb64.so.0d").exists()
    jpeg = photos["obama.jpg"].read_bytes()
    written = perf_analyzer.write_input_data(tmp_path / "input.json", [jpeg])
    (entry,) = json.loads(written.read_text())["data"]
    assert entry["IMAGE"]["shape"] == [1]
    raw = base64.b64decode(entry["IMAGE"]["content"]["b64"])
    assert struct.unpack("<I", raw[:4])[0] == len(jpeg) and raw[4:] == jpeg  # Triton's BYTES serialization
    try:
        assert "2.51" in perf_analyzer.version(binary)
    except perf_analyzer.PerfAnalyzerUnavailable as exc:  # the report must then say why; checked below
        pytest.skip(f"perf_analyzer cannot run here: {exc}")


def test_a_perf_analyzer_that_cannot_run_is_reported_with_its_error(tmp_path: Path) -> None:
    input_file = perf_analyzer.write_input_data(tmp_path / "input.json", [b"\xff\xd8not really"])
    result = perf_analyzer.run(tmp_path / "missing" / "perf_analyzer", "127.0.0.1:1", "obama.jpg",
                               input_file, perf_analyzer.PaOptions(concurrency=(1,)), tmp_path)
    assert result.rows == [] and result.error
    text = perf_analyzer.table([result])
    assert "did not complete" in text and "produced no measurement" in text
    results = report.Results("python -m bench", "today", "test machine", {}, perf_analyzer=[result])
    document = report.document(results, {})
    assert "perf_analyzer did not complete" in document and result.error.split(":")[0] in document


CSV_HEADER = ",".join(["Concurrency", "Inferences/Second", "Client Send", "Network+Server Send/Recv",
                       "Server Queue", "Server Compute Input", "Server Compute Infer",
                       "Server Compute Output", "Client Recv", "p50 latency", "p90 latency", "p95 latency",
                       "p99 latency"])
#: Stands in for perf_analyzer: unstable at the strict threshold, a CSV (its last argument) when relaxed.
FAKE_PERF_ANALYZER = f"""#!/bin/sh
case "$*" in *--version*) echo "Perf Analyzer Version 2.51.0 (fake)"; exit 0;; esac
for last; do :; done
case "$*" in *"-percentage 30 "*) echo "Failed to obtain stable measurement"; exit 2;; esac
cat > "$last" <<CSV
{CSV_HEADER}
4,12.5,35,4954,47515,105,382711,1301,4,424599,618032,636431,758232
CSV
"""


def test_an_unstable_perf_analyzer_measurement_is_repeated_and_marked(tmp_path: Path) -> None:
    binary = tmp_path / "bin" / "perf_analyzer"
    binary.parent.mkdir()
    binary.write_text(FAKE_PERF_ANALYZER)
    binary.chmod(0o755)
    input_file = perf_analyzer.write_input_data(tmp_path / "input.json", [b"jpeg"])
    result = perf_analyzer.run(binary, "127.0.0.1:1", "obama.jpg", input_file,
                               perf_analyzer.PaOptions(concurrency=(4,)), tmp_path)
    assert result.error is None and result.version.startswith("Perf Analyzer Version 2.51.0")
    (row,) = result.rows
    assert (row.concurrency, row.throughput, row.stable) == (4, 12.5, False)
    assert row.p50_ms == pytest.approx(424.599) and row.server_queue_ms == pytest.approx(47.515)
    assert row.server_compute_ms == pytest.approx(0.105 + 382.711 + 1.301)
    assert "stable: no" in perf_analyzer.table([result])


@pytest.mark.triton
def test_the_whole_suite_runs_and_writes_the_report(tmp_path: Path, cpu_repository: Path) -> None:
    out = tmp_path / "benchmarks"
    argv = ["--quick", "--seconds", "1", "--memory-minutes", "0.1", "--concurrency", "1", "8",
            "--photos", "obama.jpg", "--naive-threads", "1", "--layouts", "1x1", "--no-fixed",
            "--pa-concurrency", "1", "--pa-measurement-ms", "500", "--enroll-images", "8",
            "--gallery-sizes", "1000", "--gallery-dims", "16", "--repository", str(cpu_repository),
            "--out", str(out)]
    code = bench_main.main(argv)
    results = json.loads((out / "results.json").read_text())
    assert code == 0, results["errors"]
    text = (out / "README.md").read_text()
    body = report.section(text)
    assert "python -m bench --quick --seconds 1" in body and "Machine: " in body and "onnxruntime" in body
    for heading in ("### Targets", "### Ratios", "### Ceiling", "### Naive baseline", "### Our stack",
                    "### perf_analyzer", "### Memory", "### Gallery search scaling", "### Enrollment"):
        assert heading in body, heading

    targets = _table(body, "### Targets")
    assert len(targets) == 10
    assert {row[2] for row in targets} <= {"**pass**", "**falls short**"}, targets  # all measured
    assert all(row[3] != "—" for row in targets if row[2] == "**falls short**")  # a reason when short

    ratios = {row[0]: float(row[1]) for row in _table(body, "### Ratios")}
    for name in ("REST identify / ceiling, obama.jpg, concurrency 8", "REST identify / naive, obama.jpg, "
                 "concurrency 8", "gRPC face_pipeline / naive, obama.jpg, concurrency 8",
                 "REST identify p50 at concurrency 1 / ceiling single image, obama.jpg"):
        assert name in ratios and math.isfinite(ratios[name]) and ratios[name] > 0, (name, ratios)

    stack = {(r["target"], r["concurrency"]): r for r in results["stack"]}
    grpc = stack[("gRPC face_pipeline", 8)]
    assert grpc["requests"] > 0 and grpc["errors"] == 0 and grpc["client_cpu_ms"] > 0
    pipeline = grpc["triton"]["face_pipeline"]
    assert pipeline["items"] > 0 and "outside_models_ms_per_image" in pipeline
    assert set(grpc["rss_mib"]) == {"gateway", "triton"}
    memory = results["memory"]
    assert len(memory["times_s"]) >= 3 and set(memory["rss_mib"]) == {"gateway", "triton"}

    (pa,) = results["perf_analyzer"]
    assert pa["rows"] or pa["error"]  # measured, or the reason it could not be
    if pa["rows"]:
        assert pa["rows"][0]["concurrency"] == 1 and pa["rows"][0]["throughput"] > 0
    else:
        assert "did not complete" in body

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "plots skipped" in body
    else:
        for name in ("throughput.png", "latency.png", "memory.png"):
            assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            assert f"]({name})" in body
    assert "bench.gallery:start" in (out / "gallery.md").read_text()


def _table(body: str, heading: str) -> list[list[str]]:
    """The rows of the first Markdown table after ``heading`` (header and separator left out)."""
    lines = body.split(heading, 1)[1].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[first + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows
