"""What every benchmark measures with: the paths, the photos, and the models ``face_pipeline`` serves
(its settings and ONNX files read from the model repository, so in-process runs do exactly the same)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from export.fetch import fetch_photos
from facecore.pipeline import PipelineSettings
from facecore.processing import image_header

ROOT = Path(__file__).resolve().parent.parent.parent
ARTIFACTS = ROOT / "artifacts"
REPOSITORY = ROOT / "model_repository" / "cpu"
#: The photos every part measures: one face and six faces.
PHOTOS = ("obama.jpg", "t1.jpg")


def photo_paths() -> dict[str, Path]:
    """Every test photo, fetched by pinned version and sha256 into ``artifacts/photos`` (once)."""
    return fetch_photos(ARTIFACTS / "downloads", ARTIFACTS / "photos")


def load_photos(names: Sequence[str] = PHOTOS) -> dict[str, bytes]:
    paths = photo_paths()
    return {name: paths[name].read_bytes() for name in names}


def photo_label(name: str, data: bytes) -> str:
    _, width, height = image_header(data, 2**62)
    return f"{name} ({width}x{height})"


# --- the served models -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ServedModels:
    """What ``face_pipeline`` of a CPU repository runs: its settings and the two ONNX files."""

    settings: PipelineSettings
    detector_file: Path
    embedder_file: Path
    detector_threads: int
    embedder_threads: int
    repository: Path
    summary: str = ""  # instances, batching and threads of the three models, for the report


def _config(model_dir: Path) -> mc.ModelConfig:
    return text_format.Parse((model_dir / "config.pbtxt").read_text(), mc.ModelConfig())


def _latest_version(model_dir: Path) -> Path:
    versions = sorted((int(p.name), p) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())
    if not versions:
        raise FileNotFoundError(f"{model_dir} has no version directory")
    return versions[-1][1]


def served_models(repository: Path = REPOSITORY) -> ServedModels:
    """Read the settings ``face_pipeline`` serves (config.pbtxt parameters) and the ONNX files of the newest
    versions of ``face_detector`` and ``face_embedder``, so in-process baselines run exactly the same."""
    if not (repository / "face_pipeline" / "config.pbtxt").exists():
        raise FileNotFoundError(f"no CPU model repository at {repository}: run `python -m export defaults`")
    pipeline = _config(repository / "face_pipeline")
    settings = PipelineSettings.from_parameters({k: v.string_value for k, v in pipeline.parameters.items()})
    files, threads, lines = [], [], [_describe("face_pipeline", pipeline) + (
        f", dynamic_input {settings.dynamic_input}, decode_min_side {settings.decode_min_side}")]
    for name in (settings.detector_model, settings.embedder_model):
        config = _config(repository / name)
        files.append(_latest_version(repository / name) / config.parameters["onnx_file"].string_value)
        threads.append(int(config.parameters["intra_op_threads"].string_value or "0"))
        lines.append(_describe(name, config) + f", {threads[-1]} ONNX Runtime intra-op thread(s)")
    return ServedModels(settings, files[0], files[1], threads[0], threads[1], repository, "; ".join(lines))


def _describe(name: str, config: mc.ModelConfig) -> str:
    instances = sum(group.count or 1 for group in config.instance_group) or 1
    batching = config.dynamic_batching
    preferred = "/".join(str(b) for b in batching.preferred_batch_size) or "none"
    return (f"{name}: {instances} instance(s), max batch {config.max_batch_size}, preferred {preferred}, "
            f"queue delay {batching.max_queue_delay_microseconds} µs")
