"""Collections and their API keys (admin only)."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Path, status

from gallery.calibration import FPIR, Decision, decide
from gallery.gallery import Gallery
from gallery.store.store import CollectionInfo, GalleryStore
from recognition.usecases import Recognition
from service import schemas
from service.deps import AdminDep, CollectionAccessDep, GalleryDep, KeysDep, ServiceDep, SettingsDep, StoreDep

router = APIRouter(prefix="/v1/collections", tags=["collections"])

POLICY = ("How the collection decides match or unknown. With {\"fpir\": f} its threshold is the score that "
          "at most a share f of strangers reach against some enrolled face, derived for its current size "
          "and raised as it grows (never below match_threshold); decision says where it stands now, and "
          "warns when the target cannot be kept without rejecting most genuine probes (docs/calibration.md).")


def collection_out(info: CollectionInfo, decision: Decision) -> schemas.CollectionOut:
    policy = (schemas.MatchPolicy(fpir=info.target_fpir) if info.match_policy == FPIR
              else schemas.MatchPolicy(threshold=info.match_threshold))
    made = schemas.DecisionOut(threshold=round(decision.threshold, 6), faces=decision.faces,
                               expected_fpir=_rounded(decision.expected_fpir),
                               genuine_rejected=_rounded(decision.genuine_rejected), basis=decision.basis,
                               confidence_at_threshold=round(decision.confidence(decision.threshold), 4),
                               useful_up_to=decision.useful_up_to,
                               warning=decision.warning)
    return schemas.CollectionOut(name=info.name, embedding_model=info.embedding_model,
                                 dimension=info.dimension, match_threshold=info.match_threshold,
                                 match_policy=policy, decision=made, keep_crops=info.keep_crops,
                                 faces=decision.faces, created_at=info.created_at)


def _rounded(value: float | None) -> float | None:
    return None if value is None else float(f"{value:.4g}")


@router.post("", response_model=schemas.CollectionOut, status_code=status.HTTP_201_CREATED,
             summary="Create a collection for the embedding model Triton serves", description=POLICY)
async def create_collection(body: schemas.CollectionCreate, _: AdminDep, service: ServiceDep,
                            store: StoreDep, settings: SettingsDep) -> schemas.CollectionOut:
    spec = await service.embedder()
    policy = body.match_policy
    fixed = body.match_threshold if policy is None or policy.threshold is None else policy.threshold
    threshold = spec.match_threshold if fixed is None else fixed
    if policy is not None:
        fpir = policy.fpir
    else:
        fpir = None if body.match_threshold is not None or not settings.gallery.default_fpir \
            else settings.gallery.default_fpir
    info = await asyncio.to_thread(store.create_collection, body.name, spec.name, spec.embedding_dim,
                                   threshold, body.keep_crops, fpir)
    return collection_out(info, decide(info, 0, spec.score_reference))


@router.get("", response_model=list[schemas.CollectionOut], summary="List collections")
async def list_collections(_: AdminDep, store: StoreDep, gallery: GalleryDep,
                           service: ServiceDep) -> list[schemas.CollectionOut]:
    infos = await asyncio.to_thread(store.list_collections)
    sizes, reference = gallery.sizes(), (await service.embedder()).score_reference
    return [collection_out(info, decide(info, sizes.get(info.name, 0), reference)) for info in infos]


@router.get("/{collection}", response_model=schemas.CollectionOut, summary="Get a collection",
            description=POLICY)
async def get_collection(collection: str, _: CollectionAccessDep, store: StoreDep, gallery: GalleryDep,
                         service: ServiceDep) -> schemas.CollectionOut:
    return await _described(collection, store, gallery, service)


async def _described(collection: str, store: GalleryStore, gallery: Gallery,
                     service: Recognition) -> schemas.CollectionOut:
    """The collection as the database holds it (not this replica's copy, which may lag), at the size of
    its index here."""
    reference = (await service.embedder()).score_reference
    info = await asyncio.to_thread(store.get_collection, collection)
    faces = await asyncio.to_thread(gallery.size, collection)
    return collection_out(info, decide(info, faces, reference))


@router.patch("/{collection}", response_model=schemas.CollectionOut,
              summary="Change a collection's match policy",
              description=POLICY + " Every gateway decides with the new policy once it has applied the "
                                   "change log (within the follower interval).")
async def update_collection(collection: str, body: schemas.CollectionUpdate, _: AdminDep, store: StoreDep,
                            gallery: GalleryDep, service: ServiceDep) -> schemas.CollectionOut:
    policy = body.match_policy
    await asyncio.to_thread(gallery.policies.set_policy, collection, policy.fpir, policy.threshold)
    await asyncio.to_thread(gallery.sync)
    return await _described(collection, store, gallery, service)


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
