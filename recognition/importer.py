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
import os
import re
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
from gallery.store.store import GalleryStore, NewFace
from recognition.enrollment import EnrollmentRules, FaceChoice, enrollable_face, image_sha256
from recognition.errors import Refused

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp"}
#: The API's rule for an external id (``service.schemas.ExternalId``): 1..256 characters, no "/", not
#: starting with whitespace.
EXTERNAL_ID = re.compile(r"[^/\s][^/]*")
EXTERNAL_ID_MAX = 256


class Status(StrEnum):
    IMPORTED = "imported"
    READY = "ready"  # dry run: would be imported
    NO_FACE = "no_face"
    SEVERAL_FACES = "several_faces"
    LOW_QUALITY = "low_quality"
    UNREADABLE = "unreadable"
    DUPLICATE = "duplicate"
    #: Triton, the API or the database failed for this file: it was not written. A failed analysis fails
    #: only its file (the identity's other images are still enrolled); a failed enrollment call fails the
    #: files of that call (all the identity's accepted files, unless earlier REST calls already stored some).
    FAILED = "failed"


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
    data: bytes = field(default=b"", repr=False)  # the image, kept until enrolled (backends that upload it)


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


def valid_external_id(external_id: str) -> bool:
    """Whether the API accepts this external id (the local import applies the same rule to a manifest)."""
    return len(external_id) <= EXTERNAL_ID_MAX and EXTERNAL_ID.fullmatch(external_id) is not None


def read_manifest(manifest: Path) -> list[ImportItem]:
    """CSV with a header: ``path,external_id,name`` (paths relative to the manifest's folder), UTF-8 with or
    without a BOM; values are trimmed. A bad row refuses the whole manifest (``ValueError`` naming its line),
    before anything is imported."""
    try:
        with manifest.open(newline="", encoding="utf-8-sig") as handle:
            return _manifest_rows(manifest, csv.DictReader(handle))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{manifest}: not UTF-8 (byte {exc.start}): save the manifest as UTF-8") from exc
    except csv.Error as exc:
        raise ValueError(f"{manifest}: not a readable CSV: {exc}") from exc


def _manifest_rows(manifest: Path, reader: csv.DictReader[str]) -> list[ImportItem]:
    columns = [name.strip() for name in reader.fieldnames or []]
    reader.fieldnames = columns
    missing = {"path", "external_id"} - set(columns)
    if missing:
        raise ValueError(f"{manifest}: missing column(s) {', '.join(sorted(missing))}")
    items = []
    for row in reader:
        line = reader.line_num
        value = {key: (row.get(key) or "").strip() for key in ("path", "external_id", "name")}
        if not value["path"] or not value["external_id"]:
            raise ValueError(f"{manifest}:{line}: path and external_id are required")
        if not valid_external_id(value["external_id"]):
            raise ValueError(f"{manifest}:{line}: external_id {value['external_id']!r} is not valid "
                             f"(1-{EXTERNAL_ID_MAX} characters, no '/', not starting with a space)")
        path = Path(value["path"])
        items.append(ImportItem(path if path.is_absolute() else manifest.parent / path,
                                value["external_id"], value["name"] or value["external_id"]))
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
    """The backend could not read this image (corrupt, unsupported, too many pixels, too large)."""


class PartlyEnrolled(Exception):
    """An identity enrolled in several calls failed after the first ``face_ids`` (of its first files) were
    stored; ``__cause__`` is the failure."""

    def __init__(self, face_ids: list[int], reason: Exception) -> None:
        super().__init__(str(reason))
        self.face_ids = face_ids


class Backend(Protocol):
    """Where faces are found and stored: Triton and the database, or a deployed stack's REST API.
    ``uploads_images``: ``enroll`` sends the image bytes again (else only the analysed face is kept)."""

    uploads_images: bool

    async def known_hashes(self) -> set[str]: ...

    async def analyze(self, data: bytes) -> Faces: ...  # Unreadable for a bad image

    #: Face ids, in order; all or nothing per call (``PartlyEnrolled`` when an earlier call was stored).
    async def enroll(self, accepted: list[ItemResult]) -> list[int]: ...


class LocalBackend:
    uploads_images = False

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
            if not _utf8(item.external_id) or not _utf8(item.name):
                return ItemResult(item, Status.UNREADABLE, "the identity's folder name is not valid UTF-8 "
                                  "(rename the folder)")
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
                    return ItemResult(item, Status.FAILED, f"analysis failed: {exc}", digest)
            result = classify(item, digest, faces, self.options)
            keep = result.status is Status.READY and self.backend.uploads_images and not self.options.dry_run
            result.data = data if keep else b""
            if self.options.dry_run:
                result.face = None
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
            face_ids = exc.face_ids if isinstance(exc, PartlyEnrolled) else []
            log.error("identity %s: %d of %d files not enrolled: %s", accepted[0].item.external_id,
                      len(accepted) - len(face_ids), len(accepted), exc)
            for result in accepted[len(face_ids):]:
                result.status, result.detail = Status.FAILED, f"enrollment failed: {exc}"
            accepted = accepted[:len(face_ids)]
        finally:
            for result in accepted:
                result.data, result.face = b"", None
        for result, face_id in zip(accepted, face_ids, strict=True):
            result.status, result.face_id = Status.IMPORTED, face_id

    async def _identity(self, items: list[ImportItem], progress: tqdm,
                        done: list[ItemResult]) -> list[ItemResult]:
        results = list(await asyncio.gather(*(self._process(item, progress) for item in items)))
        await self._enroll(results)
        done += results
        return results

    async def run(self, items: Iterable[ImportItem], show_progress: bool = True,
                  done: list[ItemResult] | None = None) -> list[ItemResult]:
        """Import ``items``; ``done`` receives each identity's results as it finishes (what is known when the
        import is interrupted)."""
        done = [] if done is None else done
        items = list(items)
        self._seen = await self.backend.known_hashes()
        groups: dict[str, list[ImportItem]] = {}
        for item in items:
            groups.setdefault(item.external_id, []).append(item)
        in_flight = asyncio.Semaphore(max(2, 2 * self.options.concurrency))

        async def bounded(group: list[ImportItem]) -> list[ItemResult]:
            async with in_flight:
                return await self._identity(group, progress, done)

        with tqdm(total=len(items), unit="image", disable=not show_progress) as progress:
            nested = await asyncio.gather(*(bounded(group) for group in groups.values()))
        return [result for group in nested for result in group]


def _utf8(text: str) -> bool:
    """False for a name read from a file system that is not UTF-8 (Python keeps its bytes as surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_report_path(path: Path) -> None:
    """Refuse a report that could not be written, before the import starts (``ValueError``)."""
    if path.is_dir():
        raise ValueError(f"--report {path}: is a folder")
    folder = path.parent
    if not folder.is_dir():
        raise ValueError(f"--report {path}: no folder {folder}")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"--report {path}: not writable")


def write_report(results: list[ItemResult], path: Path) -> None:
    """Per-file report as CSV, or JSON when the path ends in .json. A name that is not valid UTF-8 is
    written with its undecodable bytes escaped (``\\udcNN``)."""
    rows = [{"path": str(r.item.path), "external_id": r.item.external_id, "name": r.item.name,
             "status": r.status.value, "detail": r.detail, "faces": r.faces, "face_id": r.face_id,
             "sha256": r.sha256} for r in results]
    if path.suffix.lower() == ".json":
        path.write_text(json.dumps(rows, indent=2))
        return
    with path.open("w", newline="", encoding="utf-8", errors="backslashreplace") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]) if rows else ["path", "status"])
        writer.writeheader()
        writer.writerows(rows)
