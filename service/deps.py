"""Dependency aliases: the routes ask for what they need; the lifespan put it on ``app.state``.

Each dependency FastAPI solves costs CPU on every request (about 60 us on the project's 2-core machines:
FastAPI 0.16x classifies and caches every node of the tree per request), so the recognition routes, which
nearly every request takes, ask for one: ``AdmittedDep`` / ``AdmittedCollectionDep`` check the key (and
the collection), admit the request under the in-flight limit and hand over the use cases and the
settings: eleven nodes became five on identify (``python -m bench.gateway`` measures the gateway's own
CPU per identify).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Query, Request, Security
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from facecore.settings import GatewaySettings
from gallery.gallery import Gallery
from gallery.store import GalleryStore
from recognition.usecases import Recognition
from service.admission import Admission
from service.auth import KeyStore, Principal
from service.errors import ApiError, Forbidden, Unauthorized

_api_key = APIKeyHeader(name="X-API-Key", auto_error=False, description="admin or collection key")
_bearer = HTTPBearer(auto_error=False, description="the same key as a bearer token")


async def get_settings(request: Request) -> GatewaySettings:
    settings: GatewaySettings = request.app.state.settings
    return settings


async def get_service(request: Request) -> Recognition:
    service: Recognition = request.app.state.faces
    return service


async def get_store(request: Request) -> GalleryStore:
    store: GalleryStore = request.app.state.store
    return store


async def get_gallery(request: Request) -> Gallery:
    gallery: Gallery = request.app.state.gallery
    return gallery


async def get_keys(request: Request) -> KeyStore:
    keys: KeyStore = request.app.state.keys
    return keys


SettingsDep = Annotated[GatewaySettings, Depends(get_settings)]
ServiceDep = Annotated[Recognition, Depends(get_service)]
StoreDep = Annotated[GalleryStore, Depends(get_store)]
GalleryDep = Annotated[Gallery, Depends(get_gallery)]
KeysDep = Annotated[KeyStore, Depends(get_keys)]


async def lookup_key(keys: KeyStore, presented: str) -> Principal | None:
    """``keys.authenticate`` with no thread-pool hop for the admin key, a malformed key or a key already
    found valid (remembered): only a collection key seen for the first time queries the database."""
    if keys.is_admin(presented):
        return Principal(admin=True)
    if not keys.needs_lookup(presented):
        return None
    return keys.remembered(presented) or await run_in_threadpool(keys.authenticate, presented)


async def principal(
    request: Request,
    header: Annotated[str | None, Security(_api_key)] = None,
    bearer: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)] = None,
) -> Principal:
    """Any valid key (admin or collection): 401 without one."""
    presented = header or (bearer.credentials if bearer else None)
    if not presented:
        raise Unauthorized("an API key is required (X-API-Key header)")
    found = await lookup_key(request.app.state.keys, presented)
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


@dataclass(frozen=True)
class Admitted:
    """A recognition request with a valid key, inside the in-flight limit, and what its route needs."""

    caller: Principal
    service: Recognition
    settings: GatewaySettings


@contextmanager
def _admission(request: Request, caller: Principal) -> Iterator[Admitted]:
    state = request.app.state
    admission: Admission = state.admission
    with admission.slot():  # 503 overloaded beyond the limit
        yield Admitted(caller, state.faces, state.settings)


async def admitted(request: Request, caller: CallerDep) -> AsyncIterator[Admitted]:
    """Any valid key (401 without one), then admission (503 ``overloaded``)."""
    with _admission(request, caller) as call:
        yield call


async def admitted_collection(request: Request, collection: str, caller: CallerDep
                              ) -> AsyncIterator[Admitted]:
    """The admin or a key of this collection (401; 403 for another collection's key), then admission."""
    await collection_access(collection, caller)
    with _admission(request, caller) as call:
        yield call


AdmittedDep = Annotated[Admitted, Depends(admitted)]
AdmittedCollectionDep = Annotated[Admitted, Depends(admitted_collection)]


K_DESCRIPTION = "candidates per face, at most the max_k setting (FACEREC_LIMITS__MAX_K, default 100)"


async def top_k(request: Request, k: Annotated[int, Query(ge=1, description=K_DESCRIPTION)] = 5) -> int:
    """``k`` within the configured limit (a setting, so not a static bound of the schema)."""
    settings: GatewaySettings = request.app.state.settings
    limit = settings.limits.max_k
    if k > limit:
        error = {"loc": ["query", "k"], "msg": f"Input should be less than or equal to {limit}",
                 "type": "less_than_equal"}
        raise ApiError("the request is not valid", code="validation_error", status=422, errors=[error])
    return k


TopKDep = Annotated[int, Depends(top_k)]


def known_query(*allowed: str) -> Callable[[Request], Awaitable[None]]:
    """A dependency refusing query parameters a route does not know (422), instead of ignoring them."""
    names = set(allowed)

    async def check(request: Request) -> None:
        unknown = sorted(set(request.query_params) - names)
        if unknown:
            errors = [{"loc": ["query", name], "msg": "unknown query parameter", "type": "extra_forbidden"}
                      for name in unknown]
            raise ApiError(f"unknown query parameter(s): {', '.join(unknown)}; known: "
                           f"{', '.join(sorted(names))}", code="validation_error", status=422, errors=errors)

    return check
