"""``face_pipeline``: a Triton Python-backend BLS model.

decode -> letterbox -> ``face_detector`` (one call per detector input size among the execute's
images) -> prior decode + NMS -> 5-point alignment -> ONE ``face_embedder`` call for every face ->
L2 normalize. The work itself is ``facecore.pipeline``; this file only converts Triton requests to
numpy and back, following ``facecore.contract``.
A request with a bad image or bad settings gets its own INVALID_ARG error; the others still succeed.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import triton_python_backend_utils as pb_utils
from numpy.typing import NDArray

from facecore import runtimes
from facecore.contract import Faces, Input, RequestOptions
from facecore.occupancy import Occupancy
from facecore.pipeline import (
    Detector,
    Embedder,
    NetworkInput,
    PipelineSettings,
    run_pipeline,
    validate_options,
)
from facecore.processing import (
    DetectOptions,
    FloatArray,
    ImageArray,
    decode_image,
    decode_sized,
    postprocess_detections,
    prior_boxes,
)
from facecore.runtimes import Runtime, RuntimeChoice, Solo
from facecore.triton_config import parameters


def bls(model_name: str, inputs: dict[str, NDArray[Any]], outputs: list[str]) -> list[FloatArray]:
    """One synchronous BLS call; a Triton error becomes an exception.

    The outputs are asked for in CPU memory: the next steps (prior decode, NMS, alignment,
    L2 normalization) are numpy. Without ``preferred_memory`` they stay where the producing model
    put them, which for a TensorRT model is the GPU, and ``as_numpy()`` then raises.
    """
    request = pb_utils.InferenceRequest(
        model_name=model_name,
        requested_output_names=outputs,
        inputs=[pb_utils.Tensor(name, array) for name, array in inputs.items()],
        preferred_memory=pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU, 0),
    )
    response = request.exec()
    error = response.error() if response.has_error() else None
    if error is not None:
        raise pb_utils.TritonModelException(f"{model_name}: {error.message()}")
    arrays = []
    for name in outputs:
        tensor = pb_utils.get_output_tensor_by_name(response, name)
        if tensor is None:
            raise pb_utils.TritonModelException(f"{model_name} returned no {name}")
        arrays.append(np.asarray(tensor.as_numpy(), dtype=np.float32))
    return arrays


def input_array(request: Any, name: str) -> NDArray[Any] | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def read_request(
    request: Any, settings: PipelineSettings
) -> tuple[ImageArray, tuple[int, int], DetectOptions, bool]:
    """The request's decoded image, its original size, detection options and whether crops are wanted."""
    image_input = input_array(request, Input.IMAGE.value)
    encoded = np.zeros(0, np.object_) if image_input is None else image_input.reshape(-1)
    if encoded.size != 1:
        raise ValueError(f"{Input.IMAGE.value} must hold exactly one encoded image, got {encoded.size}")
    wanted = RequestOptions.from_tensors(lambda name: input_array(request, name))
    options = validate_options(settings, wanted.score_threshold, wanted.max_faces, wanted.min_face_size)
    image, size = decode_sized(bytes(encoded[0]), settings.max_pixels, settings.decode_min_side)
    return image, size, options, wanted.return_crops


def to_response(faces: Faces, with_crops: bool) -> Any:
    """Outputs carry a leading batch axis of 1 (max_batch_size > 0)."""
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor(name, np.ascontiguousarray(array[None]))
        for name, array in faces.to_arrays(with_crops).items()
    ])


def invalid(message: str) -> Any:
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, pb_utils.TritonError.INVALID_ARG))


def warm_up_python(settings: PipelineSettings) -> None:
    """Touch the decoder and the numpy post-processing once so the first request does not pay for it."""
    width, height = settings.detector.input_size
    anchors = prior_boxes(height, width).shape[0]
    zeros = np.zeros((anchors, 4), np.float32)
    postprocess_detections(zeros, np.zeros((anchors, 2), np.float32), np.zeros((anchors, 10), np.float32),
                           (width, height), np.ones(2, np.float32), (width, height), settings.default_options)
    ok, encoded = cv2.imencode(".png", np.zeros((8, 8, 3), np.uint8))
    if ok:
        decode_image(encoded.tobytes(), settings.max_pixels)


def in_process_networks(params: dict[str, str], version_dir: Path, settings: PipelineSettings,
                        alone: Callable[[], bool]) -> tuple[Detector, Embedder]:
    """The ``in_process`` layout: both networks run in this process, from files beside this model.py.

    With ``solo_threads`` above a network's threads, the network is compiled a second time with that many
    threads (at most the usable CPUs), used for a call made while ``alone()``: no other instance working.
    """
    spinning = params.get("intra_op_spinning", "true") == "true"
    solo = Solo(min(int(params.get("solo_threads", "0")), runtimes.usable_cpus()), alone)

    def choice(role: str) -> RuntimeChoice:
        return RuntimeChoice(Runtime(params[f"{role}_runtime"]), params[f"{role}_precision"],
                             int(params[f"{role}_threads"]), spinning,
                             int(params.get(f"{role}_sub_batch", "0")))

    return (runtimes.detector(settings.detector, version_dir / "detector.onnx", choice("detector"), solo),
            runtimes.embedder(settings.embedder, version_dir / "embedder.onnx", choice("embedder"), solo))


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        params = parameters(args["model_config"])
        self.settings = PipelineSettings.from_parameters(params)
        if self.settings.opencv_threads:  # per process: every instance is a stub of its own
            cv2.setNumThreads(self.settings.opencv_threads)
        detector, embedder = self.settings.detector, self.settings.embedder
        self.detector_io = (detector.input_name, list(detector.output_names))
        self.embedder_io = (embedder.input_name, list(embedder.output_names))
        self.local: tuple[Detector, Embedder] | None = None
        self.occupancy: Occupancy | None = None
        if params.get("layout") == "in_process":
            version_dir = Path(args["model_repository"]) / str(args["model_version"])
            if int(params.get("solo_threads", "0")) > 0:
                self.occupancy = Occupancy.of_instance(args["model_name"], args["model_instance_name"])
            alone = self.occupancy.alone if self.occupancy is not None else (lambda: False)
            self.local = in_process_networks(params, version_dir, self.settings, alone)
        warm_up_python(self.settings)

    def finalize(self) -> None:
        if self.occupancy is not None:
            self.occupancy.close()

    def detect(self, batch: NetworkInput) -> tuple[FloatArray, FloatArray, FloatArray]:
        if self.local is not None:
            try:
                return self.local[0](batch)
            except Exception as exc:  # named like a failed BLS call to the model
                raise RuntimeError(f"{self.settings.detector_model} (in face_pipeline): {exc}") from exc
        name, outputs = self.detector_io
        loc, conf, landms = bls(self.settings.detector_model, {name: batch}, outputs)
        return loc, conf, landms

    def embed(self, batch: NetworkInput) -> FloatArray:
        if self.local is not None:
            try:
                return self.local[1](batch)
            except Exception as exc:
                raise RuntimeError(f"{self.settings.embedder_model} (in face_pipeline): {exc}") from exc
        name, outputs = self.embedder_io
        (out,) = bls(self.settings.embedder_model, {name: batch}, outputs)
        return out

    def execute(self, requests: list[Any]) -> list[Any]:
        with self.occupancy.executing() if self.occupancy is not None else nullcontext():
            return self.run(requests)

    def run(self, requests: list[Any]) -> list[Any]:
        responses: list[Any] = [None] * len(requests)
        accepted: list[tuple[int, ImageArray, tuple[int, int], DetectOptions, bool]] = []
        for index, request in enumerate(requests):
            try:
                accepted.append((index, *read_request(request, self.settings)))
            except ValueError as exc:  # ImageError is a ValueError
                responses[index] = invalid(str(exc))
        if not accepted:
            return responses
        indices, images, sizes, options, crops = zip(*accepted, strict=True)
        try:
            results = run_pipeline(images, options, self.settings, self.detect, self.embed, sizes)
        except Exception as exc:  # a failed model call fails this execute's requests, not the server
            error = pb_utils.TritonError(f"face_pipeline: {exc}")
            for index in indices:
                responses[index] = pb_utils.InferenceResponse(error=error)
            return responses
        for index, result, with_crops in zip(indices, results, crops, strict=True):
            responses[index] = to_response(result, with_crops)
        return responses
