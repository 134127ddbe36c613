"""What a CPU model repository serves, read back from its configs: ``face_pipeline``'s settings and each
network's newest ONNX file, runtime, precision and threads — so that in-process code (tests, the
benchmarks' ceiling and naive baselines) runs exactly what Triton runs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from facecore.pipeline import Detector, Embedder, PipelineSettings
from facecore.runtimes import Runtime, RuntimeChoice, detector, embedder


def read_config(model_dir: Path) -> mc.ModelConfig:
    return text_format.Parse((model_dir / "config.pbtxt").read_text(), mc.ModelConfig())


def latest_version(model_dir: Path) -> Path:
    versions = sorted((int(p.name), p) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())
    if not versions:
        raise FileNotFoundError(f"{model_dir} has no version directory")
    return versions[-1][1]


def runtime_choice(config: mc.ModelConfig) -> RuntimeChoice:
    params = {key: value.string_value for key, value in config.parameters.items()}
    return RuntimeChoice(Runtime(params.get("runtime", Runtime.ONNXRUNTIME.value)),
                         params.get("precision", "f32"), int(params.get("intra_op_threads") or "0"),
                         params.get("intra_op_spinning", "true").lower() == "true",
                         int(params.get("sub_batch") or "0"))


@dataclass(frozen=True)
class ServedNetworks:
    settings: PipelineSettings
    detector_file: Path
    embedder_file: Path
    detector_runtime: RuntimeChoice
    embedder_runtime: RuntimeChoice

    def detector(self, threads: int | None = None) -> Detector:
        choice = self.detector_runtime
        choice = choice if threads is None else RuntimeChoice(choice.runtime, choice.precision, threads,
                                                               choice.spinning)
        return detector(self.settings.detector, self.detector_file, choice)

    def embedder(self, threads: int | None = None) -> Embedder:
        choice = self.embedder_runtime
        choice = choice if threads is None else RuntimeChoice(choice.runtime, choice.precision, threads,
                                                               choice.spinning)
        return embedder(self.settings.embedder, self.embedder_file, choice)


def served_networks(repository: Path) -> ServedNetworks:
    if not (repository / "face_pipeline" / "config.pbtxt").exists():
        raise FileNotFoundError(f"no CPU model repository at {repository}: run `python -m export defaults`")
    pipeline = read_config(repository / "face_pipeline")
    settings = PipelineSettings.from_parameters({k: v.string_value for k, v in pipeline.parameters.items()})
    files, choices = [], []
    for name in (settings.detector_model, settings.embedder_model):
        config = read_config(repository / name)
        files.append(latest_version(repository / name) / config.parameters["onnx_file"].string_value)
        choices.append(runtime_choice(config))
    return ServedNetworks(settings, files[0], files[1], choices[0], choices[1])
