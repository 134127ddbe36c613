"""``model_repository/face_pipeline/model.py`` and ``onnx_model/model.py`` against a fake pb_utils.

The fake answers BLS calls with the real ONNX models in-process, so these tests check what
model.py does with Triton's request/response objects: one detector call per execute, one embedder
call for all faces, none when there are no faces, and per-request errors.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from export.defaults import DefaultModels
from facecore.onnx_runtime import create_session
from tests import ROOT
from tests.model_repository.fakes import triton_python_backend_utils as fake

PIPELINE_SOURCE = ROOT / "model_repository" / "face_pipeline" / "model.py"
ONNX_SOURCE = ROOT / "model_repository" / "onnx_model" / "model.py"


def load_model_module(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def fake_pb_utils(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake)
    fake.BLS_HANDLERS.clear()
    fake.BLS_CALLS.clear()
    fake.BLS_GPU_MODELS.clear()
    yield fake
    fake.BLS_HANDLERS.clear()
    fake.BLS_CALLS.clear()
    fake.BLS_GPU_MODELS.clear()


def _config(repository: Path, model: str) -> str:
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2 as mc

    message = text_format.Parse((repository / model / "config.pbtxt").read_text(), mc.ModelConfig())
    return json.dumps(json_format.MessageToDict(message, preserving_proto_field_name=True))


def with_parameters(config: str, **values: str) -> str:
    parsed = json.loads(config)
    for key, value in values.items():
        parsed["parameters"][key] = {"string_value": value}
    return json.dumps(parsed)


@pytest.fixture(params=["dynamic", "fixed"])
def detector_mode(request: pytest.FixtureRequest) -> str:
    """The CPU profile sizes the detector input to each image; the GPU profile uses 640x640."""
    return str(request.param)


@pytest.fixture
def pipeline_model(fake_pb_utils: ModuleType, cpu_repository: Path, default_models: DefaultModels,
                   detector_mode: str) -> object:
    """face_pipeline's TritonPythonModel wired to the real ONNX models through the fake BLS."""
    # the networks as served: the repository's files (the detector takes uint8 NHWC there)
    detector = create_session(cpu_repository / "face_detector" / "1" / "model.onnx")
    embedder = create_session(cpu_repository / "face_embedder" / "1" / "model.onnx")
    det_spec, emb_spec = default_models.detector, default_models.embedder

    def run_detector(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feed = {det_spec.input_name: inputs[det_spec.input_name]}
        outputs = detector.run(list(det_spec.output_names), feed)
        return dict(zip(det_spec.output_names, outputs, strict=True))

    def run_embedder(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        (out,) = embedder.run(list(emb_spec.output_names), {emb_spec.input_name: inputs[emb_spec.input_name]})
        return {emb_spec.output_names[0]: out}

    fake_pb_utils.BLS_HANDLERS.update(face_detector=run_detector, face_embedder=run_embedder)
    module = load_model_module(PIPELINE_SOURCE, "face_pipeline_model")
    model = module.TritonPythonModel()
    # the BLS layout (its calls answered by the handlers above), whatever layout the CPU default has
    config = with_parameters(_config(cpu_repository, "face_pipeline"),
                             dynamic_input=str(detector_mode == "dynamic"), layout="bls")
    model.initialize({"model_config": config, "model_version": "1"})
    return model


def request(image: bytes, **optional: np.ndarray) -> fake.InferenceRequest:
    tensors = [fake.Tensor("IMAGE", np.array([[image]], dtype=np.object_))]
    tensors += [fake.Tensor(name, value) for name, value in optional.items()]
    return fake.InferenceRequest(inputs=tensors)


def calls_to(model: str) -> list[dict[str, np.ndarray]]:
    return [inputs for name, inputs in fake.BLS_CALLS if name == model]


def test_one_detector_and_one_embedder_call_for_the_whole_execute(
    pipeline_model: object, photo_bytes: dict[str, bytes], detector_mode: str
) -> None:
    names = ["t1.jpg", "obama.jpg", "coffee.png", "biden.jpg", "obama2.jpg"]
    responses = pipeline_model.execute([request(photo_bytes[n]) for n in names])  # type: ignore[attr-defined]
    counts = [r.output("SCORES").shape[1] for r in responses]
    assert counts == [6, 1, 0, 1, 1]
    shapes = [call["input"].shape for call in calls_to("face_detector")]
    if detector_mode == "fixed":
        assert shapes == [(5, 640, 640, 3)]  # one call for the whole execute, uint8 NHWC
    else:  # one call per input size: each image's aspect ratio, multiples of 32, longer side 640;
        # t1.jpg (1280x886) and coffee.png (600x400) both become 640x448 and share a call
        assert sorted(shapes) == sorted([(2, 448, 640, 3), (1, 640, 512, 3), (1, 640, 288, 3),
                                         (1, 640, 352, 3)])
    assert all(call["input"].dtype == np.uint8 for call in calls_to("face_detector"))
    (embedder_call,) = calls_to("face_embedder")
    assert embedder_call["data"].shape == (9, 3, 112, 112)
    for response, count in zip(responses, counts, strict=True):
        assert response.output("BOXES").shape == (1, count, 4)
        assert response.output("LANDMARKS").shape == (1, count, 5, 2)
        embeddings = response.output("EMBEDDINGS")
        assert embeddings.shape == (1, count, 128)
        np.testing.assert_allclose(np.linalg.norm(embeddings[0], axis=1), 1.0, rtol=1e-5)
        assert response.output("CROPS").shape == (1, 0, 112, 112, 3)
    assert responses[0].output("IMAGE_SIZE").tolist() == [[1280, 886]]


def test_fake_gpu_tensors_behave_like_the_real_ones(fake_pb_utils: ModuleType) -> None:
    """The fake's GPU placement, checked against python_backend r24.10 (pb_tensor.cc, pb_stub.cc)."""
    fake_pb_utils.BLS_HANDLERS["gpu_model"] = lambda inputs: {"out": inputs["x"] * 2}
    fake_pb_utils.BLS_GPU_MODELS.add("gpu_model")
    x = [fake.Tensor("x", np.ones(3, np.float32))]
    default = fake.InferenceRequest(model_name="gpu_model", requested_output_names=["out"], inputs=x).exec()
    (on_gpu,) = default.output_tensors()
    assert not on_gpu.is_cpu()
    with pytest.raises(fake.TritonModelException, match="stored in GPU and cannot be converted to NumPy"):
        on_gpu.as_numpy()
    cpu = fake.PreferredMemory(fake.TRITONSERVER_MEMORY_CPU, 0)
    asked = fake.InferenceRequest(model_name="gpu_model", requested_output_names=["out"], inputs=x,
                                  preferred_memory=cpu).exec()
    assert asked.output("out").tolist() == [2.0, 2.0, 2.0]
    capsule = fake.Tensor("x", np.arange(3)).to_dlpack()
    assert fake.Tensor.from_dlpack("y", capsule).as_numpy().tolist() == [0, 1, 2]


def test_outputs_of_gpu_models_reach_numpy(
    pipeline_model: object, fake_pb_utils: ModuleType, photo_bytes: dict[str, bytes]
) -> None:
    """TensorRT models leave their outputs in GPU memory unless the BLS request prefers CPU memory."""
    fake_pb_utils.BLS_GPU_MODELS.update({"face_detector", "face_embedder"})
    responses = pipeline_model.execute(  # type: ignore[attr-defined]
        [request(photo_bytes["t1.jpg"]), request(photo_bytes["obama.jpg"])])
    errors = [None if r.error() is None else r.error().message() for r in responses]
    assert errors == [None, None]
    assert [r.output("EMBEDDINGS").shape for r in responses] == [(1, 6, 128), (1, 1, 128)]


def test_no_face_makes_no_embedder_call(pipeline_model: object, photo_bytes: dict[str, bytes]) -> None:
    (response,) = pipeline_model.execute([request(photo_bytes["coffee.png"])])  # type: ignore[attr-defined]
    assert response.output("EMBEDDINGS").shape == (1, 0, 128)
    assert response.output("BOXES").shape == (1, 0, 4)
    assert calls_to("face_embedder") == []
    assert len(calls_to("face_detector")) == 1


def test_bad_request_fails_alone(pipeline_model: object, photo_bytes: dict[str, bytes]) -> None:
    batch = [
        request(b"not an image"),
        request(photo_bytes["obama.jpg"]),
        request(b""),
        request(photo_bytes["obama2.jpg"], SCORE_THRESHOLD=np.array([[1.5]], np.float32)),
        request(photo_bytes["obama3.jpg"], MAX_FACES=np.array([[1]], np.int32),
                RETURN_CROPS=np.array([[True]])),
    ]
    responses = pipeline_model.execute(batch)  # type: ignore[attr-defined]
    errors = [r.error() for r in responses]
    assert [e is not None for e in errors] == [True, False, True, True, False]
    assert all(e.code() == fake.TritonError.INVALID_ARG for e in errors if e is not None)
    assert "not a decodable image" in errors[0].message()  # type: ignore[union-attr]
    assert "empty image" in errors[2].message()  # type: ignore[union-attr]
    assert "score_threshold" in errors[3].message()  # type: ignore[union-attr]
    assert responses[1].output("SCORES").shape == (1, 1)
    assert responses[4].output("CROPS").shape == (1, 1, 112, 112, 3)
    assert sum(call["input"].shape[0] for call in calls_to("face_detector")) == 2  # the two good images


def test_model_failure_fails_the_execute_not_the_process(
    pipeline_model: object, fake_pb_utils: ModuleType, photo_bytes: dict[str, bytes]
) -> None:
    def broken(_: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise RuntimeError("embedder is down")

    fake_pb_utils.BLS_HANDLERS["face_embedder"] = broken
    responses = pipeline_model.execute([request(photo_bytes["obama.jpg"]), request(b"junk")])  # type: ignore[attr-defined]
    assert "embedder is down" in responses[0].error().message()
    assert responses[1].error().code() == fake.TritonError.INVALID_ARG


def test_onnx_model_merges_requests_of_the_same_shape(
    fake_pb_utils: ModuleType, cpu_repository: Path
) -> None:
    module = load_model_module(ONNX_SOURCE, "onnx_model")
    model = module.TritonPythonModel()
    model.initialize({"model_config": _config(cpu_repository, "face_embedder"),
                      "model_repository": str(cpu_repository / "face_embedder"), "model_version": "1"})
    rng = np.random.default_rng(0)
    batches = [rng.uniform(0, 255, (n, 3, 112, 112)).astype(np.float32) for n in (2, 1, 3)]
    requests = [fake.InferenceRequest(inputs=[fake.Tensor("data", b)]) for b in batches]
    responses = model.execute(requests)
    alone = [model.run(b)[0] for b in batches]
    for response, expected in zip(responses, alone, strict=True):
        np.testing.assert_allclose(response.output("fc1"), expected, atol=1e-4)


def test_reduced_decode_reports_original_pixels(
    fake_pb_utils: ModuleType, cpu_repository: Path, default_models: DefaultModels,
    photo_bytes: dict[str, bytes], pipeline_model: object,
) -> None:
    """decode_min_side decodes big JPEGs at 1/2..1/8 scale; boxes still come back in original pixels."""
    full = pipeline_model.execute([request(photo_bytes["obama3.jpg"])])[0]  # type: ignore[attr-defined]
    module = load_model_module(PIPELINE_SOURCE, "face_pipeline_reduced")
    reduced_model = module.TritonPythonModel()
    reduced_model.initialize({"model_config": with_parameters(_config(cpu_repository, "face_pipeline"),
                                                              decode_min_side="1000", layout="bls"),
                                 "model_version": "1"})
    reduced = reduced_model.execute([request(photo_bytes["obama3.jpg"])])[0]
    assert reduced.output("IMAGE_SIZE").tolist() == full.output("IMAGE_SIZE").tolist() == [[1434, 2333]]
    np.testing.assert_allclose(reduced.output("BOXES"), full.output("BOXES"), atol=12)
    np.testing.assert_allclose(reduced.output("LANDMARKS"), full.output("LANDMARKS"), atol=8)
    cosine = float(np.sum(reduced.output("EMBEDDINGS")[0, 0] * full.output("EMBEDDINGS")[0, 0]))
    assert cosine > 0.9  # the same face, decoded at half resolution


def test_a_lone_request_gets_the_solo_threads_and_a_crowded_one_its_own(
    fake_pb_utils: ModuleType, cpu_repository: Path, photo_bytes: dict[str, bytes], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The in_process layout with solo_threads: each network compiled twice (2 threads and its own 1); a
    request met while no other instance works runs the 2-thread copies, one met while another instance
    executes runs the 1-thread copies; the board's file goes with the last instance."""
    import facecore.occupancy as occupancy
    import facecore.openvino_runtime as ov_runtime
    import facecore.runtimes as runtimes

    monkeypatch.setattr(occupancy, "default_folder", lambda: tmp_path)
    monkeypatch.setattr(runtimes, "usable_cpus", lambda: 2)
    threads_used: list[int] = []
    real_run = ov_runtime.Network.run

    def recorded(self: ov_runtime.Network, batch: np.ndarray) -> list[np.ndarray]:  # type: ignore[type-arg]
        threads_used.append(int(self._compiled.get_property("INFERENCE_NUM_THREADS")))
        return real_run(self, batch)

    monkeypatch.setattr(ov_runtime.Network, "run", recorded)
    model = load_model_module(PIPELINE_SOURCE, "face_pipeline_solo").TritonPythonModel()
    config = with_parameters(_config(cpu_repository, "face_pipeline"), layout="in_process", solo_threads="2",
                             detector_threads="1", embedder_threads="1", detector_runtime="openvino",
                             embedder_runtime="openvino")
    model.initialize({"model_config": config, "model_version": "1", "model_name": "face_pipeline",
                      "model_repository": str(cpu_repository / "face_pipeline"),
                      "model_instance_name": "face_pipeline_0_0"})
    alone = model.execute([request(photo_bytes["obama.jpg"])])[0]
    assert threads_used == [2, 2]  # detector, embedder
    threads_used.clear()
    other = occupancy.Occupancy.of_instance("face_pipeline", "face_pipeline_0_1")
    with other.executing():
        crowded = model.execute([request(photo_bytes["obama.jpg"])])[0]
    assert threads_used == [1, 1]
    cosine = float(np.sum(alone.output("EMBEDDINGS")[0, 0] * crowded.output("EMBEDDINGS")[0, 0]))
    assert cosine > 0.9999  # the same networks, only the thread count differs
    other.close()
    model.finalize()
    assert not list(tmp_path.glob("*.occupancy"))


def test_faces_embedded_beside_other_instances_go_in_sub_batches(
    fake_pb_utils: ModuleType, cpu_repository: Path, photo_bytes: dict[str, bytes], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``embedder_sub_batch``: t1.jpg's six faces, met while another instance executes, go through the
    one-thread embedder as two calls of three; met alone, through the two-thread copy as one call of six;
    the embeddings agree."""
    import facecore.occupancy as occupancy
    import facecore.openvino_runtime as ov_runtime
    import facecore.runtimes as runtimes

    monkeypatch.setattr(occupancy, "default_folder", lambda: tmp_path)
    monkeypatch.setattr(runtimes, "usable_cpus", lambda: 2)
    embedder_calls: list[tuple[int, int]] = []  # (threads, faces)
    real_run = ov_runtime.Network.run

    def recorded(self: ov_runtime.Network, batch: np.ndarray) -> list[np.ndarray]:  # type: ignore[type-arg]
        if batch.shape[1:3] == (112, 112) or batch.shape[2:] == (112, 112):
            embedder_calls.append((int(self._compiled.get_property("INFERENCE_NUM_THREADS")), len(batch)))
        return real_run(self, batch)

    monkeypatch.setattr(ov_runtime.Network, "run", recorded)
    model = load_model_module(PIPELINE_SOURCE, "face_pipeline_sub_batch").TritonPythonModel()
    config = with_parameters(_config(cpu_repository, "face_pipeline"), layout="in_process", solo_threads="2",
                             detector_threads="1", embedder_threads="1", detector_runtime="openvino",
                             embedder_runtime="openvino", embedder_sub_batch="4")
    model.initialize({"model_config": config, "model_version": "1", "model_name": "face_pipeline",
                      "model_repository": str(cpu_repository / "face_pipeline"),
                      "model_instance_name": "face_pipeline_0_0"})
    alone = model.execute([request(photo_bytes["t1.jpg"])])[0].output("EMBEDDINGS")[0]
    assert embedder_calls == [(2, 6)]
    embedder_calls.clear()
    other = occupancy.Occupancy.of_instance("face_pipeline", "face_pipeline_0_1")
    with other.executing():
        crowded = model.execute([request(photo_bytes["t1.jpg"])])[0].output("EMBEDDINGS")[0]
    assert embedder_calls == [(1, 3), (1, 3)]
    assert alone.shape == crowded.shape == (6, 128)
    assert np.min(np.sum(alone * crowded, axis=1)) > 0.9999
    other.close()
    model.finalize()


def test_opencv_threads_are_set_per_instance(fake_pb_utils: ModuleType, cpu_repository: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Every instance is a process of its own, and OpenCV's pool is as large as the host in each: the
    exported profiles give its loops one thread (``opencv_threads``), 0 leaves OpenCV's default."""
    import cv2

    config = _config(cpu_repository, "face_pipeline")
    assert json.loads(config)["parameters"]["opencv_threads"] == {"string_value": "1"}
    asked: list[int] = []
    monkeypatch.setattr(cv2, "setNumThreads", asked.append)
    module = load_model_module(PIPELINE_SOURCE, "face_pipeline_threads")
    for value, expected in (("1", [1]), ("0", [])):
        asked.clear()
        module.TritonPythonModel().initialize({"model_config": with_parameters(
            config, opencv_threads=value, layout="bls"), "model_version": "1"})
        assert asked == expected, value
