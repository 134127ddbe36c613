"""The one settings object of every entry point: environment variables ``FACEREC_<SECTION>__<FIELD>``.

``Settings`` is what every process reads (``python -m service``, ``python -m gallery``, the container
entrypoints); ``GatewaySettings`` adds the admin key, which has no default: the gateway refuses to start
without it. Examples: ``FACEREC_DATABASE__URL=postgresql+psycopg://...``, ``FACEREC_LIMITS__MAX_K=50``.

The database URL is ``FACEREC_DATABASE__URL``, or, so that a password never has to be written into a URL
by hand (a Kubernetes Secret can hold the password alone), it is built from ``FACEREC_DB_HOST``,
``FACEREC_DB_PORT`` (5432), ``FACEREC_DB_NAME`` (facerec), ``FACEREC_DB_USER`` (facerec) and
``FACEREC_DB_PASSWORD``; with neither, SQLite in ``data/``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Self, TypeVar

from pydantic import BaseModel, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy.engine import URL

from facecore.limits import Limits
from facecore.quality import QualityThresholds

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SQLITE = f"sqlite:///{ROOT / 'data' / 'gallery.db'}"


class TritonSettings(BaseModel):
    url: str = Field("127.0.0.1:8001", description="Triton gRPC address")
    timeout_s: float = Field(30.0, gt=0, description="timeout of one face_pipeline call")
    probe_interval_s: float = Field(30.0, gt=0, description="how long the gateway's readiness reuses a "
                                    "successful probe (a real photo through face_pipeline); a failed one 1 s")
    hang_timeout_s: float = Field(30.0, gt=0, description="python -m service kills and restarts its "
                                  "tritonserver when it has answered neither its health check nor the "
                                  "recognition probe for this long")


class DatabaseSettings(BaseModel):
    url: str = Field(DEFAULT_SQLITE, description="SQLAlchemy URL; unset, it is built from FACEREC_DB_HOST "
                     "and the other FACEREC_DB_* parts when those are set")


class GallerySettings(BaseModel):
    backend: Literal["faiss", "milvus"] = Field("faiss", description="faiss: an index in every gateway's "
                                                "memory; milvus: a shared Milvus server (no index in memory)")
    milvus_uri: str = Field("", description="Milvus address, e.g. http://milvus:19530 (the milvus backend "
                            "needs it)")
    milvus_token: SecretStr | None = Field(None, description="Milvus credentials (user:password, or a key)")
    milvus_prefix: str = Field("facerec", pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,100}$",
                               description="prefix of this deployment's Milvus collection names")
    milvus_index_type: str = Field("FLAT", description="Milvus index type (FLAT: exact; HNSW, IVF_SQ8, "
                                   "DISKANN ...: approximate)")
    milvus_index_params: dict[str, Any] = Field(default_factory=dict, description="Milvus index parameters")
    milvus_search_params: dict[str, Any] = Field(default_factory=dict, description="Milvus search parameters")
    snapshot_dir: Path | None = Field(ROOT / "data" / "index",
                                      description="FAISS snapshots (none: no snapshots)")
    follow_interval_s: float = Field(0.2, gt=0,
                                     description="change-log and key-table polling period (replicas)")
    exact_max: int = Field(200_000, ge=0, description="faces above which approximate indexes are measured "
                           "(PQ fast-scan or SQ8 + exact re-rank, IVF); one is kept if it meets the targets "
                           "(at build, and in the background when an exact collection grows past it); "
                           "from 20,000 faces up to it, when the exact scan's timed p99 misses 5 ms")
    reselect_growth: float = Field(1.5, ge=0, description="an index chosen by measurement is measured again, "
                                   "in the background, once its collection holds this many times the faces "
                                   "it was chosen at (0: never; otherwise more than 1)")
    batch_window_ms: float = Field(0.0, ge=0, le=100, description="how long a search waits for concurrent "
                                   "ones to share its engine call (0: only those already queued)")
    snapshot_interval_s: float = Field(300.0, gt=0, description="how often indexes are snapshotted")
    erasure_snapshot_delay_s: float = Field(5.0, gt=0, description="after deletions, snapshots are rewritten "
                                            "within this delay so erased vectors leave the disk")
    default_fpir: float = Field(0.01, ge=0, le=0.5, description="the match policy of new collections: at "
                                "most this share of strangers matched to somebody, whatever the collection's "
                                "size (0: decide at the embedding model's fixed threshold instead)")

    @field_validator("reselect_growth")
    @classmethod
    def growth_or_never(cls, value: float) -> float:
        if 0 < value <= 1:
            raise ValueError("reselect_growth must be 0 (never measure again) or more than 1")
        return value


class SecuritySettings(BaseModel):
    admin_key: SecretStr = Field(description="admin API key (required; at least 16 characters)")

    @field_validator("admin_key")
    @classmethod
    def long_enough(cls, value: SecretStr) -> SecretStr:
        if len(value.get_secret_value()) < 16:
            raise ValueError("the admin key must have at least 16 characters")
        return value


class DeepStackSettings(BaseModel):
    """The DeepStack-compatible face API (``/v1/vision/face/...``) serves one collection."""

    collection: str = Field("", description="collection the DeepStack API serves (empty: the API is off)")
    keyless: Literal["off", "loopback", "network"] = Field(
        "off", description="DeepStack calls that send no key (DeepStack without API-KEY, CodeProject.AI, "
        "Home Assistant's default) act on the collection: off (a key is required), loopback (only calls "
        "from this host's loopback addresses), network (any caller that reaches the gateway can enroll, "
        "recognize and delete in it); a key that is sent must be valid either way")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FACEREC_", env_nested_delimiter="__", extra="ignore")

    triton: TritonSettings = TritonSettings()
    database: DatabaseSettings = DatabaseSettings()
    gallery: GallerySettings = GallerySettings()
    # Plain dataclasses (facecore/limits.py, facecore/quality.py): pydantic validates them from their
    # fields' metadata (descriptions, bounds), as it does the models above.
    limits: Limits = Limits()
    quality: QualityThresholds = QualityThresholds()
    deepstack: DeepStackSettings = DeepStackSettings()
    log_json: bool = Field(False, description="one JSON object per log line (the container images set true)")
    log_level: str = Field("INFO", description="DEBUG, INFO, WARNING or ERROR")
    # The parts of a PostgreSQL URL (used when FACEREC_DATABASE__URL is not set).
    db_host: str = Field("", description="PostgreSQL host")
    db_port: int = Field(5432, gt=0, lt=65536, description="PostgreSQL port")
    db_name: str = Field("facerec", description="PostgreSQL database")
    db_user: str = Field("facerec", description="PostgreSQL user")
    db_password: SecretStr | None = Field(None, description="PostgreSQL password")

    @model_validator(mode="after")
    def database_url(self) -> Self:
        """FACEREC_DATABASE__URL wins; else a PostgreSQL URL from FACEREC_DB_*; else SQLite in data/."""
        if "url" in self.database.model_fields_set or not self.db_host:
            return self
        password = None if self.db_password is None else self.db_password.get_secret_value() or None
        url = URL.create("postgresql+psycopg", username=self.db_user,
                         password=password, host=self.db_host,
                         port=self.db_port, database=self.db_name)
        self.database = DatabaseSettings(url=url.render_as_string(hide_password=False))
        return self

    @model_validator(mode="after")
    def milvus_uri(self) -> Self:
        if self.gallery.backend == "milvus" and not self.gallery.milvus_uri:
            raise ValueError("the milvus gallery backend needs FACEREC_GALLERY__MILVUS_URI")
        return self


class GatewaySettings(Settings):
    """The REST gateway's settings: everything above plus the admin key."""

    security: SecuritySettings


S = TypeVar("S", bound=Settings)


def load_settings(kind: type[S], **overrides: Any) -> S:
    """Settings from the environment (``overrides`` win, deep-merged); a readable SystemExit that names
    the bad fields, and never their values, when they are incomplete or invalid."""
    try:
        return kind(**overrides)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in error['loc'])}: {error['msg']}"
                             for error in exc.errors())
        hint = (" (set FACEREC_SECURITY__ADMIN_KEY, at least 16 characters, and the database settings)"
                if issubclass(kind, GatewaySettings) else "")
        raise SystemExit(f"settings are incomplete or invalid: {problems}{hint}") from None
