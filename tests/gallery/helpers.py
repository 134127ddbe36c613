"""Helpers for the gallery tests (raw SQL, synthetic faces, index-equals-database checks).

Plain functions, imported by the test modules (so pytest does not rewrite their asserts: they carry
their own messages); the fixtures live in ``tests/gallery/fixtures.py``.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray
from sqlalchemy import Engine, text

from gallery.gallery import Gallery
from gallery.store.store import NewFace

#: ``make_gallery(store, snapshot_dir=None, config=None)`` (the fixture in tests/gallery/fixtures.py)
GalleryFactory = Callable[..., Gallery]

MODEL = "test-model-v1"
OTHER_MODEL = "test-model-v2"


def without_times(info: Any) -> dict[str, Any]:
    """A store record minus its timestamps (SQLite hands them back without a UTC offset)."""
    fields = dataclasses.asdict(info)
    fields.pop("created_at", None)
    fields.pop("updated_at", None)
    return fields


# --- raw SQL ------------------------------------------------------------------------------------


def sql_scalar(engine: Engine, sql: str, **params: Any) -> Any:
    with engine.connect() as connection:
        return connection.execute(text(sql), params).scalar()


def sql_rows(engine: Engine, sql: str, **params: Any) -> list[tuple[Any, ...]]:
    with engine.connect() as connection:
        return [tuple(row) for row in connection.execute(text(sql), params)]


_FACES_OF = "FROM faces f JOIN collections c ON c.id = f.collection_id WHERE c.name = :name"


def db_faces(engine: Engine, collection: str) -> dict[int, int]:
    """face id -> identity id, straight from the faces table."""
    rows = sql_rows(engine, f"SELECT f.id, f.identity_id {_FACES_OF}", name=collection)
    return {int(face): int(identity) for face, identity in rows}


def db_vectors(engine: Engine, collection: str, dimension: int) -> dict[int, NDArray[np.float32]]:
    rows = sql_rows(engine, f"SELECT f.id, f.embedding {_FACES_OF}", name=collection)
    return {int(face): np.frombuffer(bytes(blob), dtype="<f4").astype(np.float32).reshape(dimension)
            for face, blob in rows}


# --- data ---------------------------------------------------------------------------------------


def unit_vectors(rng: np.random.Generator, count: int, dimension: int) -> NDArray[np.float32]:
    vectors = rng.standard_normal((count, dimension))
    normalized: NDArray[np.float32] = (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype("f4")
    return normalized


def new_faces(vectors: Sequence[Any] | NDArray[np.float32], crop: bytes | None = b"\x89PNG fake crop",
              tag: str = "") -> list[NewFace]:
    """NewFace rows with a distinct image hash each (derived from the vector bytes and ``tag``)."""
    faces = []
    for row, vector in enumerate(vectors):
        digest = hashlib.sha256(np.asarray(vector, dtype=np.float64).tobytes() + f"{tag}/{row}".encode())
        faces.append(NewFace(embedding=np.asarray(vector), image_sha256=digest.hexdigest(),
                             box=[1.0, 2.0, 50.0, 60.0], detection_score=0.99, quality={"sharpness": 0.5},
                             crop=crop))
    return faces


# --- checks -------------------------------------------------------------------------------------


def assert_gallery_matches_db(gallery: Gallery, engine: Engine, collection: str, dimension: int,
                              unique_vectors: bool = True) -> None:
    """The index holds exactly the database's faces, each mapped to its identity and findable by its
    own vector (its identity ranked first with score ~1; tied first places allowed unless
    ``unique_vectors``)."""
    expected = db_faces(engine, collection)
    held = gallery.face_ids(collection)
    assert held == set(expected), (f"index lacks faces {sorted(set(expected) - held)}, "
                                   f"holds deleted faces {sorted(held - set(expected))}")
    mapping = gallery.face_identities(collection)
    assert mapping == expected, {f: (mapping.get(f), expected.get(f)) for f in set(mapping) | set(expected)
                                 if mapping.get(f) != expected.get(f)}
    if not expected:
        return
    vectors = db_vectors(engine, collection, dimension)
    ids = sorted(vectors)
    results = gallery.search(collection, np.stack([vectors[i] for i in ids]), k=1 if unique_vectors else 10)
    for face_id, result in zip(ids, results, strict=True):
        top = result.candidates[0]
        assert abs(top.score - 1.0) < 1e-4, (face_id, top)
        if unique_vectors:
            assert (top.identity_id, top.face_id) == (expected[face_id], face_id)
        else:
            tied = {c.identity_id for c in result.candidates if c.score >= top.score - 1e-6}
            assert expected[face_id] in tied, (face_id, result.candidates)
