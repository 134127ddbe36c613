"""Batch gallery import: a folder tree (one subfolder per identity) or a CSV manifest.

Images go through ``face_pipeline`` with bounded concurrency (enough requests in flight to keep the
dynamic batcher busy); each identity is enrolled in ONE transaction once all its images are processed,
so a failure never leaves a half-enrolled identity. Images whose sha256 is already in the collection are
skipped, which makes an interrupted import resumable.

Where the faces are found and stored is a ``Backend``: ``LocalBackend`` talks to Triton and the database
directly; ``recognition.rest_import.RestBackend`` goes through a deployed stack's REST API with a key.
Both share the classification (the enrollment rules), the resume, the concurrency and the report.
"""

from __future__ import annotations

import asyncio
import csv
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Protocol, cast

from tqdm import tqdm

from facecore.client import AsyncPipeline, PipelineError
from facecore.contract import Faces
from facecore.limits import DEFAULT_LIMITS, Limits
from facecore.quality import QualityThresholds
from gallery.store import GalleryStore, NewFace
from recognition.enrollment import EnrollmentRules, FaceChoice, enrollable_face, image_sha256
from recognition.errors import Refused

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp"}


class Status(StrEnum):
    IMPORTED = "imported"
    READY = "ready"  # dry run: would be imported
    NO_FACE = "no_face"
    SEVERAL_FACES = "several_faces"
    LOW_QUALITY = "low_quality"
    UNREADABLE = "unreadable"
    DUPLICATE = "duplicate"
    FAILED = "failed"  # Triton or the database failed; nothing of this identity was written


@dataclass(frozen=True)
class ImportItem:
    path: Path
    external_id: str
    name: str


@dataclass
class ItemResult:
    item: ImportItem
    status: Status
    detail: str = ""
    sha256: str = ""
    faces: int = 0
    face_id: int | None = None
    face: NewFace | None = field(default=None, repr=False)
    data: bytes = field(default=b"", repr=False)  # the image, kept until its identity is enrolled


@dataclass(frozen=True)
class ImportOptions:
    collection: str
    embedding_model: str
    concurrency: int = 8
    dry_run: bool = False
    largest_face: bool = False  # with several faces, enroll the largest instead of refusing
    quality: QualityThresholds = field(default_factory=QualityThresholds)
    #: The limits (``facecore.limits``; ``python -m gallery`` passes the settings' values).
    limits: Limits = DEFAULT_LIMITS

    @property
    def rules(self) -> EnrollmentRules:
        return EnrollmentRules(self.quality, FaceChoice.LARGEST if self.largest_face else FaceChoice.ONLY)


def scan_folder(root: Path) -> list[ImportItem]:
    """One identity per subfolder (external id and name = folder name), images inside it."""
    if not root.is_dir():
        raise FileNotFoundError(f"no folder {root}")
    return [
        ImportItem(path, folder.name, folder.name)
        for folder in sorted(p for p in root.iterdir() if p.is_dir())
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.suffix.lower() in IMAGE_SUFFIXES
    ]


def read_manifest(manifest: Path) -> list[ImportItem]:
    """CSV with a header: ``path,external_id,name`` (paths relative to the manifest's folder)."""
    with manifest.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        missing = {"path", "external_id"} - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"{manifest}: missing column(s) {', '.join(sorted(missing))}")
        items = []
        for line, row in enumerate(reader, start=2):
            if not row["path"] or not row["external_id"]:
                raise ValueError(f"{manifest}:{line}: path and external_id are required")
            path = Path(row["path"])
            items.append(ImportItem(path if path.is_absolute() else manifest.parent / path,
                                    row["external_id"], row.get("name") or row["external_id"]))
    return items


_STATUS = {"no_face": Status.NO_FACE, "several_faces": Status.SEVERAL_FACES,
           "low_quality": Status.LOW_QUALITY}


def _detail(refused: Refused) -> str:
    """The report's one-line reason: the boxes of a group photo, the quality gate's reasons."""
    if refused.code == "several_faces":
        boxes = cast(list[list[float]], refused.details.get("boxes", []))
        listed = "; ".join(",".join(f"{v:.0f}" for v in box) for box in boxes)
        return f"{len(boxes)} faces: {listed}"
    if refused.code == "low_quality":
        return ",".join(cast(list[str], refused.details.get("reasons", [])))
    return refused.message.removeprefix("image: ")


def classify(item: ImportItem, digest: str, faces: Faces, options: ImportOptions) -> ItemResult:
    """Accept exactly one face that passes the quality gate (the REST route's rules), or say why not;
    ``digest`` is the image's ``image_sha256``."""
    try:
        chosen = enrollable_face(faces, digest, options.rules)
    except Refused as refused:
        return ItemResult(item, _STATUS[refused.code], _detail(refused), digest, len(faces))
    return ItemResult(item, Status.READY, "", digest, len(faces), face=chosen.face)


class Unreadable(Exception):
    """The backend could not read this image (corrupt, unsupported, too many pixels)."""


class Backend(Protocol):
    """Where faces are found and stored: Triton and the database, or a deployed stack's REST API."""

    async def known_hashes(self) -> set[str]: ...

    async def analyze(self, data: bytes) -> Faces: ...  # Unreadable for a bad image

    async def enroll(self, accepted: list[ItemResult]) -> list[int]: ...  # face ids; all or nothing


class LocalBackend:
    def __init__(self, store: GalleryStore, client: AsyncPipeline, options: ImportOptions) -> None:
        self.store, self.client, self.options = store, client, options

    async def known_hashes(self) -> set[str]:
        return await asyncio.to_thread(self.store.known_hashes, self.options.collection)

    async def analyze(self, data: bytes) -> Faces:
        try:
            return await self.client.infer(data, max_faces=self.options.limits.max_faces, return_crops=True)
        except PipelineError as exc:
            if exc.invalid_input:
                raise Unreadable(str(exc)) from exc
            raise

    async def enroll(self, accepted: list[ItemResult]) -> list[int]:
        item = accepted[0].item
        _, stored = await asyncio.to_thread(
            self.store.add_faces, self.options.collection, item.external_id,
            [r.face for r in accepted if r.face is not None], self.options.embedding_model,
            (item.name, {}))
        return [face.id for face in stored]


class Importer:
    def __init__(self, store: GalleryStore | None, client: AsyncPipeline | None, options: ImportOptions,
                 backend: Backend | None = None) -> None:
        if backend is None:
            if store is None or client is None:
                raise ValueError("the local import needs a store and a pipeline client (or a backend)")
            backend = LocalBackend(store, client, options)
        self.backend, self.options = backend, options
        self._slots = asyncio.Semaphore(options.concurrency)
        self._seen: set[str] = set()

    async def _process(self, item: ImportItem, progress: tqdm) -> ItemResult:
        try:
            try:
                data = await asyncio.to_thread(item.path.read_bytes)
            except OSError as exc:
                return ItemResult(item, Status.UNREADABLE, f"cannot read file: {exc.strerror}")
            digest = image_sha256(data)
            if digest in self._seen:
                return ItemResult(item, Status.DUPLICATE, "image already imported", digest)
            self._seen.add(digest)
            async with self._slots:
                try:
                    faces = await self.backend.analyze(data)
                except Unreadable as exc:
                    return ItemResult(item, Status.UNREADABLE, str(exc), digest)
                except Exception as exc:  # Triton or the API failed: this file is reported, the rest goes on
                    return ItemResult(item, Status.FAILED, str(exc), digest)
            result = classify(item, digest, faces, self.options)
            result.data = data if result.status is Status.READY else b""
            return result
        finally:
            progress.update(1)

    async def _enroll(self, results: list[ItemResult]) -> None:
        """Write one identity's accepted faces in one transaction (all or nothing)."""
        accepted = [r for r in results if r.status is Status.READY and r.face is not None]
        if not accepted or self.options.dry_run:
            return
        try:
            face_ids = await self.backend.enroll(accepted)
        except Exception as exc:  # a database or API failure: report these files, keep importing the rest
            log.error("identity %s not enrolled: %s", accepted[0].item.external_id, exc)
            for result in accepted:
                result.status, result.detail = Status.FAILED, f"enrollment failed: {exc}"
            return
        finally:
            for result in accepted:
                result.data, result.face = b"", None
        for result, face_id in zip(accepted, face_ids, strict=True):
            result.status, result.face_id = Status.IMPORTED, face_id

    async def _identity(self, items: list[ImportItem], progress: tqdm) -> list[ItemResult]:
        results = list(await asyncio.gather(*(self._process(item, progress) for item in items)))
        await self._enroll(results)
        return results

    async def run(self, items: Iterable[ImportItem], show_progress: bool = True) -> list[ItemResult]:
        items = list(items)
        self._seen = await self.backend.known_hashes()
        groups: dict[str, list[ImportItem]] = {}
        for item in items:
            groups.setdefault(item.external_id, []).append(item)
        in_flight = asyncio.Semaphore(max(2, 2 * self.options.concurrency))

        async def bounded(group: list[ImportItem]) -> list[ItemResult]:
            async with in_flight:
                return await self._identity(group, progress)

        with tqdm(total=len(items), unit="image", disable=not show_progress) as progress:
            nested = await asyncio.gather(*(bounded(group) for group in groups.values()))
        return [result for group in nested for result in group]


def write_report(results: list[ItemResult], path: Path) -> None:
    """Per-file report as CSV, or JSON when the path ends in .json."""
    rows = [{"path": str(r.item.path), "external_id": r.item.external_id, "name": r.item.name,
             "status": r.status.value, "detail": r.detail, "faces": r.faces, "face_id": r.face_id,
             "sha256": r.sha256} for r in results]
    if path.suffix.lower() == ".json":
        path.write_text(json.dumps(rows, indent=2))
        return
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]) if rows else ["path", "status"])
        writer.writeheader()
        writer.writerows(rows)
