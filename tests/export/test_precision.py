"""Runtime and precision choice: OpenVINO bf16 only where the CPU has it, runs it faster than f32 and the
accuracy check accepts it, f32 otherwise; the check refuses a precision that changes the faces
(export/precision.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

import export.precision as precision
import facecore.openvino_runtime as ov_runtime
from export.defaults import DefaultModels
from export.repository import served_detector
from facecore.contract import Faces
from facecore.openvino_runtime import Precision, usable_precision
from facecore.runtimes import Runtime, RuntimeChoice


@pytest.fixture(scope="module")
def reference(default_models: DefaultModels, photos: dict[str, Path]) -> precision.Reference:
    images = precision.check_images({k: v for k, v in photos.items() if k in ("t1.jpg", "obama.jpg")})
    m = default_models
    return precision.Reference.build(m.detector, m.detector_file, m.embedder, m.embedder_file, images)


def test_auto_is_bf16_only_where_the_cpu_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ov_runtime, "bf16_supported", lambda: False)
    assert precision._wanted("auto") == ["f32"]
    assert usable_precision(Precision.BF16) is Precision.F32  # a repository exported elsewhere
    monkeypatch.setattr(ov_runtime, "bf16_supported", lambda: True)
    assert precision._wanted("auto") == ["bf16", "f32"]
    assert usable_precision(Precision.BF16) is Precision.BF16
    assert precision._wanted("f32") == ["f32"] and precision._wanted("bf16") == ["bf16", "f32"]
    with pytest.raises(ValueError, match="auto, f32 or bf16"):
        precision._wanted("fp8")


def test_bf16_is_dropped_where_it_is_not_faster() -> None:
    """Some CPUs report bfloat16 and run it slower than f32: ``auto`` then never tries it, and says why."""
    kept, refused = precision.by_speed("embedder", ["bf16", "f32"], {"bf16": 9.0, "f32": 12.0})
    assert kept == ["bf16", "f32"] and refused == []
    kept, refused = precision.by_speed("detector", ["bf16", "f32"], {"bf16": 11.5, "f32": 12.0})
    assert kept == ["f32"]  # 4 % faster is within the noise: f32 (the exact one) is kept
    kept, refused = precision.by_speed("detector", ["bf16", "f32"], {"bf16": 41.6, "f32": 30.7})
    assert kept == ["f32"] and len(refused) == 1
    assert not refused[0].passed and refused[0].precision == "bf16" and refused[0].ms == 41.6
    assert "not faster on this CPU: 41.6 ms per call in bf16, 30.7 in f32" in refused[0].summary()
    assert precision.by_speed("detector", ["f32"], {"f32": 30.7}) == (["f32"], [])


@pytest.mark.parametrize(("bf16_ms", "chosen"), [(40.0, "f32"), (10.0, "bf16")])
def test_auto_chooses_by_accuracy_and_speed(default_models: DefaultModels, photos: dict[str, Path],
                                            monkeypatch: pytest.MonkeyPatch, tmp_path: Path, bf16_ms: float,
                                            chosen: str) -> None:
    """The export's choice end to end (the real accuracy checks on two photos, the timing replaced): bf16
    slower than f32 is refused before its accuracy is checked and the record says so; faster, it is
    checked and kept. The timings are recorded beside the checks, and the record is reused."""
    import export.fetch

    monkeypatch.setattr(ov_runtime, "bf16_supported", lambda: True)
    monkeypatch.setattr(export.fetch, "fetch_photos",
                        lambda *_: {k: v for k, v in photos.items() if k in ("t1.jpg", "obama.jpg")})
    timed: list[tuple[str, list[str]]] = []

    def timings(path: Path, batch: np.ndarray, threads: int, precisions: list[str]) -> dict[str, float]:  # type: ignore[type-arg]
        timed.append((path.name, list(precisions)))
        return {"f32": 20.0, "bf16": bf16_ms}

    monkeypatch.setattr(precision, "time_precisions", timings)
    m = default_models
    served = served_detector(m.detector, m.detector_file, tmp_path / "served.onnx", bf16_pairs=True)
    files = (m.detector, m.detector_file, m.embedder, m.embedder_file)
    checks = precision.choose_precisions(files, tmp_path / "served.onnx", served,
                                         RuntimeChoice(Runtime.OPENVINO, "f32", 1), "auto", "auto",
                                         artifacts=tmp_path)
    assert {n: c.precision for n, c in checks.items()} == {"detector": chosen, "embedder": chosen}
    assert checks["detector"].ms == (bf16_ms if chosen == "bf16" else 20.0)
    assert [name for name, _ in timed] == ["served.onnx", m.embedder_file.name]
    (record,) = (tmp_path / "precision").glob("*.json")
    reasons = [c["reason"] for c in json.loads(record.read_text()) if not c["passed"]]
    if chosen == "f32":
        assert len(reasons) == 2 and all(r.startswith("not faster on this CPU") for r in reasons)
    else:
        assert reasons == []
    timed.clear()
    again = precision.choose_precisions(files, tmp_path / "served.onnx", served,
                                        RuntimeChoice(Runtime.OPENVINO, "f32", 1), "auto", "auto",
                                        artifacts=tmp_path)
    assert again == checks and timed == []  # read back from the record
    if chosen == "f32":  # bf16 asked for by name: not timed, not answered by the record of ``auto``
        forced = precision.choose_precisions(files, tmp_path / "served.onnx", served,
                                             RuntimeChoice(Runtime.OPENVINO, "f32", 1), "bf16", "bf16",
                                             artifacts=tmp_path)
        assert {n: c.precision for n, c in forced.items()} == {"detector": "bf16", "embedder": "bf16"}
        assert timed == [] and all(c.ms == 0 for c in forced.values())


def test_precisions_are_timed_on_the_real_network(default_models: DefaultModels) -> None:
    batch = precision.timed_input(default_models.embedder, 2)
    assert batch.shape == (2, 3, 112, 112) and batch.dtype == np.float32
    timings = precision.time_precisions(default_models.embedder_file, batch, 1, ["f32", "bf16"], rounds=2,
                                        calls=1)
    assert set(timings) == {"f32", "bf16"} and all(0 < ms < 10_000 for ms in timings.values())


def test_openvino_f32_and_the_uint8_detector_pass(reference: precision.Reference,
                                                  default_models: DefaultModels, tmp_path: Path) -> None:
    served = served_detector(default_models.detector, default_models.detector_file, tmp_path / "u8.onnx")
    choice = RuntimeChoice(Runtime.OPENVINO, "f32", 2)
    detector = precision.check_detector(reference, served, tmp_path / "u8.onnx", choice)
    assert detector.passed and detector.faces == 21 and detector.worst_cosine > 0.9999, detector
    embedder = precision.check_embedder(reference, choice)
    assert embedder.passed and embedder.worst_cosine > 0.9999, embedder


def test_a_precision_that_moves_embeddings_is_refused(reference: precision.Reference,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A candidate that perturbs embeddings as a bad precision would: refused, and f32 is used instead."""
    real = precision.embedder

    def perturbed(spec, path, choice):  # type: ignore[no-untyped-def]
        run = real(spec, path, choice)
        if choice.precision == "f32":
            return run
        noise = np.random.default_rng(0).standard_normal((1, spec.embedding_dim)).astype(np.float32)
        return lambda batch: run(batch) + 3.0 * noise * np.linalg.norm(run(batch), axis=1, keepdims=True) / 11

    monkeypatch.setattr(precision, "embedder", perturbed)
    chosen, checks = precision.first_passing(["bf16", "f32"],
                                             lambda c: precision.check_embedder(reference, c),
                                             RuntimeChoice(Runtime.OPENVINO, "f32", 2))
    assert chosen == "f32"
    assert [c.passed for c in checks] == [False, True]
    assert "cosine" in checks[0].reason and checks[0].worst_cosine < precision.EMBEDDER_COSINE


def test_pipeline_comparison_names_what_changed(reference: precision.Reference) -> None:
    from dataclasses import replace

    faces = reference.faces
    choice = RuntimeChoice(Runtime.OPENVINO, "bf16")
    same = precision.compare_pipelines(faces, faces, 0.363, "detector", choice)
    assert same.passed and same.worst_iou == pytest.approx(1.0)
    moved = [replace(f, boxes=f.boxes + np.array([0, 0, 30, 30], np.float32)) for f in faces]
    assert "box IoU" in precision.compare_pipelines(faces, moved, 0.363, "detector", choice).reason
    fewer = [replace(f, boxes=f.boxes[:0], scores=f.scores[:0], embeddings=f.embeddings[:0]) for f in faces]
    result = precision.compare_pipelines(faces, fewer, 0.363, "detector", choice)
    assert not result.passed and "other faces found" in result.reason


def test_no_precision_passing_stops_the_export(reference: precision.Reference) -> None:
    def failing(choice: RuntimeChoice) -> precision.PrecisionCheck:
        return precision.PrecisionCheck("embedder", "openvino", choice.precision, False, 1, 0.5,
                                        reason="cosine")

    with pytest.raises(RuntimeError, match="no precision passed"):
        precision.first_passing(["bf16", "f32"], failing, RuntimeChoice())


def test_check_images_include_the_served_reduced_decode(photos: dict[str, Path]) -> None:
    """Reduced JPEG decoding is part of what is served, so the check sees those pixels too: that is where
    bf16 moved a face of t1.jpg enough to flip which face is the largest."""
    some = {k: v for k, v in photos.items() if k in ("t1.jpg", "obama.jpg")}
    plain, served = precision.check_images(some), precision.check_images(some, decode_min_side=640)
    assert len(plain) == 6 and len(served) == 7  # t1.jpg (1280 wide) is decoded at 1/2: one image more
    assert served[-1].shape == (443, 640, 3)


def test_faces_are_paired_by_overlap_not_by_rank(reference: precision.Reference) -> None:
    """Reduced precision can swap two near-equal scores: the same faces in another order are the same."""
    from dataclasses import replace

    group = next(f for f in reference.faces if len(f) == 6)
    order = np.array([1, 0, 2, 3, 4, 5])
    swapped = replace(group, boxes=group.boxes[order], scores=group.scores[order],
                      landmarks=group.landmarks[order], embeddings=group.embeddings[order],
                      blur=group.blur[order])
    result = precision.compare_pipelines([group], [swapped], 0.363, "detector", RuntimeChoice())
    assert result.passed and result.worst_cosine > 0.9999, result


def test_an_openvino_runner_infers_once_per_call(default_models: DefaultModels,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A network with three outputs (the detector) is one inference per call, its outputs reordered to the
    description's names (the runner once ran the whole detector for each output: 3x its cost)."""
    from facecore.runtimes import runner

    calls = []
    real = ov_runtime.Network.run

    def counted(self: ov_runtime.Network, batch: np.ndarray) -> list[np.ndarray]:  # type: ignore[type-arg]
        calls.append(batch.shape)
        return real(self, batch)

    monkeypatch.setattr(ov_runtime.Network, "run", counted)
    spec = default_models.detector
    run = runner(default_models.detector_file, spec.output_names, RuntimeChoice(Runtime.OPENVINO, "f32", 1))
    batch = np.zeros((1, 3, 160, 160), np.float32)
    loc, conf, landmarks = run(batch)
    assert len(calls) == 1
    assert (loc.shape[-1], conf.shape[-1], landmarks.shape[-1]) == (4, 2, 10)


@pytest.mark.skipif(not ov_runtime.bf16_supported(),
                    reason="this CPU has no native bfloat16 (AVX-512 BF16 or AMX): OpenVINO runs f32 here")
def test_the_bf16_detector_passes_only_with_its_output_weights_as_pairs(
        default_models: DefaultModels, photos: dict[str, Path], tmp_path: Path) -> None:
    """The real bf16 detector as the export checks it (every photo, three scales, the served reduced decode):
    with plain bf16 weights a small face's landmarks move and the check refuses it; with the heads' weights
    as bfloat16 pairs it passes with a margin."""
    m = default_models
    reference = precision.Reference.build(m.detector, m.detector_file, m.embedder, m.embedder_file,
                                          precision.check_images(photos, decode_min_side=640))
    choice = RuntimeChoice(Runtime.OPENVINO, "bf16", 1)
    plain = served_detector(m.detector, m.detector_file, tmp_path / "plain.onnx")
    paired = served_detector(m.detector, m.detector_file, tmp_path / "paired.onnx", bf16_pairs=True)
    refused = precision.check_detector(reference, plain, tmp_path / "plain.onnx", choice)
    accepted = precision.check_detector(reference, paired, tmp_path / "paired.onnx", choice)
    assert not refused.passed and refused.worst_cosine < precision.PIPELINE_COSINE, refused
    assert accepted.passed and accepted.worst_cosine > 0.995 and accepted.worst_iou > 0.98, accepted


@pytest.mark.parametrize("runtime", [Runtime.OPENVINO, Runtime.ONNXRUNTIME])
def test_a_solo_copy_runs_while_alone_and_reads_the_file_once(default_models: DefaultModels, runtime: Runtime,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``runner`` with ``Solo``: two copies of the network (1 and 2 threads; on OpenVINO compiled from one
    read of the file), the 2-thread one for calls made while ``alone()``; both give the same outputs."""
    from facecore.runtimes import Solo, runner

    real_core = ov_runtime.core()
    reads: list[str] = []

    class Counting:
        def read_model(self, path: str) -> object:
            reads.append(path)
            return real_core.read_model(path)

        def compile_model(self, *args: object) -> object:
            return real_core.compile_model(*args)

    monkeypatch.setattr(ov_runtime, "core", lambda: Counting())
    alone = [True]
    spec = default_models.embedder
    run = runner(default_models.embedder_file, spec.output_names, RuntimeChoice(runtime, "f32", 1),
                 Solo(2, lambda: alone[0]))
    batch = np.random.default_rng(1).uniform(0, 255, (2, 3, 112, 112)).astype(np.float32)
    solo = run(batch)[0]
    alone[0] = False
    shared = run(batch)[0]
    np.testing.assert_allclose(solo, shared, rtol=1e-4, atol=1e-4)
    assert reads == ([str(default_models.embedder_file)] if runtime is Runtime.OPENVINO else [])



def test_sub_batches_are_even_and_at_most_the_size() -> None:
    from facecore.runtimes import even_parts

    sizes = {(n, most): [part.stop - part.start for part in even_parts(n, most)]
             for n, most in ((10, 4), (12, 4), (6, 4), (5, 4), (4, 4), (1, 4), (17, 16))}
    assert sizes == {(10, 4): [3, 3, 4], (12, 4): [4, 4, 4], (6, 4): [3, 3], (5, 4): [2, 3], (4, 4): [4],
                     (1, 4): [1], (17, 16): [8, 9]}


def test_a_sub_batched_runner_gives_the_whole_batch_outputs_in_order() -> None:
    from facecore.runtimes import sub_batched

    calls: list[int] = []

    def run(batch: np.ndarray) -> list[np.ndarray]:  # type: ignore[type-arg]
        calls.append(len(batch))
        return [batch * 2, batch[:, :1] + 1]

    batch = np.arange(20, dtype=np.float32).reshape(10, 2)
    doubled, first = sub_batched(run, 4)(batch)
    assert calls == [3, 3, 4]
    np.testing.assert_array_equal(doubled, batch * 2)
    np.testing.assert_array_equal(first, batch[:, :1] + 1)
    calls.clear()
    sub_batched(run, 4)(batch[:4])
    assert sub_batched(run, 0) is run and calls == [4]


@pytest.mark.parametrize("runtime", [Runtime.OPENVINO, Runtime.ONNXRUNTIME])
def test_the_shared_copy_runs_sub_batches_and_the_solo_copy_the_whole_batch(
        default_models: DefaultModels, runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    """``sub_batch`` on the real embedder: a call made beside other instances runs as even calls of at most
    that many faces, a lone call (the 2-thread copy) as one; the embeddings are the same either way."""
    import facecore.runtimes as runtimes

    sizes: list[int] = []
    real_runner = runtimes._openvino_runner if runtime is Runtime.OPENVINO else runtimes._onnxruntime_runner

    def counting(*args: object) -> runtimes.Runner:
        run = real_runner(*args)  # type: ignore[arg-type]

        def counted(batch: np.ndarray) -> list[np.ndarray]:  # type: ignore[type-arg]
            sizes.append(len(batch))
            return run(batch)

        return counted

    name = "_openvino_runner" if runtime is Runtime.OPENVINO else "_onnxruntime_runner"
    monkeypatch.setattr(runtimes, name, counting)
    alone = [False]
    spec = default_models.embedder
    run = runtimes.runner(default_models.embedder_file, spec.output_names,
                          RuntimeChoice(runtime, "f32", 1, sub_batch=4), runtimes.Solo(2, lambda: alone[0]))
    batch = np.random.default_rng(2).uniform(0, 255, (10, 3, 112, 112)).astype(np.float32)
    shared = run(batch)[0]
    assert sizes == [3, 3, 4]
    sizes.clear()
    alone[0] = True
    solo = run(batch)[0]
    assert sizes == [10]
    np.testing.assert_allclose(shared, solo, rtol=1e-4, atol=1e-4)


def _resident_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_compiled_networks_keep_a_bounded_cache_of_shapes(default_models: DefaultModels,
                                                           tmp_path: Path) -> None:
    """The detector's input follows each image's aspect ratio, and OpenVINO keeps the primitives it compiles
    for every new shape (5000 cache entries by default, ~70 per shape): Triton's tree grew by ~27 MiB with
    every new aspect ratio. Our compiled copies cap that cache: over 81 shapes, one grows by well under
    what a copy compiled with OpenVINO's defaults grows by, and its outputs are the same."""
    path = tmp_path / "detector.onnx"  # the served detector: uint8 NHWC input of any height and width
    served_detector(default_models.detector, default_models.detector_file, path)

    def openvino_default() -> object:
        return ov_runtime.core().compile_model(str(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32",
                                                                  "INFERENCE_NUM_THREADS": 1})

    rng = np.random.default_rng(3)
    # what a request's min_face_size makes of the detector input: both sides shrink (multiples of 32)
    shapes = [(32 * h, 32 * w) for h in range(4, 21, 2) for w in range(4, 21, 2)]
    inputs = [rng.integers(0, 256, (1, h, w, 3), dtype=np.uint8) for h, w in shapes]
    warm = openvino_default().create_infer_request()  # type: ignore[attr-defined]
    for batch in inputs:  # OpenVINO's own first-use allocations, before anything is measured
        warm.infer({0: batch})
    requests = {"ours": ov_runtime.compile_model(path, Precision.F32, threads=1).create_infer_request(),
                "default": openvino_default().create_infer_request()}  # type: ignore[attr-defined]
    growth = {}
    for name, request in requests.items():
        request.infer({0: inputs[0]})
        before = _resident_mib()
        for batch in inputs:
            request.infer({0: batch})
        growth[name] = _resident_mib() - before
    np.testing.assert_allclose(requests["ours"].get_output_tensor(1).data,
                               requests["default"].get_output_tensor(1).data, atol=1e-5)
    assert growth["ours"] < 0.7 * growth["default"], growth


def _two_faces(reference: precision.Reference, cosine: float) -> Faces:
    """Two faces of t1.jpg, their embeddings replaced by unit vectors ``cosine`` apart."""
    from dataclasses import replace

    group = next(f for f in reference.faces if len(f) == 6)
    embeddings = np.zeros((2, group.embeddings.shape[1]), np.float32)
    angle = np.arccos(cosine)
    embeddings[0, 0], embeddings[1, 0], embeddings[1, 1] = 1.0, np.cos(angle), np.sin(angle)
    return replace(group, boxes=group.boxes[:2], scores=group.scores[:2], landmarks=group.landmarks[:2],
                   embeddings=embeddings, blur=group.blur[:2], crops=group.crops[:2])


@pytest.mark.parametrize(("before", "after", "passes"), [
    (0.363 + 0.004, 0.363 - 0.003, True),  # on the threshold: either side is the same decision
    (0.363 + 0.05, 0.363 - 0.05, False),  # clear of it: a changed decision
])
def test_a_pair_on_the_match_threshold_may_be_decided_either_way(
        reference: precision.Reference, before: float, after: float, passes: bool) -> None:
    result = precision.compare_pipelines([_two_faces(reference, before)], [_two_faces(reference, after)],
                                         0.363, "detector", RuntimeChoice())
    assert result.worst_cosine >= precision.PIPELINE_COSINE and result.passed is passes, result


@pytest.mark.parametrize(("before", "after", "passes"), [
    (40.04, 39.99, True),  # what TF32 did to a 28-pixel face on an H200 (bench/gpu.py)
    (60.0, 30.0, False),  # a face that was sharp enough no longer is
])
def test_a_gate_measure_on_its_limit_may_fall_either_side(reference: precision.Reference, before: float,
                                                          after: float, passes: bool) -> None:
    from dataclasses import replace

    group = next(f for f in reference.faces if len(f) == 6)
    assert precision.QualityThresholds().min_blur == 40.0 and all(group.blur > 60)
    ref = replace(group, blur=np.array([before, *group.blur[1:]], np.float32))
    got = replace(group, blur=np.array([after, *group.blur[1:]], np.float32))
    result = precision.compare_pipelines([ref], [got], 0.363, "detector", RuntimeChoice())
    assert result.passed is passes and result.same_decisions is passes, result
