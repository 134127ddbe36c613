"""Gallery errors. Each has a stable ``code`` the REST gateway returns as is."""

from __future__ import annotations


class GalleryError(Exception):
    """Base class: ``code`` is stable and machine-readable, the message is for people."""

    code = "gallery_error"

    def __init__(self, message: str, **details: object) -> None:
        super().__init__(message)
        self.message = message
        self.details = details


class NotFound(GalleryError):
    code = "not_found"


class Conflict(GalleryError):
    code = "conflict"


class InvalidEmbedding(GalleryError):
    code = "invalid_embedding"


class ModelMismatch(GalleryError):
    code = "embedding_model_mismatch"


class CropsMissing(GalleryError):
    code = "crops_missing"
