"""Request limits, defined once: the gateway's settings, the exported ``face_pipeline`` config, the REST
routes and the importer all take their defaults from ``DEFAULT_LIMITS``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    #: 413 above this request body size.
    max_upload_bytes: int = 10 * 1024 * 1024
    #: 413 above this many pixels, read from the image header before decoding (decompression bombs).
    max_pixels: int = 40_000_000
    #: Faces detected per image at most (also ``face_pipeline``'s ``max_faces``: a caller cannot ask more).
    max_faces: int = 100
    #: Images per batch identify or enroll call.
    max_batch_images: int = 16
    #: 504 after this.
    request_timeout_s: float = 30.0
    #: Largest top-k a caller may ask for.
    max_k: int = 100
    #: Recognition requests (detect, identify, enroll, verify) inside one gateway at once; beyond, 503
    #: ``overloaded`` with Retry-After instead of a queue that grows.
    max_in_flight: int = 32


DEFAULT_LIMITS = Limits()
