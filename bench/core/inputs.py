"""The paths, the photos, and the models ``face_pipeline`` serves, read from its model repository so that
in-process runs do exactly what Triton does."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from export.fetch import fetch_photos
from export.served import read_config, served_networks
from facecore.pipeline import Detector, Embedder, PipelineSettings
from facecore.processing import image_header
from facecore.runtimes import Runtime, RuntimeChoice, detector, embedder

ROOT = Path(__file__).resolve().parent.parent.parent
ARTIFACTS = ROOT / "artifacts"
REPOSITORY = ROOT / "model_repository" / "cpu"
PHOTOS = ("obama.jpg", "t1.jpg")


def photo_paths() -> dict[str, Path]:
    """Every test photo, fetched by pinned version and sha256 (once)."""
    return fetch_photos(ARTIFACTS / "downloads", ARTIFACTS / "photos")


def load_photos(names: Sequence[str] = PHOTOS) -> dict[str, bytes]:
    paths = photo_paths()
    return {name: paths[name].read_bytes() for name in names}


def photo_label(name: str, data: bytes) -> str:
    _, width, height = image_header(data, 2**62)
    return f"{name} ({width}x{height})"


@dataclass(frozen=True)
class ServedModels:
    """What ``face_pipeline`` of a CPU repository runs: settings, ONNX files, runtime and precision."""

    settings: PipelineSettings
    detector_file: Path
    embedder_file: Path
    detector_runtime: RuntimeChoice
    embedder_runtime: RuntimeChoice
    summary: str = ""  # instances, batching, runtime and threads of the three models, for the report

    @property
    def runtime(self) -> str:
        """As the report names it: ``openvino: detector f32, embedder bf16``, ``onnxruntime f32``."""
        d, e = self.detector_runtime, self.embedder_runtime
        if d.runtime is e.runtime is Runtime.ONNXRUNTIME:
            return "onnxruntime f32"
        if d.runtime is e.runtime:
            return f"{d.runtime.value}: detector {d.precision}, embedder {e.precision}"
        return f"detector {d.runtime.value} {d.precision}, embedder {e.runtime.value} {e.precision}"

    def on_runtime(self, runtime: Runtime) -> ServedModels:
        """The same files and settings on ``runtime`` (f32 unless it is the served runtime)."""
        def choice(served: RuntimeChoice) -> RuntimeChoice:
            return served if served.runtime is runtime else replace(served, runtime=runtime, precision="f32")

        return replace(self, detector_runtime=choice(self.detector_runtime),
                       embedder_runtime=choice(self.embedder_runtime))

    def detector(self, threads: int | None = None) -> Detector:
        return detector(self.settings.detector, self.detector_file, self.detector_choice(threads))

    def embedder(self, threads: int | None = None) -> Embedder:
        return embedder(self.settings.embedder, self.embedder_file, self.embedder_choice(threads))

    def detector_choice(self, threads: int | None = None) -> RuntimeChoice:
        served = self.detector_runtime
        return served if threads is None else replace(served, threads=threads, sub_batch=0)

    def embedder_choice(self, threads: int | None = None) -> RuntimeChoice:
        # each batch whole: the ceiling's sweeps time the batch sizes themselves, and its runs use the best
        served = self.embedder_runtime
        return served if threads is None else replace(served, threads=threads, sub_batch=0)


def served_models(repository: Path = REPOSITORY) -> ServedModels:
    """What ``face_pipeline`` serves (``export.served.served_networks``) plus its batching, for the report."""
    networks = served_networks(repository)
    settings = networks.settings
    pipeline = read_config(repository / "face_pipeline")
    params = {k: v.string_value for k, v in pipeline.parameters.items()}
    layout = params.get("layout", "bls")
    solo = int(params.get("solo_threads", "0"))
    alone = f" (a lone request on {solo} threads per network)" if layout == "in_process" and solo else ""
    lines = [_describe("face_pipeline", pipeline) + (
        f", dynamic_input {settings.dynamic_input}, decode_min_side {settings.decode_min_side}, "
        f"layout {layout}{alone}")]
    for name, choice in ((settings.detector_model, networks.detector_runtime),
                         (settings.embedder_model, networks.embedder_runtime)):
        lines.append(_describe(name, read_config(repository / name))
                     + f", {choice.runtime.value} {choice.precision}, {choice.threads} intra-op thread(s)")
    return ServedModels(settings, networks.detector_file, networks.embedder_file, networks.detector_runtime,
                        networks.embedder_runtime, "; ".join(lines))


def _describe(name: str, config: mc.ModelConfig) -> str:
    instances = sum(group.count or 1 for group in config.instance_group) or 1
    batching = config.dynamic_batching
    preferred = "/".join(str(b) for b in batching.preferred_batch_size) or "none"
    return (f"{name}: {instances} instance(s), max batch {config.max_batch_size}, preferred {preferred}, "
            f"queue delay {batching.max_queue_delay_microseconds} µs")
