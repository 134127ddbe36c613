"""Dependency aliases: the routes ask for what they need; the lifespan put it on ``app.state``."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request, Security
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from gallery.gallery import Gallery
from gallery.store import GalleryStore
from service.auth import KeyStore, Principal
from service.errors import Forbidden, Unauthorized
from service.recognition import FaceService
from service.settings import Settings

_api_key = APIKeyHeader(name="X-API-Key", auto_error=False, description="admin or collection key")
_bearer = HTTPBearer(auto_error=False, description="the same key as a bearer token")


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_service(request: Request) -> FaceService:
    service: FaceService = request.app.state.faces
    return service


def get_store(request: Request) -> GalleryStore:
    store: GalleryStore = request.app.state.store
    return store


def get_gallery(request: Request) -> Gallery:
    gallery: Gallery = request.app.state.gallery
    return gallery


def get_keys(request: Request) -> KeyStore:
    keys: KeyStore = request.app.state.keys
    return keys


SettingsDep = Annotated[Settings, Depends(get_settings)]
ServiceDep = Annotated[FaceService, Depends(get_service)]
StoreDep = Annotated[GalleryStore, Depends(get_store)]
GalleryDep = Annotated[Gallery, Depends(get_gallery)]
KeysDep = Annotated[KeyStore, Depends(get_keys)]


async def principal(
    keys: KeysDep,
    header: Annotated[str | None, Security(_api_key)] = None,
    bearer: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)] = None,
) -> Principal:
    """Any valid key (admin or collection): 401 without one."""
    presented = header or (bearer.credentials if bearer else None)
    if not presented:
        raise Unauthorized("an API key is required (X-API-Key header)")
    found = await run_in_threadpool(keys.authenticate, presented)
    if found is None:
        raise Unauthorized("the API key is not valid")
    return found


CallerDep = Annotated[Principal, Depends(principal)]


async def admin(caller: CallerDep) -> Principal:
    if not caller.admin:
        raise Forbidden("this route needs the admin key")
    return caller


async def collection_access(collection: str, caller: CallerDep) -> Principal:
    """The admin, or a key of this very collection (403 for another collection's key)."""
    if not caller.can_access(collection):
        raise Forbidden("this key belongs to another collection")
    return caller


AdminDep = Annotated[Principal, Depends(admin)]
CollectionAccessDep = Annotated[Principal, Depends(collection_access)]
