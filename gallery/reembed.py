"""Re-embed a collection from its stored aligned crops with the embedding model served now.

Embeddings are computed first, then written in one transaction together with the collection's new
model id, dimension and threshold, and a DROP entry in the change log so that every index replica
rebuilds the collection from the database. Refused when any face has no stored crop.
"""

from __future__ import annotations

import logging
from typing import cast

import cv2
import numpy as np
import tritonclient.grpc as grpcclient
from numpy.typing import NDArray
from sqlalchemy import func, select, update

from facecore.processing import l2_normalize, to_tensor
from facecore.spec import ModelSpec
from gallery.embeddings import encode_vector
from gallery.errors import Conflict, CropsMissing, NotFound
from gallery.models import ChangeOp, Collection, Face, FaceChange
from gallery.store import GalleryStore

log = logging.getLogger(__name__)


def embed_crops(client: grpcclient.InferenceServerClient, spec: ModelSpec, crops: NDArray[np.uint8],
                model_name: str = "face_embedder", batch: int = 32) -> NDArray[np.float32]:
    """Aligned BGR crops [N, S, S, 3] -> L2-normalized embeddings through Triton's embedder model."""
    parts = []
    for start in range(0, len(crops), batch):
        tensor = to_tensor(crops[start : start + batch], spec.swap_rb, spec.mean, spec.std)
        request = grpcclient.InferInput(spec.input_name, list(tensor.shape), "FP32")
        request.set_data_from_numpy(tensor)
        result = client.infer(model_name, [request],
                              outputs=[grpcclient.InferRequestedOutput(spec.output_names[0])])
        parts.append(np.asarray(result.as_numpy(spec.output_names[0]), dtype=np.float32))
    return l2_normalize(np.concatenate(parts)) if parts else np.zeros((0, spec.embedding_dim), np.float32)


def reembed_collection(store: GalleryStore, collection: str, client: grpcclient.InferenceServerClient,
                       spec: ModelSpec) -> int:
    """Recompute every face of ``collection`` with ``spec``'s model; returns the number of faces."""
    with store.db.read() as session:
        owner = session.scalar(select(Collection).where(Collection.name == collection))
        if owner is None:
            raise NotFound(f"collection {collection!r} does not exist", collection=collection)
        missing = session.scalar(select(func.count()).where(Face.collection_id == owner.id,
                                                            Face.crop.is_(None))) or 0
        if missing:
            raise CropsMissing(f"{missing} face(s) of {collection!r} have no stored crop: re-embedding "
                               "needs the aligned crops (collections created with keep_crops=false cannot "
                               "be re-embedded; re-import the images instead)",
                               faces_without_crop=int(missing))
        rows = session.execute(select(Face.id, Face.crop).where(Face.collection_id == owner.id)
                               .order_by(Face.id)).all()
    ids = [r[0] for r in rows]
    # no crop is NULL (checked above); IMREAD_COLOR always decodes to 8-bit BGR
    decoded = [cv2.imdecode(np.frombuffer(cast(bytes, r[1]), np.uint8), cv2.IMREAD_COLOR) for r in rows]
    crops = cast(NDArray[np.uint8], np.stack(decoded)) if rows else np.zeros((0, 112, 112, 3), np.uint8)
    vectors = embed_crops(client, spec, crops)
    with store.db.write() as session:
        owner = session.scalar(select(Collection).where(Collection.name == collection))
        current = (set(session.scalars(select(Face.id).where(Face.collection_id == owner.id)))
                   if owner else set())
        if owner is None or current != set(ids):
            raise Conflict(f"collection {collection!r} changed during re-embedding; run it again")
        session.execute(update(Face), [{"id": face_id, "embedding": encode_vector(vector),
                                        "embedding_model": spec.name}
                                       for face_id, vector in zip(ids, vectors, strict=True)])
        owner.embedding_model, owner.dimension = spec.name, spec.embedding_dim
        owner.match_threshold = spec.match_threshold
        session.add(FaceChange(collection_id=owner.id, face_id=0, identity_id=0, op=ChangeOp.DROP.value))
    log.info("re-embedded %d faces of %s with %s", len(ids), collection, spec.name)
    return len(ids)
