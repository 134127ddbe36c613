"""Smoke tests of the serving benchmarks (``python -m bench``) at tiny durations.

No wall-clock thresholds: they check that every part runs, that the report has its structure and that the
ratios and targets are computed from measured numbers.
"""

from __future__ import annotations

import json
import math
from contextlib import ExitStack
from pathlib import Path

import cv2
import httpx
import numpy as np
import pytest

import facecore.pipeline as pipeline_module
from bench import __main__ as bench_main
from bench import ceiling, naive, report
from bench.core.inputs import served_models
from bench.core.load import LoadRow
from bench.core.reporting import read_section
from bench.core.triton import statistics_delta
from bench.results import Results
from bench.stack import VARIANT_SIZES, MemoryRun, shape_variants
from export.profiles import Profile, ProfileTuning
from facecore.onnx_runtime import OnnxDetector, OnnxEmbedder, create_session
from facecore.processing import letterbox
from tests import ROOT


def test_the_recorded_report_is_rendered_from_its_results() -> None:
    """docs/benchmarks/README.md is what the report code writes for docs/benchmarks/runs/results.json.
    After a change to bench/report.py: `python -m bench.report --rerender docs/benchmarks`."""
    folder = ROOT / "docs" / "benchmarks"
    results = Results.from_json(json.loads((folder / report.RESULTS).read_text()))
    assert results.ceiling and results.stack and results.memory
    recorded = read_section((folder / "README.md").read_text(), report.SECTION).strip()
    assert report.document(results) == recorded
    assert len(_table(recorded, "### Targets")) == len(report.TARGETS) == 22


def test_triton_statistics_give_time_outside_the_networks() -> None:
    """Over the interval face_pipeline computed 100 ms for 3 images; its BLS calls waited 29 + 49 ms."""
    zero = {"items": 0.0, "requests": 0.0, "request_ns": 0.0, "exec_compute_ns": 0.0}
    after = {
        "face_pipeline": {"items": 4, "requests": 4, "request_ns": 4 * 60e6, "exec_compute_ns": 100e6},
        "face_detector": {"items": 4, "requests": 2, "request_ns": 30e6, "exec_compute_ns": 28e6},
        "face_embedder": {"items": 4, "requests": 2, "request_ns": 50e6, "exec_compute_ns": 48e6},
    }
    before = {name: {**zero, "items": 1.0, "request_ns": 1e6} for name in after}
    rows = statistics_delta(before, after)
    pipeline = rows["face_pipeline"]
    assert pipeline["items"] == 3 and pipeline["exec_compute_ns"] == 100e6  # the counters' change
    assert pipeline["outside_models_ms_per_image"] == pytest.approx((100 - 29 - 49) / 3)
    assert "outside_models_ms_per_image" not in rows["face_embedder"]
    # the in_process layout: the networks run inside face_pipeline, the two models are never called,
    # so there is no split (not the pipeline's whole time passed off as its time outside the networks)
    idle = {**after, "face_detector": zero, "face_embedder": zero}
    split = statistics_delta({name: zero for name in after}, idle)["face_pipeline"]
    assert "outside_models_ms_per_image" not in split


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


def test_shape_variants_give_every_detector_input_shape(photos: dict[str, Path]) -> None:
    """The memory run's images: one JPEG per size, each a different detector input (longer side 640)."""
    variants = shape_variants(photos["obama.jpg"].read_bytes())
    decoded = [cv2.imdecode(np.frombuffer(v, np.uint8), cv2.IMREAD_COLOR) for v in variants]
    assert [(d.shape[1], d.shape[0]) for d in decoded] == list(VARIANT_SIZES)
    assert len(set(VARIANT_SIZES)) == len(VARIANT_SIZES) == 37
    with pytest.raises(ValueError, match="not an image"):
        shape_variants(b"nothing")


def test_memory_flatness_and_quick_plan() -> None:
    load = LoadRow("REST identify", "obama.jpg", 8, 10, 0, 1.0, 10.0, 1, 2, 3, 1.0)
    run = MemoryRun(1.0, 8, 5.0, [0, 30, 60], {"gateway": [100.0, 108.0, 105.0]}, load)
    flat = run.flatness("gateway")
    assert flat["max_deviation_pct"] == pytest.approx(8.0) and (flat["start"], flat["end"]) == (100, 105)
    quick = bench_main.plan(bench_main.arguments().parse_args(["--quick"]))
    assert quick.seconds == 2 and quick.memory_minutes == 0.5 and quick.ceiling.embedder_batches == (1, 4, 16)
    full = bench_main.plan(bench_main.arguments().parse_args([]))
    assert full.seconds == 10 and full.memory_minutes == 10 and full.gallery_args == ("--quick",)
    assert full.ceiling.layouts == ((1, 1), (1, 2), (2, 1))


def test_the_plain_embedder_is_the_served_network(tmp_path: Path, photos: dict[str, Path],
                                                  cpu_repository: Path) -> None:
    """Built from the pinned int8 file without the PReLU rewrite, it gives the served embeddings."""
    models = served_models(cpu_repository)
    faces = {name: photos[name].read_bytes() for name in ("obama.jpg", "t1.jpg")}
    target = tmp_path / "sface.prelu.onnx"
    prepared = naive.prepare(models, faces, target)
    assert prepared.built and prepared.prelu_nodes > 0 and prepared.served_prelu_nodes == 0
    assert prepared.faces == 2 * 7 and prepared.max_abs_diff <= naive.TOLERANCE
    settings = prepared.models.settings
    assert not settings.dynamic_input and settings.decode_min_side == 0
    assert prepared.models.embedder_file == target and prepared.models.detector_file == naive.PLAIN_DETECTOR
    # plain feeds the original float NCHW detector on ONNX Runtime (tests/export checks its uint8 edit)
    assert settings.detector.input_layout == "nchw_float"
    assert models.settings.detector.input_layout == "nhwc_uint8"
    assert prepared.models.runtime == "onnxruntime f32" and models.runtime.startswith("openvino")
    assert not naive.prepare(models, faces, target).built  # reused
    assert "PRelu nodes" in prepared.describe() and "float NCHW" in prepared.describe()


def test_the_naive_app_runs_every_variant(tmp_path: Path, photos: dict[str, Path], cpu_repository: Path,
                                          exported_precisions: dict[str, str]) -> None:
    """served (OpenVINO at the served precisions) and plain (ONNX Runtime, the float detector) each run
    what they say and find the same faces (that their decisions agree is
    tests/export/test_work_reduction.py's)."""
    models = served_models(cpu_repository)
    data = {name: photos[name].read_bytes() for name in ("obama.jpg", "obama2.jpg", "t1.jpg")}
    plain_models = naive.prepare(models, data, tmp_path / "sface.prelu.onnx").models
    log_file = tmp_path / "naive.log"
    with ExitStack() as stack:
        variants = {naive.SERVED: models, naive.PLAIN: plain_models}
        servers = [stack.enter_context(naive.naive_server(variants[v], 1, v, log_file))
                   for v in naive.VARIANTS]
        health = {s.variant: httpx.get(f"{s.url}/health", timeout=30).json() for s in servers}
        assert health["served"]["dynamic_input"] and health["served"]["embedder_prelu_nodes"] == 0
        assert health["served"]["detector_runtime"] == "openvino:" + exported_precisions["detector"]
        assert health["served"]["embedder_runtime"] == "openvino:" + exported_precisions["embedder"]
        assert health["served"]["detector_input_layout"] == "nhwc_uint8"
        assert not health["plain"]["dynamic_input"] and health["plain"]["embedder_prelu_nodes"] > 0
        assert health["plain"]["detector_input_layout"] == "nchw_float"
        assert health["plain"]["detector_runtime"] == "onnxruntime:f32"
        for server in servers:
            faces = [httpx.post(f"{server.url}/embed", files={"image": (name, image, "image/jpeg")},
                                timeout=60).json()["faces"] for name, image in data.items()]
            assert [len(found) for found in faces] == [1, 1, 6]
        row = naive.measure_once(servers[-1], "obama.jpg", data["obama.jpg"], 1, 0.3)
        assert row.target == "naive plain /embed, 1 intra-op thread" and row.requests > 0 and row.errors == 0
    # the app refuses a plain variant whose embedder has no PReLU left, or that runs the uint8 detector
    with pytest.raises(RuntimeError, match="exited"), naive.naive_server(models, 1, naive.PLAIN, log_file):
        pass


def _row(target: str, throughput: float, concurrency: int = 8) -> LoadRow:
    return LoadRow(target, "obama.jpg", concurrency, 100, 0, 1.0, throughput, 10, 20, 30, 1.0,
                   {"server": 2000 / throughput})


@pytest.mark.parametrize(("plain_throughput", "status"), [(30.0, "**pass**"), (45.0, "**falls short**")])
def test_the_1_6x_target_uses_the_plain_baseline(plain_throughput: float, status: str) -> None:
    results = Results("python -m bench", "today", "test machine", {},
                      naive=[_row(naive.target_name(1, naive.SERVED), 50.0)],
                      naive_plain=[_row(naive.target_name(1, naive.PLAIN), plain_throughput)],
                      stack=[_row("REST identify", 60.0), _row("gRPC face_pipeline", 65.0)],
                      plain_check="checked")
    document = report.document(results)
    found = {row[0]: row for row in _table(document, "### Targets")}
    assert found["REST identify / naive served, concurrency 8, obama.jpg"][3] == "**pass**"
    reduced = found["REST identify / naive plain, concurrency 8, obama.jpg"]
    measured = f"60.0 / {plain_throughput:.1f} images/s = {60 / plain_throughput:.2f}"
    assert reduced[1:] == [measured, ">= 1.6", status]
    ratios = {row[0]: row[1] for row in _table(document, "### Ratios")}
    for name, value in (("REST identify / naive plain, concurrency 8, obama.jpg", 60 / plain_throughput),
                        ("gRPC face_pipeline / naive plain, concurrency 8, obama.jpg", 65 / plain_throughput),
                        ("gRPC face_pipeline / naive served, concurrency 8, obama.jpg", 65 / 50),
                        ("naive served / naive plain, concurrency 8, obama.jpg", 50 / plain_throughput)):
        assert ratios[name].endswith(f"= {value:.2f}"), name
    assert "| plain baseline's networks | checked |" in document
    assert "| naive plain /embed, 1 intra-op thread | obama.jpg | 8 |" in document


@pytest.mark.triton
def test_the_whole_suite_runs_and_writes_the_report(tmp_path: Path, cpu_repository: Path,
                                                    served_runtime: str) -> None:
    out = tmp_path / "benchmarks"
    argv = ["--quick", "--seconds", "1", "--memory-minutes", "0.1", "--concurrency", "1", "8", "16",
            "--photos", "obama.jpg", "--layouts", "1x1",
            "--enroll-images", "8",
            "--latency-rounds", "5",
            "--gallery-sizes", "1000", "--gallery-dims", "16", "--repository", str(cpu_repository),
            "--out", str(out)]
    code = bench_main.main(argv)
    results = json.loads((out / report.RESULTS).read_text())
    assert code == 0, results["errors"]
    text = (out / "README.md").read_text()
    body = read_section(text, report.SECTION)
    assert "python -m bench --quick --seconds 1" in body and "| machine | " in body and "onnxruntime" in body
    for heading in ("### Targets", "### Ratios", "### Ceiling", "### Naive baselines and our stack",
                    "### Latency at concurrency 1, paired", "### Memory", "### Gallery search scaling",
                    "### Enrollment"):
        assert heading in body, heading

    targets = _table(body, "### Targets")
    assert [row[0] for row in targets] == [target.name for target in report.TARGETS]
    # all measured but the 6-face photo's (not in this run's settings) and, in the in_process layout (the
    # CPU default), face_pipeline's time outside the networks in Triton's statistics, which cannot tell
    not_measured = [row[0] for row in targets if row[3] == "not measured"]
    bls = ProfileTuning.default(Profile.CPU).layout == "bls"
    assert len([name for name in not_measured if "t1.jpg" in name]) == 7
    assert len([name for name in not_measured if "Triton statistics" in name]) == (0 if bls else 2)
    assert all(row[3] in ("**pass**", "**falls short**") for row in targets if row[0] not in not_measured)

    ratios = {row[0]: float(row[1].rsplit("= ", 1)[1]) for row in _table(body, "### Ratios")
              if row[1] != "—"}
    for name in ("REST identify / ceiling, concurrency 8, obama.jpg",
                 "REST identify / naive served, concurrency 8, obama.jpg",
                 "gRPC face_pipeline / naive plain, concurrency 8, obama.jpg",
                 "naive served / naive plain, concurrency 8, obama.jpg",
                 "REST identify p50 at concurrency 1 / the ceiling's single image, obama.jpg, paired rounds",
                 "ceiling, served runtime / ONNX Runtime, obama.jpg"):
        assert name in ratios and math.isfinite(ratios[name]) and ratios[name] > 0, (name, ratios)
    assert {r["target"] for r in results["naive"]} == {"naive served /embed, 1 intra-op thread"}
    assert {r["target"] for r in results["naive_plain"]} == {"naive plain /embed, 1 intra-op thread"}
    assert "PRelu nodes" in results["plain_check"]
    variants = {(c["photo"], c["variant"]): c for c in results["ceiling"]}
    assert set(variants) == {("obama.jpg", "served"), ("obama.jpg", "onnxruntime")}
    assert variants[("obama.jpg", "onnxruntime")]["runtime"] == "onnxruntime f32"
    assert variants[("obama.jpg", "served")]["runtime"] == served_runtime
    assert all(variants[("obama.jpg", v)]["images_per_s"] > 0 for v in ("served", "onnxruntime"))

    stack = {(r["target"], r["concurrency"]): r for r in results["stack"]}
    grpc = stack[("gRPC face_pipeline", 8)]
    assert grpc["requests"] > 0 and grpc["errors"] == 0 and grpc["client_cpu_ms"] > 0
    pipeline = grpc["triton"]["face_pipeline"]
    # the split of face_pipeline's time exists when it calls the networks as models (the BLS layout)
    assert pipeline["items"] > 0 and ("outside_models_ms_per_image" in pipeline) is bls
    assert set(grpc["rss_mib"]) == {"gateway", "triton"}
    (paired,) = results["paired_latency"]  # the ceiling, gRPC and REST in turn: the latency targets' figures
    assert paired["photo"] == "obama.jpg" and paired["rounds"] == 5
    assert all(paired[k] > 0 for k in ("ceiling_ms", "grpc_ms", "rest_ms", "grpc_paired", "rest_paired"))
    assert all("(paired rounds)" in row[1] for row in targets if "p50 at concurrency 1" in row[0])
    # throughput holding at 16: the sweep's best against 16, alternating (none when 16 was the best itself)
    best = max((r for r in results["stack"] if r["target"] == "REST identify"), key=lambda r: r["throughput"])
    if best["concurrency"] == 16:
        assert results["hold"] == []
    else:
        (hold,) = results["hold"]
        assert (hold["photo"], hold["best_concurrency"], hold["high_concurrency"]) == (
            "obama.jpg", best["concurrency"], 16)
        assert len(hold["best"]) == len(hold["high"]) == 3 and min(hold["high"]) > 0 and hold["errors"] == 0
        assert "the median of" in next(m for n, m, *_ in targets if "at concurrency 16 /" in n)
    memory = results["memory"]
    assert len(memory["times_s"]) >= 3 and set(memory["rss_mib"]) == {"gateway", "triton"}
    assert memory["shapes"] == len(VARIANT_SIZES) and memory["load"]["errors"] == 0
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
