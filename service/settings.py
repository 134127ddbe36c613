"""The gateway's one settings object: environment variables ``FACEREC_<SECTION>__<FIELD>``.

Example: ``FACEREC_DATABASE__URL=postgresql+psycopg://...``, ``FACEREC_SECURITY__ADMIN_KEY=...``.
There is no default for secrets: the gateway refuses to start without an admin key.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from facecore.quality import QualityThresholds

ROOT = Path(__file__).resolve().parent.parent


class TritonSettings(BaseModel):
    url: str = Field("127.0.0.1:8001", description="Triton gRPC address")
    timeout_s: float = Field(30.0, gt=0, description="timeout of one face_pipeline call")


class DatabaseSettings(BaseModel):
    url: str = Field(f"sqlite:///{ROOT / 'data' / 'gallery.db'}", description="SQLAlchemy URL")


class GallerySettings(BaseModel):
    snapshot_dir: Path | None = Field(ROOT / "data" / "index",
                                      description="FAISS snapshots (none: no snapshots)")
    follow_interval_s: float = Field(0.2, gt=0, description="change-log polling period (replicas)")
    exact_max: int = Field(200_000, ge=0, description="faces above which an IVF index is tried")
    snapshot_interval_s: float = Field(300.0, gt=0, description="how often indexes are snapshotted")
    erasure_snapshot_delay_s: float = Field(5.0, gt=0, description="after deletions, snapshots are rewritten "
                                            "within this delay so erased vectors leave the disk")


class SecuritySettings(BaseModel):
    admin_key: SecretStr = Field(description="admin API key (required; at least 16 characters)")

    @field_validator("admin_key")
    @classmethod
    def long_enough(cls, value: SecretStr) -> SecretStr:
        if len(value.get_secret_value()) < 16:
            raise ValueError("the admin key must have at least 16 characters")
        return value


class LimitSettings(BaseModel):
    max_upload_bytes: int = Field(10 * 1024 * 1024, gt=0, description="413 above this request body size")
    max_pixels: int = Field(40_000_000, gt=0, description="413 above this many pixels (decompression bombs)")
    max_faces: int = Field(100, gt=0, le=100, description="faces detected per image at most")
    max_batch_images: int = Field(16, gt=0, description="images per batch identify or enroll call")
    request_timeout_s: float = Field(30.0, gt=0, description="504 after this")
    max_k: int = Field(100, gt=0, description="largest top-k a caller may ask for")


class QualitySettings(BaseModel):
    """Enrollment quality gate (see facecore/quality.py)."""

    min_face_size: float = Field(QualityThresholds.min_face_size, description="shorter box side, pixels")
    min_blur: float = Field(QualityThresholds.min_blur, description="variance of the Laplacian of the crop")
    max_yaw: float = Field(QualityThresholds.max_yaw, description="degrees, estimated from landmarks")
    max_pitch: float = Field(QualityThresholds.max_pitch, description="degrees, estimated from landmarks")
    max_roll: float = Field(QualityThresholds.max_roll, description="degrees, from the eye line")
    min_detection_score: float = Field(QualityThresholds.min_detection_score, description="detector score")

    def thresholds(self) -> QualityThresholds:
        return QualityThresholds(**self.model_dump())


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FACEREC_", env_nested_delimiter="__", extra="ignore")

    triton: TritonSettings = TritonSettings()
    database: DatabaseSettings = DatabaseSettings()
    gallery: GallerySettings = GallerySettings()
    security: SecuritySettings
    limits: LimitSettings = LimitSettings()
    quality: QualitySettings = QualitySettings()
    log_json: bool = Field(False, description="one JSON object per log line (the container images set true)")
    log_level: str = Field("INFO", description="DEBUG, INFO, WARNING or ERROR")
