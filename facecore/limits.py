"""Request limits, declared once: this dataclass is the settings section ``FACEREC_LIMITS__*`` itself, and
the exported ``face_pipeline`` config, the REST routes and the importer take their defaults from it.

Each field's ``metadata`` holds what pydantic reads when it validates the section (a description and the
bounds, as ``pydantic.Field`` arguments); this module stays free of pydantic because the Triton images,
which import it through ``facecore.pipeline``, do not install it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T", int, float)


def setting(default: T, description: str, **bounds: T) -> T:
    """A settings field of a pydantic-free dataclass: its default, description and bounds (gt, le ...)."""
    return field(default=default, metadata={"description": description, **bounds})


#: face_pipeline is exported with this cap and refuses to return more: the setting can only be lowered.
PIPELINE_MAX_FACES = 100


@dataclass(frozen=True)
class Limits:
    max_upload_bytes: int = setting(10 * 1024 * 1024, "413 above this request body size", gt=0)
    #: Read from the image header before decoding.
    max_pixels: int = setting(40_000_000, "413 above this many pixels (decompression bombs)", gt=0)
    max_faces: int = setting(PIPELINE_MAX_FACES, "faces detected per image at most",
                             gt=0, le=PIPELINE_MAX_FACES)
    max_batch_images: int = setting(16, "images per batch identify or enroll call", gt=0)
    request_timeout_s: float = setting(30.0, "504 after this", gt=0)
    max_k: int = setting(100, "largest top-k a caller may ask for", gt=0)
    #: Detect, identify, enroll and verify count; beyond, 503 with Retry-After instead of a queue that grows.
    max_in_flight: int = setting(32, "recognition requests in the gateway at once; beyond, 503 overloaded",
                                 gt=0)


DEFAULT_LIMITS = Limits()
