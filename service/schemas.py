"""Request and response models of REST API v1 (they are the OpenAPI schema)."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema, model_validator

from recognition.enrollment import FaceChoice

Name = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
                            examples=["employees"])]
ExternalId = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^/\s][^/]*$",
                                  examples=["emp-0042"])]
Base64Image = Annotated[str, Field(min_length=1,
                                   description="JPEG, PNG, WebP or BMP bytes, base64 (a data: URI "
                                               "prefix is accepted)")]


#: Metadata nested deeper than this is refused (deeper values were stored, then could not be serialized:
#: every later listing of the collection failed).
MAX_METADATA_DEPTH = 20
#: Metadata larger than this, as compact JSON in UTF-8, is refused: only the request body's 10 MiB bounded
#: it, and a listing of 500 such identities would load gigabytes into the gateway.
MAX_METADATA_BYTES = 64 * 1024


def _strict_json(value: dict[str, Any]) -> dict[str, Any]:
    """Plain, bounded JSON: Python's parser accepts NaN/Infinity, which are not JSON (stored, they became
    null on SQLite and a 500 on PostgreSQL)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > MAX_METADATA_DEPTH:
                raise ValueError(f"metadata is nested deeper than {MAX_METADATA_DEPTH} levels")
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
    except ValueError as exc:
        raise ValueError("metadata must be plain JSON (no NaN or Infinity)") from exc
    if len(text.encode("utf-8", "surrogatepass")) > MAX_METADATA_BYTES:
        raise ValueError(f"metadata is larger than {MAX_METADATA_BYTES} bytes of JSON")
    return value


Metadata = Annotated[dict[str, Any], AfterValidator(_strict_json)]


class Box(BaseModel):
    x1: float
    y1: float
    x2: float
    y2: float


class Point(BaseModel):
    x: float
    y: float


class Quality(BaseModel):
    face_size: float = Field(description="shorter side of the box, pixels")
    blur: float = Field(description="variance of the Laplacian of the aligned 112x112 crop (low = blurry)")
    yaw: float = Field(description="degrees, estimated from the landmarks")
    pitch: float
    roll: float
    detection_score: float


class DetectedFace(BaseModel):
    box: Box
    score: float = Field(description="detection score")
    landmarks: list[Point] = Field(description="left eye, right eye, nose, left and right mouth corners")
    quality: Quality


class DetectResponse(BaseModel):
    width: int
    height: int
    faces: list[DetectedFace]


class MatchPolicy(BaseModel):
    """How a collection decides ``match`` or ``unknown``: at a target false-positive identification rate
    (the threshold follows the collection's size), or at a fixed threshold."""

    model_config = ConfigDict(extra="forbid",
                              json_schema_extra={"examples": [{"fpir": 0.01}, {"threshold": 0.4}]})

    fpir: float | None = Field(None, gt=0, le=0.5, description="the share of strangers (people not enrolled) "
                               "that may be matched to somebody, whatever the collection's size (e.g. 0.01)")
    threshold: float | None = Field(None, ge=-1, le=1, description="a fixed cosine threshold (the model's "
                                    "1:1 operating point when null)")

    @model_validator(mode="after")
    def one_of(self) -> MatchPolicy:
        if self.fpir is not None and self.threshold is not None:
            raise ValueError("a match policy is either fpir or threshold, not both")
        return self


class CollectionCreate(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"name": "employees"}, {"name": "door", "match_policy": {"fpir": 0.001}}]})

    name: Name
    match_policy: MatchPolicy | None = Field(None, description="default: {\"fpir\": "
                                             "FACEREC_GALLERY__DEFAULT_FPIR} (0.01), or the model's fixed "
                                             "threshold when that setting is 0")
    match_threshold: float | None = Field(None, ge=-1, le=1, description="the fixed threshold, or with an "
                                          "fpir policy the floor its threshold never goes below (default: "
                                          "the embedding model's 1:1 threshold)")
    keep_crops: bool = Field(True, description="store aligned crops (needed to re-embed with a new model)")


class CollectionUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    match_policy: MatchPolicy


class DecisionOut(BaseModel):
    """How the collection decides now, at its current size."""

    threshold: float = Field(description="the cosine an identity's best face must reach to be a match")
    faces: int = Field(description="enrolled faces: each is a comparison a stranger can win")
    expected_fpir: float | None = Field(description="share of strangers matched to somebody at this size, "
                                        "from the impostor score model (null: no score model)")
    genuine_rejected: float | None = Field(description="share of genuine probes (one face against one face) "
                                           "below the threshold, from the model's reference genuine scores")
    basis: Literal["collection", "reference", "fixed"] = Field(
        description="collection: the impostor tail measured on the collection's own cross-identity scores; "
                    "reference: the embedding model's reference; fixed: a fixed threshold")
    confidence_at_threshold: float = Field(description="the confidence of a candidate scoring exactly the "
                                           "threshold (candidates' confidences are compared with it)")
    useful_up_to: int | None = Field(description="fpir policy: the most faces at which its threshold still "
                                     "lets at least half the genuine probes through (it rises as the "
                                     "collection grows); null for a fixed threshold or without a score model")
    warning: str | None = Field(description="set when the policy cannot be kept usefully at this size")


class CollectionOut(BaseModel):
    name: str
    embedding_model: str
    dimension: int
    match_threshold: float = Field(description="the fixed threshold, or the floor of an fpir policy")
    match_policy: MatchPolicy
    decision: DecisionOut
    keep_crops: bool
    faces: int = Field(description="faces in the collection's index")
    created_at: datetime


class IndexMeasurement(BaseModel):
    """What the index's build measured on the collection itself, against exact search."""

    recall_at_10: float
    recall_lower_bound: float = Field(description="recall@10 less two standard errors")
    genuine_agreement: float = Field(description="share of genuine probes given the same decision (the "
                                     "same identity above the threshold, or unknown) as exact search")
    impostor_agreement: float = Field(description="the same on impostor probes (faces of people not "
                                      "enrolled)")
    p50_ms: float | None = Field(description="single-query latency when measured")
    p99_ms: float | None


class IndexOut(BaseModel):
    engine: Literal["faiss", "milvus"]
    kind: str = Field(description="FAISS: flat (exact), pq4fs, pq4fs-fine or sq8 (codes re-ranked exactly), "
                      "ivf; Milvus: its index type (FLAT: exact)")
    search_effort: int | None = Field(description="re-rank depth, or lists scanned (ivf); null when exact")
    chosen_at_faces: int | None = Field(description="faces when the candidates were measured; it is measured "
                                        "again once the collection holds FACEREC_GALLERY__RESELECT_GROWTH "
                                        "times as many (null: never measured, exact because small)")
    measured: IndexMeasurement | None = Field(description="the kept index's measurement (null when exact)")
    reselecting: bool = Field(description="a new index is being chosen in the background; this one serves "
                              "meanwhile")
    faces: int


class KeyCreate(BaseModel):
    label: str = Field("", max_length=128, examples=["kiosk-3"])


class KeyOut(BaseModel):
    id: int
    prefix: str
    label: str
    created_at: datetime
    revoked_at: datetime | None


class KeyCreated(KeyOut):
    key: str = Field(description="the secret; shown once, store it now")


class IdentityCreate(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"external_id": "emp-0042", "name": "Ada Lovelace", "metadata": {"team": "analytics"}}]})

    external_id: ExternalId
    name: str = Field("", max_length=256)
    metadata: Metadata = Field(default_factory=dict)


class IdentityUpdate(BaseModel):
    name: str | None = Field(None, max_length=256)
    metadata: Metadata | None = None


class IdentityOut(BaseModel):
    external_id: str
    name: str
    metadata: dict[str, Any]
    created_at: datetime
    updated_at: datetime


class IdentityPage(BaseModel):
    items: list[IdentityOut]
    total: int
    offset: int
    limit: int


class FaceOut(BaseModel):
    id: int
    image_sha256: str
    box: Box
    detection_score: float
    quality: dict[str, float]
    has_crop: bool
    created_at: datetime


#: Unset (None) differs from "only" (a conflict with the query parameter is detected); documented as the enum.
OptionalFaceChoice = Annotated[FaceChoice | None, WithJsonSchema(
    {"type": "string", "enum": [c.value for c in FaceChoice], "default": FaceChoice.ONLY.value})]


class EnrollJson(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unknown field is a 422, not silently dropped

    images: list[Base64Image] = Field(min_length=1)
    face: OptionalFaceChoice = Field(None, description="only (default) or largest; also a query parameter")
    box: list[float] | None = Field(None, min_length=4, max_length=4,
                                    description="x1,y1,x2,y2: the face to take; also a query parameter")


class IgnoredFaceOut(BaseModel):
    image: int = Field(description="index of the image in the request")
    box: Box
    reason: Literal["face_too_small", "not_largest", "outside_box"] = Field(
        description="face_too_small: below the quality gate's minimum size, so it never counts as a second "
                    "face; not_largest: face=largest took a bigger one; outside_box: the box chose another")


class EnrollResponse(BaseModel):
    identity: IdentityOut
    faces: list[FaceOut]
    ignored: list[IgnoredFaceOut] = Field(default_factory=list,
                                          description="detected faces that were not enrolled, and why")


class ImageJson(BaseModel):
    image: Base64Image


class BatchJson(BaseModel):
    images: list[Base64Image] = Field(min_length=1)


class VerifyJson(BaseModel):
    image_a: Base64Image
    image_b: Base64Image


class Candidate(BaseModel):
    external_id: str
    name: str
    score: float = Field(description="cosine similarity of the identity's closest enrolled face")
    confidence: float = Field(description="the probability that this candidate is the person and not a "
                              "stranger's look-alike, given its score and the collection's size, for a probe "
                              "as likely enrolled as not (docs/calibration.md)")


class IdentifiedFace(BaseModel):
    box: Box
    score: float = Field(description="detection score")
    landmarks: list[Point]
    decision: Literal["match", "unknown"]
    identity: Candidate | None = Field(description="the match, or null when unknown")
    candidates: list[Candidate]


class IdentifyResponse(BaseModel):
    width: int
    height: int
    threshold: float = Field(description="the threshold used: the request's, else the collection's at its "
                             "size")
    match_policy: Literal["fixed", "fpir"]
    expected_fpir: float | None = Field(description="share of strangers matched to somebody at this "
                                        "threshold and the collection's size (null: no score model)")
    faces: list[IdentifiedFace]


class FaceSearchResponse(BaseModel):
    face_id: int = Field(description="the stored face searched with")
    external_id: str = Field(description="its identity")
    threshold: float
    decision: Literal["match", "unknown"] = Field(description="match: the best other identity reaches the "
                                                              "threshold (a possible duplicate)")
    identity: Candidate | None = Field(description="the best candidate when it matches, else null")
    candidates: list[Candidate] = Field(description="top-k identities by their closest face, the searched "
                                                    "face itself left out")


class BatchItem(BaseModel):
    index: int
    result: IdentifyResponse | None = None
    error: dict[str, Any] | None = Field(None, description="{code, message, details} when this image failed")


class BatchIdentifyResponse(BaseModel):
    results: list[BatchItem]


class VerifyResponse(BaseModel):
    score: float = Field(description="cosine similarity")
    confidence: float
    threshold: float
    same: bool
    face_a: DetectedFace | None = None
    face_b: DetectedFace | None = None


class Liveness(BaseModel):
    status: Literal["ok"] = "ok"


class Readiness(BaseModel):
    ready: bool = Field(description="triton, recognition and gallery pass: identify can be answered (a "
                        "database outage is reported in checks and keeps the gateway ready: writes get 503)")
    checks: dict[str, bool] = Field(description="triton (models loaded), recognition (a real photo went "
                                    "through face_pipeline), database, gallery")
    details: dict[str, str] = Field(default_factory=dict, description="why a check failed")
