"""Collections and their API keys (admin only)."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Path, status

from gallery.store.store import CollectionInfo
from service import schemas
from service.deps import AdminDep, CollectionAccessDep, GalleryDep, KeysDep, ServiceDep, StoreDep

router = APIRouter(prefix="/v1/collections", tags=["collections"])


def collection_out(info: CollectionInfo, faces: int) -> schemas.CollectionOut:
    return schemas.CollectionOut(name=info.name, embedding_model=info.embedding_model,
                                 dimension=info.dimension, match_threshold=info.match_threshold,
                                 keep_crops=info.keep_crops, faces=faces, created_at=info.created_at)


@router.post("", response_model=schemas.CollectionOut, status_code=status.HTTP_201_CREATED,
             summary="Create a collection for the embedding model Triton serves")
async def create_collection(body: schemas.CollectionCreate, _: AdminDep, service: ServiceDep,
                            store: StoreDep) -> schemas.CollectionOut:
    spec = await service.embedder()
    threshold = spec.match_threshold if body.match_threshold is None else body.match_threshold
    info = await asyncio.to_thread(store.create_collection, body.name, spec.name, spec.embedding_dim,
                                   threshold, body.keep_crops)
    return collection_out(info, 0)


@router.get("", response_model=list[schemas.CollectionOut], summary="List collections")
async def list_collections(_: AdminDep, store: StoreDep, gallery: GalleryDep) -> list[schemas.CollectionOut]:
    infos = await asyncio.to_thread(store.list_collections)
    sizes = gallery.sizes()
    return [collection_out(info, sizes.get(info.name, 0)) for info in infos]


@router.get("/{collection}", response_model=schemas.CollectionOut, summary="Get a collection")
async def get_collection(collection: str, _: CollectionAccessDep, store: StoreDep,
                         gallery: GalleryDep) -> schemas.CollectionOut:
    info = await asyncio.to_thread(store.get_collection, collection)
    return collection_out(info, await asyncio.to_thread(gallery.size, collection))


@router.get("/{collection}/index", response_model=schemas.IndexOut,
            summary="The collection's search index and what its build measured",
            description="Which index answers searches (exact, or an approximate one chosen by measurement "
                        "on the collection: recall@10 and decision agreement against exact search, "
                        "latency), at what search effort, and at what size it was chosen. The measured "
                        "figures hold for that size: the index is measured again, in the background, once "
                        "the collection has grown by FACEREC_GALLERY__RESELECT_GROWTH (1.5x).")
async def get_index(collection: str, _: CollectionAccessDep, gallery: GalleryDep) -> schemas.IndexOut:
    info, reselecting = await asyncio.to_thread(gallery.describe, collection)
    m = info.measured
    measured = None if m is None else schemas.IndexMeasurement(
        recall_at_10=m.recall, recall_lower_bound=m.recall_bound, genuine_agreement=m.genuine_agreement,
        impostor_agreement=m.impostor_agreement, p50_ms=m.p50_ms, p99_ms=m.p99_ms)
    return schemas.IndexOut(engine=info.engine, kind=info.kind, search_effort=info.effort,
                            chosen_at_faces=info.chosen_at, measured=measured, reselecting=reselecting,
                            faces=info.faces)


@router.delete("/{collection}", status_code=status.HTTP_204_NO_CONTENT,
               summary="Delete a collection with all its identities, faces and keys")
async def delete_collection(collection: str, _: AdminDep, store: StoreDep, gallery: GalleryDep,
                            keys: KeysDep) -> None:
    await asyncio.to_thread(store.delete_collection, collection)
    keys.forget()  # its keys are gone: a new collection of that name must not accept them
    await asyncio.to_thread(gallery.sync)


@router.post("/{collection}/keys", response_model=schemas.KeyCreated, status_code=status.HTTP_201_CREATED,
             summary="Create an API key for this collection (the secret is shown once)")
async def create_key(collection: str, body: schemas.KeyCreate, _: AdminDep,
                     keys: KeysDep) -> schemas.KeyCreated:
    key, info = await asyncio.to_thread(keys.create, collection, body.label)
    return schemas.KeyCreated(key=key, id=info.id, prefix=info.prefix, label=info.label,
                              created_at=info.created_at, revoked_at=None)


@router.get("/{collection}/keys", response_model=list[schemas.KeyOut], summary="List this collection's keys")
async def list_keys(collection: str, _: AdminDep, keys: KeysDep) -> list[schemas.KeyOut]:
    return [schemas.KeyOut(id=k.id, prefix=k.prefix, label=k.label, created_at=k.created_at,
                           revoked_at=k.revoked_at) for k in await asyncio.to_thread(keys.list, collection)]


@router.delete("/{collection}/keys/{key_id}", status_code=status.HTTP_204_NO_CONTENT, summary="Revoke a key",
                description="Refused at once by this gateway; by the other replicas within the follower "
                            "interval (FACEREC_GALLERY__FOLLOW_INTERVAL_S, 0.2 s), when they next check the "
                            "key table.")
async def revoke_key(collection: str, key_id: Annotated[int, Path(ge=1, le=2**63 - 1)], _: AdminDep,
                     keys: KeysDep) -> None:
    await asyncio.to_thread(keys.revoke, collection, key_id)
