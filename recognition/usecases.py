"""Detect, identify (1:N), enroll and verify (1:1): ``face_pipeline`` on Triton plus the gallery.

Each call asks the served embedding model once (cached after the first answer), checks it against the
collection once, in memory, applies the threshold default once, and makes at most one thread-pool hop
for its database and FAISS work; the event loop only awaits. Results are plain dataclasses: the REST
layer turns them into responses.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from facecore.client import AsyncPipeline
from facecore.contract import Faces
from facecore.spec import ModelSpec
from gallery.calibration import Decision, one_to_one
from gallery.embeddings import row_scores
from gallery.gallery import Gallery, SearchResult
from gallery.store.faces import FaceRecords, StoredFace
from gallery.store.store import CollectionInfo, FaceInfo, GalleryStore, IdentityInfo, check_model
from recognition.enrollment import EnrollmentRules, IgnoredFace, enrollable_face, image_sha256, largest
from recognition.errors import Refused


@dataclass(frozen=True)
class Identified:
    faces: Faces
    results: list[SearchResult]  # one per face, in the order of ``faces``
    threshold: float
    decision: Decision  # the collection's, at its size (``threshold`` is the request's when it gave one)


@dataclass(frozen=True)
class Enrolled:
    identity: IdentityInfo
    faces: list[FaceInfo]
    ignored: list[IgnoredFace] = field(default_factory=list)  # detected faces not enrolled, and why


@dataclass(frozen=True)
class Verified:
    score: float
    threshold: float
    decision: Decision  # 1:1, for the confidence
    face_a: tuple[Faces, int]
    face_b: tuple[Faces, int] | None = None  # None: verified against an identity's enrolled faces

    @property
    def same(self) -> bool:
        return self.score >= self.threshold


@dataclass(frozen=True)
class FaceSearch:
    """Search by a stored face: the face, and the identities closest to it (the face itself left out)."""

    face: StoredFace
    result: SearchResult
    decision: Decision


@dataclass(frozen=True)
class Comparison:
    """Every face of an image scored (cosine) against one reference face."""

    faces: Faces
    scores: NDArray[np.float32]  # [N], one per face of ``faces``
    threshold: float
    decision: Decision  # 1:1, for the confidence
    reference: tuple[Faces, int] | None = None  # the reference face, when it came from an image


#: Called after every face_pipeline call with its latency in seconds and the faces it found.
#: (seconds, faces) of each face_pipeline call; faces is None for a call that failed or was cancelled.
Observer = Callable[[float, int | None], None]


class Recognition:
    def __init__(self, pipeline: AsyncPipeline, gallery: Gallery, store: GalleryStore, max_faces: int,
                 observe: Observer | None = None) -> None:
        self.pipeline, self.gallery, self.store = pipeline, gallery, store
        self.faces = FaceRecords(store.db)
        self.max_faces = max_faces
        self._observe = observe
        self._embedder: ModelSpec | None = None

    async def embedder(self) -> ModelSpec:
        """The embedding model served by Triton (asked once, when Triton first answers)."""
        if self._embedder is None:
            self._embedder = await self.pipeline.embedder()
        return self._embedder

    async def collection(self, name: str) -> CollectionInfo:
        """The collection, checked against the served model: from memory when the gallery holds it."""
        spec = await self.embedder()
        info = self.gallery.cached_info(name)
        if info is None:
            info = await asyncio.to_thread(self.gallery.collection_info, name)  # raises NotFound
        check_model(info, spec.name)
        return info

    async def analyze(self, data: bytes, crops: bool = False, score_threshold: float | None = None) -> Faces:
        started = time.perf_counter()
        try:
            faces = await self.pipeline.infer(data, max_faces=self.max_faces, return_crops=crops,
                                              score_threshold=score_threshold)
        except BaseException:  # a failed or timed-out call is measured too (an outage looked fast)
            if self._observe is not None:
                self._observe(time.perf_counter() - started, None)
            raise
        if self._observe is not None:
            self._observe(time.perf_counter() - started, len(faces))
        return faces

    async def detect(self, data: bytes, score_threshold: float | None = None) -> Faces:
        return await self.analyze(data, score_threshold=score_threshold)

    async def decision(self, collection: str) -> Decision:
        """How the collection decides at its size (``gallery.calibration``): its fixed threshold, or the
        one derived for its target false-positive identification rate. The collection must be loaded
        (``collection`` loads it): then this is arithmetic on the event loop, remembered per size."""
        spec = await self.embedder()
        return self.gallery.decision(collection, spec.score_reference)

    async def identify(self, collection: str, data: bytes, k: int, threshold: float | None,
                       score_threshold: float | None = None) -> Identified:
        await self.collection(collection)
        faces = await self.analyze(data, score_threshold=score_threshold)
        decision = await self.decision(collection)
        limit = decision.threshold if threshold is None else threshold
        results: list[SearchResult] = []
        if len(faces):  # a small collection is searched on the event loop, a larger one in a worker thread
            inline = self.gallery.search_inline(collection, faces.embeddings, k, limit)
            results = inline if inline is not None else await asyncio.to_thread(
                self.gallery.search, collection, faces.embeddings, k, limit)
        return Identified(faces, results, limit, decision)

    async def enroll(self, collection: str, external_id: str, images: Sequence[bytes], rules: EnrollmentRules,
                     create: tuple[str, dict[str, Any]] | None = None) -> Enrolled:
        """All images or none: every image must give one face that passes the quality gate."""
        info = await self.collection(collection)
        analyzed = await asyncio.gather(*(self.analyze(data, crops=True) for data in images))

        def store() -> Enrolled:
            # the quality gate, each file's sha256 and each crop's PNG run in this worker thread too: on
            # the event loop, a 16-image enrolment held every other request for all of them
            chosen = [enrollable_face(faces, image_sha256(data), rules, index)
                      for index, (data, faces) in enumerate(zip(images, analyzed, strict=True))]
            identity, stored = self.store.add_faces(collection, external_id, [c.face for c in chosen],
                                                    info.embedding_model, create)
            self.gallery.sync()
            return Enrolled(identity, stored, [face for c in chosen for face in c.ignored])

        return await asyncio.to_thread(store)

    async def _one_face(self, data: bytes, label: str) -> tuple[Faces, int]:
        faces = await self.analyze(data)
        if len(faces) == 0:
            raise Refused(f"{label}: no face found", "no_face")
        return faces, largest(faces)

    async def verify_images(self, a: bytes, b: bytes, threshold: float | None) -> Verified:
        spec = await self.embedder()
        (fa, ia), (fb, ib) = await asyncio.gather(self._one_face(a, "image_a"), self._one_face(b, "image_b"))
        score = float(fa.embeddings[ia] @ fb.embeddings[ib])
        limit = spec.match_threshold if threshold is None else threshold
        return Verified(score, limit, one_to_one(limit, spec.score_reference), (fa, ia), (fb, ib))

    async def verify_identity(self, collection: str, external_id: str, data: bytes, threshold: float | None
                              ) -> Verified:
        info = await self.collection(collection)
        faces, index = await self._one_face(data, "image")
        enrolled = await asyncio.to_thread(self.store.identity_vectors, collection, external_id)
        if len(enrolled) == 0:
            raise Refused(f"identity {external_id!r} has no enrolled face", "no_enrolled_face")
        score = float(np.max(row_scores(enrolled, faces.embeddings[index])))
        limit = info.match_threshold if threshold is None else threshold
        spec = await self.embedder()  # the best of the identity's faces: one comparison per face
        return Verified(score, limit, one_to_one(limit, spec.score_reference, len(enrolled)), (faces, index))

    async def search_face(self, collection: str, face_id: int, k: int, threshold: float | None,
                          exclude_identity: bool = False) -> FaceSearch:
        """Top-k identities for an enrolled face, leaving out the face itself (with ``exclude_identity``
        every face of its identity), with the usual threshold decision."""
        await self.collection(collection)
        decision = await self.decision(collection)

        def search() -> FaceSearch:
            stored = self.faces.get(collection, face_id)
            exclude = ({f.id for f in self.store.list_faces(collection, stored.external_id)}
                       if exclude_identity else {face_id})
            (result,) = self.gallery.search(collection, stored.vector[None], k,
                                            decision.threshold if threshold is None else threshold,
                                            exclude=exclude)
            return FaceSearch(stored, result, decision)

        return await asyncio.to_thread(search)

    async def compare_images(self, reference: bytes, data: bytes, threshold: float | None = None,
                             score_threshold: float | None = None) -> Comparison:
        """Every face of ``data`` against the (largest) face of ``reference``: 1:1 for each face."""
        spec = await self.embedder()
        (ref, index), faces = await asyncio.gather(self._one_face(reference, "reference image"),
                                                   self.analyze(data, score_threshold=score_threshold))
        limit = spec.match_threshold if threshold is None else threshold
        return Comparison(faces, row_scores(faces.embeddings, ref.embeddings[index]), limit,
                          one_to_one(limit, spec.score_reference), (ref, index))

    async def compare_with_face(self, collection: str, face_id: int, data: bytes,
                                threshold: float | None = None, score_threshold: float | None = None
                                ) -> Comparison:
        """Every face of ``data`` against one enrolled face of the collection."""
        info = await self.collection(collection)
        stored = await asyncio.to_thread(self.faces.get, collection, face_id)  # NotFound first
        faces = await self.analyze(data, score_threshold=score_threshold)
        limit = info.match_threshold if threshold is None else threshold
        spec = await self.embedder()
        return Comparison(faces, row_scores(faces.embeddings, stored.vector), limit,
                          one_to_one(limit, spec.score_reference))
