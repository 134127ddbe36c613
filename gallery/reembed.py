"""Re-embed a collection from its stored aligned crops with the embedding model served now.

Embeddings are computed first (through ``face_embedder``, with the client every tool uses), then written
by the store in one transaction together with the collection's new model id, dimension and threshold,
and a DROP entry in the change log so that every index replica rebuilds the collection from the
database. Refused when any face has no stored crop.
"""

from __future__ import annotations

import logging

import cv2
import numpy as np
from numpy.typing import NDArray

from facecore.client import PipelineClient
from facecore.spec import ModelSpec
from gallery.store.store import GalleryStore

log = logging.getLogger(__name__)


def decode_crops(crops: list[bytes], size: int = 112) -> NDArray[np.uint8]:
    """PNG crops -> [N, S, S, 3] BGR (IMREAD_COLOR always decodes to 8-bit BGR)."""
    if not crops:
        return np.zeros((0, size, size, 3), np.uint8)
    return np.stack([cv2.imdecode(np.frombuffer(crop, np.uint8), cv2.IMREAD_COLOR) for crop in crops])


def reembed_collection(store: GalleryStore, collection: str, client: PipelineClient, spec: ModelSpec) -> int:
    """Recompute every face of ``collection`` with ``spec``'s model; returns the number of faces."""
    ids, crops = store.stored_crops(collection)
    vectors = client.embed_crops(decode_crops(crops, spec.input_size[0]), spec)
    store.replace_embeddings(collection, ids, vectors, spec.name, spec.embedding_dim, spec.match_threshold)
    log.info("re-embedded %d faces of %s with %s", len(ids), collection, spec.name)
    return len(ids)
