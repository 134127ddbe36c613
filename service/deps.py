"""Dependency aliases: the routes ask for what they need; the lifespan put it on ``app.state``.

Each dependency FastAPI solves costs CPU on every request (FastAPI 0.16x classifies and caches every node of
the tree per request, a generator dependency enters an exit stack), so the routes that nearly every request
takes (identify, detect, verify, enroll) ask for one plain dependency: ``AdmittedDep`` /
``AdmittedCollectionDep`` check the key (and the collection) by calling the two security schemes rather than
solving them, and hand over the use cases, the settings and the in-flight limit, whose slot the route holds
around its work (``with call.slot():``, 503 ``overloaded`` beyond the limit). Their operations list the two
schemes in the OpenAPI document through ``KEY_SECURITY``. Eleven nodes became one on identify
(the gateway's own CPU per identify: docs/benchmarks/README.md).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Query, Request, Security
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from facecore.settings import GatewaySettings
from gallery.gallery import Gallery
from gallery.store.store import GalleryStore
from recognition.usecases import Recognition
from service.admission import Admission
from service.auth import KeyStore, Principal
from service.errors import ApiError, Forbidden, Unauthorized

_api_key = APIKeyHeader(name="X-API-Key", auto_error=False, description="admin or collection key")
_bearer = HTTPBearer(auto_error=False, description="the same key as a bearer token")
#: The OpenAPI security of an operation that takes ``AdmittedDep`` / ``AdmittedCollectionDep`` (either
#: scheme), as FastAPI writes it for a route that solves the two schemes as dependencies.
KEY_SECURITY: list[dict[str, list[str]]] = [{_api_key.scheme_name: []}, {_bearer.scheme_name: []}]


def _from_state(name: str) -> Callable[[Request], Awaitable[Any]]:
    """A dependency that hands over ``app.state.<name>``, which the lifespan set."""

    async def dependency(request: Request) -> Any:
        return getattr(request.app.state, name)

    return dependency


SettingsDep = Annotated[GatewaySettings, Depends(_from_state("settings"))]
ServiceDep = Annotated[Recognition, Depends(_from_state("recognition"))]
StoreDep = Annotated[GalleryStore, Depends(_from_state("store"))]
GalleryDep = Annotated[Gallery, Depends(_from_state("gallery"))]
KeysDep = Annotated[KeyStore, Depends(_from_state("keys"))]


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


async def _caller(request: Request) -> Principal:
    """``principal`` with the two schemes called here, as FastAPI would call them, instead of solved."""
    header = await _api_key(request)
    return await principal(request, header, None if header else await _bearer(request))


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
    """A recognition request with a valid key, and what its route needs; the route does its work inside
    ``slot()``."""

    caller: Principal
    service: Recognition
    settings: GatewaySettings
    admission: Admission

    def slot(self) -> AbstractContextManager[None]:
        """One of the gateway's in-flight recognition requests, for the block (503 ``overloaded`` beyond
        the limit)."""
        return self.admission.slot()


def _admitted(request: Request, caller: Principal) -> Admitted:
    state = request.app.state
    return Admitted(caller, state.recognition, state.settings, state.admission)


async def admitted(request: Request) -> Admitted:
    """Any valid key (401 without one)."""
    return _admitted(request, await _caller(request))


async def admitted_collection(request: Request, collection: str) -> Admitted:
    """The admin or a key of this collection (401; 403 for another collection's key)."""
    caller = await _caller(request)
    await collection_access(collection, caller)
    return _admitted(request, caller)


AdmittedDep = Annotated[Admitted, Depends(admitted)]
AdmittedCollectionDep = Annotated[Admitted, Depends(admitted_collection)]


K_DESCRIPTION = "candidates per face, at most the max_k setting (FACEREC_LIMITS__MAX_K, default 100)"


#: ``k`` as a query parameter (at least 1; at most the setting, which ``within_max_k`` checks).
TopK = Annotated[int, Query(ge=1, description=K_DESCRIPTION)]


def within_max_k(k: int, settings: GatewaySettings) -> int:
    """``k`` within the configured limit (a setting, so not a static bound of the schema); else 422."""
    limit = settings.limits.max_k
    if k > limit:
        error = {"loc": ["query", "k"], "msg": f"Input should be less than or equal to {limit}",
                 "type": "less_than_equal"}
        raise ApiError("the request is not valid", code="validation_error", status=422, errors=[error])
    return k


async def top_k(request: Request, k: TopK = 5) -> int:
    """``within_max_k`` as a dependency (the routes taking ``AdmittedCollectionDep`` call it themselves)."""
    return within_max_k(k, request.app.state.settings)


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
