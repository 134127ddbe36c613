"""What the routes do: detect, identify, enroll, verify — face_pipeline on Triton + the gallery.

Blocking work (database, FAISS) runs in the thread pool; the event loop only awaits.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time

import cv2
import numpy as np
from numpy.typing import NDArray

from facecore.quality import QualityThresholds, assess
from facecore.spec import ModelSpec
from gallery.gallery import Candidate as GalleryCandidate
from gallery.gallery import Gallery
from gallery.store import FaceInfo, GalleryStore, NewFace
from service import schemas
from service.errors import Unavailable, Unprocessable
from service.metrics import Metrics
from service.pipeline_client import AsyncPipelineClient, PipelineError, PipelineFaces

#: Width of the logistic that turns a cosine score into a confidence: 0.5 at the threshold,
#: 0.95 at threshold + 0.15 (see docs/calibration.md for how it was chosen and its limits).
CONFIDENCE_SCALE = 0.05


def confidence(score: float, threshold: float) -> float:
    return round(1.0 / (1.0 + math.exp(-(score - threshold) / CONFIDENCE_SCALE)), 4)


def image_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def detected_face(faces: PipelineFaces, i: int) -> schemas.DetectedFace:
    quality = assess(faces.boxes[i], faces.landmarks[i], float(faces.blur[i]), float(faces.scores[i]))
    return schemas.DetectedFace(
        box=schemas.Box(**dict(zip(("x1", "y1", "x2", "y2"), faces.boxes[i].tolist(), strict=True))),
        score=float(faces.scores[i]),
        landmarks=[schemas.Point(x=float(x), y=float(y)) for x, y in faces.landmarks[i]],
        quality=schemas.Quality(**quality.as_dict()),
    )


def _box_iou(a: NDArray[np.float32], b: NDArray[np.float32]) -> NDArray[np.float64]:
    x1, y1 = np.maximum(a[0], b[:, 0]), np.maximum(a[1], b[:, 1])
    x2, y2 = np.minimum(a[2], b[:, 2]), np.minimum(a[3], b[:, 3])
    inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1]) - inter
    return np.where(union > 0, inter / np.maximum(union, 1e-9), 0.0)


def largest(faces: PipelineFaces) -> int:
    return int(np.argmax((faces.boxes[:, 2] - faces.boxes[:, 0]) * (faces.boxes[:, 3] - faces.boxes[:, 1])))


class FaceService:
    def __init__(self, pipeline: AsyncPipelineClient, gallery: Gallery, store: GalleryStore, metrics: Metrics,
                 quality: QualityThresholds, max_faces: int, max_k: int) -> None:
        self.pipeline, self.gallery, self.store, self.metrics = pipeline, gallery, store, metrics
        self.quality, self.max_faces, self.max_k = quality, max_faces, max_k
        self._embedder: ModelSpec | None = None

    async def embedder(self) -> ModelSpec:
        """The embedding model served by Triton (asked once, when Triton first answers)."""
        if self._embedder is None:
            try:
                self._embedder = await self.pipeline.embedder()
            except PipelineError as exc:
                raise Unavailable(f"the inference server is unavailable: {exc}",
                                  code="triton_unavailable") from exc
        return self._embedder

    async def analyze(self, data: bytes, crops: bool = False) -> PipelineFaces:
        started = time.perf_counter()
        faces = await self.pipeline.infer(data, max_faces=self.max_faces, return_crops=crops)
        self.metrics.triton_latency.observe(time.perf_counter() - started)
        self.metrics.faces.observe(len(faces))
        return faces

    async def detect(self, data: bytes) -> schemas.DetectResponse:
        faces = await self.analyze(data)
        return schemas.DetectResponse(width=faces.width, height=faces.height,
                                      faces=[detected_face(faces, i) for i in range(len(faces))])

    def _candidate(self, found: GalleryCandidate, threshold: float) -> schemas.Candidate:
        return schemas.Candidate(external_id=found.external_id, name=found.name, score=round(found.score, 6),
                                 confidence=confidence(found.score, threshold))

    async def identify(self, collection: str, data: bytes, k: int, threshold: float | None
                       ) -> schemas.IdentifyResponse:
        spec = await self.embedder()
        info = await asyncio.to_thread(self.gallery.require_model, collection, spec.name)
        faces = await self.analyze(data)
        limit = info.match_threshold if threshold is None else threshold
        results = await asyncio.to_thread(self.gallery.search, collection, faces.embeddings,
                                          min(k, self.max_k), limit, spec.name) if len(faces) else []
        out = []
        for i, result in enumerate(results):
            face = detected_face(faces, i)
            candidates = [self._candidate(c, limit) for c in result.candidates]
            match = result.match
            out.append(schemas.IdentifiedFace(
                box=face.box, score=face.score, landmarks=face.landmarks,
                decision="match" if match is not None else "unknown",
                identity=self._candidate(match, limit) if match is not None else None, candidates=candidates))
        return schemas.IdentifyResponse(width=faces.width, height=faces.height, threshold=limit, faces=out)

    def _choose(self, faces: PipelineFaces, index: int, choice: schemas.FaceChoice, box: list[float] | None
                ) -> int:
        label = f"images[{index}]"
        if len(faces) == 0:
            raise Unprocessable(f"{label}: no face found", code="no_face", image=index)
        if box is not None:
            overlaps = _box_iou(np.asarray(box, np.float32), faces.boxes)
            if overlaps.max() < 0.3:
                raise Unprocessable(f"{label}: no detected face overlaps the given box",
                                    code="no_face_in_box", image=index, boxes=faces.boxes.round(1).tolist())
            return int(np.argmax(overlaps))
        if len(faces) > 1 and choice is schemas.FaceChoice.ONLY:
            raise Unprocessable(f"{label}: {len(faces)} faces; pass face=largest or a box",
                                code="several_faces", image=index, boxes=faces.boxes.round(1).tolist())
        return 0 if len(faces) == 1 else largest(faces)

    async def enroll(self, collection: str, external_id: str, images: list[bytes], choice: schemas.FaceChoice,
                     box: list[float] | None, create: tuple[str, dict[str, object]] | None = None
                     ) -> schemas.EnrollResponse:
        """All images or none: every image must give one face that passes the quality gate."""
        spec = await self.embedder()
        await asyncio.to_thread(self.gallery.require_model, collection, spec.name)
        analyzed = await asyncio.gather(*(self.analyze(data, crops=True) for data in images))
        new_faces = []
        for index, (data, faces) in enumerate(zip(images, analyzed, strict=True)):
            chosen = self._choose(faces, index, choice, box)
            quality = assess(faces.boxes[chosen], faces.landmarks[chosen], float(faces.blur[chosen]),
                             float(faces.scores[chosen]))
            reasons = quality.rejections(self.quality)
            if reasons:
                raise Unprocessable(f"images[{index}]: face refused: {', '.join(reasons)}",
                                    code="low_quality", image=index, reasons=[r.value for r in reasons],
                                    quality=quality.as_dict())
            ok, png = (cv2.imencode(".png", faces.crops[chosen]) if len(faces.crops) > chosen
                       else (False, None))
            new_faces.append(NewFace(faces.embeddings[chosen], image_sha256(data),
                                     faces.boxes[chosen].tolist(), float(faces.scores[chosen]),
                                     quality.as_dict(), png.tobytes() if ok and png is not None else None))
        identity, stored = await asyncio.to_thread(self.store.add_faces, collection, external_id, new_faces,
                                                   spec.name, create)
        await asyncio.to_thread(self.gallery.sync)
        return schemas.EnrollResponse(identity=identity_out(identity), faces=[face_out(f) for f in stored])

    async def _one_face(self, data: bytes, label: str) -> tuple[PipelineFaces, int]:
        faces = await self.analyze(data)
        if len(faces) == 0:
            raise Unprocessable(f"{label}: no face found", code="no_face")
        return faces, largest(faces)

    async def verify_images(self, a: bytes, b: bytes, threshold: float | None) -> schemas.VerifyResponse:
        spec = await self.embedder()
        (fa, ia), (fb, ib) = await asyncio.gather(self._one_face(a, "image_a"), self._one_face(b, "image_b"))
        score = float(fa.embeddings[ia] @ fb.embeddings[ib])
        limit = spec.match_threshold if threshold is None else threshold
        return schemas.VerifyResponse(score=round(score, 6), confidence=confidence(score, limit),
                                      threshold=limit, same=score >= limit, face_a=detected_face(fa, ia),
                                      face_b=detected_face(fb, ib))

    async def verify_identity(self, collection: str, external_id: str, data: bytes, threshold: float | None
                              ) -> schemas.VerifyResponse:
        spec = await self.embedder()
        info = await asyncio.to_thread(self.gallery.require_model, collection, spec.name)
        identity = await asyncio.to_thread(self.store.get_identity, collection, external_id)
        faces, index = await self._one_face(data, "image")
        enrolled = await asyncio.to_thread(self.store.identity_vectors, collection, external_id)
        if len(enrolled) == 0:
            raise Unprocessable(f"identity {identity.external_id!r} has no enrolled face",
                                code="no_enrolled_face")
        score = float(np.max(enrolled @ faces.embeddings[index]))
        limit = info.match_threshold if threshold is None else threshold
        return schemas.VerifyResponse(score=round(score, 6), confidence=confidence(score, limit),
                                      threshold=limit, same=score >= limit,
                                      face_a=detected_face(faces, index))


def identity_out(info: object) -> schemas.IdentityOut:
    return schemas.IdentityOut.model_validate(info, from_attributes=True)


def face_out(info: FaceInfo) -> schemas.FaceOut:
    data = {name: getattr(info, name)
            for name in ("id", "image_sha256", "detection_score", "quality", "has_crop", "created_at")}
    box = info.box
    return schemas.FaceOut(box=schemas.Box(x1=box[0], y1=box[1], x2=box[2], y2=box[3]), **data)
