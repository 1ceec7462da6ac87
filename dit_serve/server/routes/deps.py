"""The routes' dependencies. ``create_app`` puts the service's objects on ``app.state`` (each app its
own: several apps in one process, as in the tests, stay apart); these read them back for a route that
declares ``store: StoreDep`` and the like. ``authorize`` checks the API key: every /v1 router depends
on it (``v1_router``), and a route that needs the caller's tenant declares ``who: Caller`` as well
(FastAPI runs it once per request).

The readers are ``async``: a plain ``def`` dependency would cost a thread-pool hop per request for an
attribute read. So is ``authorize``: it takes the hop only when its answer needs a store read (a tenant
key's first check, or every ``cache_s``)."""

from __future__ import annotations

from typing import Annotated, Callable

from fastapi import APIRouter, Depends, Request, Security
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from dit_serve.server.catalog import Catalog, RequestError
from dit_serve.server.config import LimitsConfig, ServerConfig
from dit_serve.server.events import Streams
from dit_serve.server.keys import AuthError, KeyRing, Principal
from dit_serve.server.loras import LoraPolicy
from dit_serve.server.metrics import Metrics
from dit_serve.server.routes.admission import Admission
from dit_serve.server.store import Store

_bearer = HTTPBearer(auto_error=False, description="one of the server's API keys, when it has any")


async def _store(request: Request) -> Store:
    return request.app.state.store


async def _catalog(request: Request) -> Catalog:
    return request.app.state.catalog


async def _limits(request: Request) -> LimitsConfig:
    return request.app.state.catalog.limits


async def _server(request: Request) -> ServerConfig:
    return request.app.state.server


async def _metrics(request: Request) -> Metrics:
    return request.app.state.metrics


async def _admission(request: Request) -> Admission:
    return request.app.state.admission


async def _lora_policy(request: Request) -> LoraPolicy:
    return request.app.state.lora_policy


async def _streams(request: Request) -> Streams:
    return request.app.state.event_streams


async def _workers_ready(request: Request) -> Callable[[], int | None]:
    return request.app.state.workers_ready


async def _ring(request: Request) -> KeyRing:
    return request.app.state.key_ring


async def authorize(ring: Annotated[KeyRing, Depends(_ring)],
                    cred: HTTPAuthorizationCredentials | None = Security(_bearer)) -> Principal:
    """Every /v1 route, when the service has API keys (health and metrics stay open, for probes). On the
    event loop when the answer needs no store read (no keys, a configured key, an answer cached), else
    in the thread pool."""
    token = None if cred is None else cred.credentials
    try:
        who = ring.answer_now(token)
        return who if who is not None else await run_in_threadpool(ring.authenticate, token)
    except AuthError as e:
        raise RequestError(str(e), status=401) from None


StoreDep = Annotated[Store, Depends(_store)]
CatalogDep = Annotated[Catalog, Depends(_catalog)]
LimitsDep = Annotated[LimitsConfig, Depends(_limits)]
ServerDep = Annotated[ServerConfig, Depends(_server)]
MetricsDep = Annotated[Metrics, Depends(_metrics)]
AdmissionDep = Annotated[Admission, Depends(_admission)]
StreamsDep = Annotated[Streams, Depends(_streams)]
LoraPolicyDep = Annotated[LoraPolicy, Depends(_lora_policy)]
WorkersReadyDep = Annotated[Callable[[], int | None], Depends(_workers_ready)]
Caller = Annotated[Principal, Depends(authorize)]


def v1_router(tag: str) -> APIRouter:
    """A router under /v1 whose every route needs a key (``authorize``), its routes tagged ``tag``."""
    return APIRouter(prefix="/v1", tags=[tag], dependencies=[Security(authorize)])
