"""The HTTP API (FastAPI): jobs, images, an OpenAI-compatible images endpoint, models, health and
Prometheus metrics. ``create_app`` builds it from a store, a catalog and metrics; it runs no
models itself, so several API processes can serve one PostgreSQL store.

Every error body is ``{"error": {"message", "type", "param", "code"}}`` (OpenAI's shape), and every
status a route can answer is in the OpenAPI schema. Requests are validated completely before anything
is stored: a 4xx leaves no trace in the store. Callers are tenants (``dit_serve.server.keys``): each sees and
acts on its own jobs only, and a job that another tenant owns is a 404.
"""

from __future__ import annotations

import asyncio
import base64
import math
import time
import zipfile
from tempfile import SpooledTemporaryFile
import logging
from typing import Callable

from fastapi import APIRouter, Depends, FastAPI, Header, Path, Query, Request, Security
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException

from dit_serve import __version__
from dit_serve.server import web
from dit_serve.server.catalog import Catalog, NewJob, RequestError, model_entry
from dit_serve.server.config import LimitsConfig, ServerConfig
from dit_serve.server.events import Cursor, EventResponse, JobEvents, StreamLimits, Streams
from dit_serve.server.keys import AuthError, KeyRing, Principal
from dit_serve.server.metrics import Metrics
from dit_serve.server.netguard import check_webhook_url
from dit_serve.schemas import (MAX_ITEMS, ErrorResponse, Health, ImageData, ImageGenerationRequest, ImagesResponse,
                               Job, JobList, JobRequest, ModelCard, ModelList, clip)
from dit_serve.server.store import IdempotencyConflict, QueueFull, Store, dump_manifest


def _doc(*statuses: int) -> dict:
    return {s: {"model": ErrorResponse, "description": DESCRIPTIONS[s]} for s in statuses}


DESCRIPTIONS = {400: "Bad request: the message names the field", 401: "Missing or invalid API key",
                403: "Not allowed for this tenant", 404: "No such job, image or model (or another tenant's)",
                405: "Method not allowed (see the Allow header)", 408: "The request body did not arrive in time",
                409: "Conflict", 413: "Request body too large", 429: "Too many queued items: retry after Retry-After "
                "seconds", 500: "Internal error, or the generation failed", 503: "Not ready",
                504: "The generation did not finish in time"}
ERRORS = _doc(400, 401, 405, 408, 413, 500)
MAX_OFFSET = 10**12
log = logging.getLogger(__name__)
_bearer = HTTPBearer(auto_error=False, description="one of the server's API keys, when it has any")
JobId = Path(min_length=1, max_length=64, pattern=r"^[0-9a-zA-Z_-]+$", description="a job id")


EVENTS_DOC = {"description": "Server-Sent Events: `progress`, `item` (once per item ending), `end`, then the "
                             "stream closes; a reconnect with Last-Event-ID resumes (docs/service.md, Events)",
              "content": {"text/event-stream": {"schema": {"type": "string"}}}}


def create_app(store: Store, catalog: Catalog, server: ServerConfig, metrics: Metrics,
               workers_ready: Callable[[], int | None] = lambda: None, allow_hosts: tuple[str, ...] = (),
               stream_limits: StreamLimits = StreamLimits()) -> FastAPI:
    from dit_serve.server.http_limits import LimitsMiddleware

    app = FastAPI(title="dit-serve", version=__version__, responses=ERRORS,
                  description="Batch image generation with diffusion transformers.")
    _add_error_handlers(app)
    app.add_middleware(LimitsMiddleware, max_body_bytes=server.max_body_bytes, read_timeout_s=server.read_timeout_s)
    ring = KeyRing(store, [k.get_secret_value() for k in server.api_keys])
    limits = catalog.limits
    pace = _Pace(store)
    app.state.event_streams = streams = Streams(stream_limits)

    def authorize(cred: HTTPAuthorizationCredentials | None = Security(_bearer)) -> Principal:
        """Every /v1 route, when the service has API keys (health and metrics stay open, for probes)."""
        try:
            return ring.authenticate(None if cred is None else cred.credentials)
        except AuthError as e:
            raise RequestError(str(e), status=401) from None

    v1 = APIRouter(prefix="/v1", dependencies=[Security(authorize)])

    def job_or_404(job_id: str, who: Principal, with_items: bool = True) -> Job:
        job = store.get_job(job_id, with_items, tenant=who.scope)
        if job is None:
            raise RequestError(f"no job with id {clip(job_id, 64)!r}", "job_id", status=404)
        return job

    def store_job(new: NewJob, who: Principal, idempotency_key: str | None = None) -> tuple[str, bool]:
        """Check the caller's limits and store the job; the one place submissions are committed."""
        if new.webhook_url is not None and (why := check_webhook_url(new.webhook_url, allow_hosts)) is not None:
            raise RequestError(why, "webhook_url")
        top = limits.tenant_max_priority if who.max_priority is None else who.max_priority
        if not who.admin and new.priority > top:
            raise RequestError(f"priority {new.priority} is above your tenant's highest, {top}", "priority",
                               status=403)
        tenant_bound = None if who.admin else (who.max_queued or limits.tenant_max_queued_items)
        try:
            return store.submit(new.model, new.params, new.labels, new.seeds, idempotency_key, new.priority,
                                new.webhook_url, tenant=who.tenant, max_active=limits.max_queued_items,
                                tenant_max_active=tenant_bound, prompts=new.prompts)
        except IdempotencyConflict as e:
            raise RequestError(str(e), "Idempotency-Key", status=409) from None
        except QueueFull as e:
            if e.never:
                raise RequestError(str(e), "labels") from None
            metrics.rejected.inc()
            raise RequestError(str(e), status=429, retry_after=pace.retry_after(len(new.labels))) from None

    @v1.post("/jobs", status_code=202, response_model=Job, tags=["jobs"],
             responses=_doc(403, 409, 429))
    def submit_job(req: JobRequest, response: Response, who: Principal = Depends(authorize),
                   idempotency_key: str | None = Header(None, min_length=1, max_length=200, pattern=r"^[!-~]+$",
                                                        description="a retried submission with the same key "
                                                                    "gets the first one's job")) -> Job:
        """Queue a job; 202 once it is committed to the store (429 with Retry-After when the queue is full)."""
        new = catalog.resolve_job(req)
        job_id, created = store_job(new, who, idempotency_key)
        response.headers["Location"] = f"/v1/jobs/{job_id}"
        if not created:
            response.headers["Idempotent-Replayed"] = "true"
        return store.get_job(job_id)

    @v1.get("/jobs/{job_id}", response_model=Job, tags=["jobs"], responses=_doc(404))
    def get_job(job_id: str = JobId, items: bool = Query(True, description="include per-item progress"),
                who: Principal = Depends(authorize)) -> Job:
        """State and per-item progress (each running item's current step)."""
        return job_or_404(job_id, who, items)

    @v1.get("/jobs/{job_id}/events", status_code=200, response_class=EventResponse, tags=["jobs"],
            responses={200: EVENTS_DOC, **_doc(404, 429)})
    async def job_events(job_id: str = JobId, who: Principal = Depends(authorize),
                         last_event_id: str | None = Header(None, max_length=100, description="resume: the id of "
                                                            "the last event received")) -> EventResponse:
        """The job's events as they happen (Server-Sent Events), ending with ``end``. With ``Last-Event-ID``,
        the items that ended since that event come first, and none sent before. 429 (Retry-After) past
        the open streams allowed: poll ``GET /v1/jobs/{id}`` instead."""
        try:
            cursor = Cursor.parse(last_event_id)
        except ValueError as e:
            raise RequestError(str(e), "Last-Event-ID") from None
        job = await run_in_threadpool(job_or_404, job_id, who, False)
        if (why := streams.acquire(who.tenant)) is not None:
            raise RequestError(why, status=429, retry_after=stream_limits.retry_after_s)
        return EventResponse(JobEvents(store, job, cursor, streams).stream(), lambda: streams.release(who.tenant))

    @v1.get("/jobs", response_model=JobList, tags=["jobs"])
    def list_jobs(limit: int = Query(20, ge=1, le=100), offset: int = Query(0, ge=0, le=MAX_OFFSET),
                  who: Principal = Depends(authorize)) -> JobList:
        """Your jobs (every tenant's for an admin key), newest first, without their items."""
        jobs, total = store.list_jobs(limit, offset, tenant=who.scope)
        return JobList(data=jobs, total=total, next_offset=offset + limit if offset + limit < total else None)

    @v1.delete("/jobs/{job_id}", response_model=Job, tags=["jobs"], responses=_doc(404, 409))
    def cancel_job(job_id: str = JobId, who: Principal = Depends(authorize),
                   purge: bool = Query(False, description="also delete the job and its images "
                                                          "(answers with the job as it was)")) -> Job:
        """Queued items never run; running ones stop at their next step boundary. Finished items stay,
        unless ``purge``: then the job's record and images are deleted too."""
        if not store.cancel_job(job_id, tenant=who.scope):
            job_or_404(job_id, who)
        job = job_or_404(job_id, who)
        if purge and not store.delete_job(job_id, tenant=who.scope):
            job_or_404(job_id, who)  # deleted meanwhile by another request: 404
            raise RequestError(f"job {job_id} still has running items", status=409)
        return job

    @v1.post("/jobs/{job_id}/retry", response_model=Job, tags=["jobs"], responses=_doc(404))
    def retry_job(job_id: str = JobId, who: Principal = Depends(authorize)) -> Job:
        """Queue the job's failed items again (their failure counters reset); the others are untouched."""
        if store.retry_failed(job_id, tenant=who.scope) is None:
            job_or_404(job_id, who)
        return job_or_404(job_id, who)

    @v1.get("/jobs/{job_id}/images/{index}", response_class=FileResponse, tags=["jobs"],
            responses={200: {"content": {"image/png": {}}}, **_doc(404, 409)})
    def get_image(job_id: str = JobId, index: int = Path(ge=0, le=MAX_ITEMS), who: Principal = Depends(authorize)):
        path = store.image_path(job_id, index, tenant=who.scope)
        if path is None:
            job = job_or_404(job_id, who)
            if not 0 <= index < job.num_items:
                raise RequestError(f"job {job_id} has {job.num_items} images (0..{job.num_items - 1}), "
                                   f"not {index}", "index", status=404)
            state = job.items[index].state
            raise RequestError(f"image {index} of job {job_id} is not ready (item state: {state})", "index",
                               status=409)
        return FileResponse(path, media_type="image/png")

    @v1.get("/jobs/{job_id}/items/{index}/preview", response_class=Response, tags=["jobs"],
            responses={200: {"content": {"image/png": {}}}, **_doc(404)})
    def get_preview(job_id: str = JobId, index: int = Path(ge=0, le=MAX_ITEMS), who: Principal = Depends(authorize)):
        """The latest preview of a running item of a job with ``preview_every`` (a small PNG of its denoised
        estimate); 404 when it has none (not started, ended, or no previews asked)."""
        found = store.preview(job_id, index, tenant=who.scope)
        if found is None:
            job_or_404(job_id, who, with_items=False)
            raise RequestError(f"item {index} of job {job_id} has no preview now (previews exist while an item "
                               "runs, for jobs submitted with preview_every)", "index", status=404)
        step, png = found
        return Response(png, media_type="image/png", headers={"Cache-Control": "no-store", "X-Preview-Step": str(step)})

    @v1.get("/jobs/{job_id}/archive", tags=["jobs"],
            responses={200: {"content": {"application/zip": {}}}, **_doc(404)})
    def get_archive(job_id: str = JobId, who: Principal = Depends(authorize)):
        """A zip of the finished images and a manifest.json describing every item."""
        job = job_or_404(job_id, who)
        return StreamingResponse(_zip(store, job), media_type="application/zip",
                                 headers={"Content-Disposition": f'attachment; filename="{job_id}.zip"'})

    @v1.post("/images/generations", response_model=ImagesResponse, response_model_exclude_none=True,
             tags=["openai"], responses=_doc(403, 429, 504))
    async def generate_images(req: ImageGenerationRequest, request: Request,
                              who: Principal = Depends(authorize)) -> Response | ImagesResponse:
        """OpenAI-compatible: runs a job of ``n`` images of the class the prompt names and waits for it.
        A client that hangs up before it finishes gets its job cancelled (``[server] cancel_on_disconnect``)."""
        new = catalog.resolve_images(req)
        job_id, _ = await run_in_threadpool(store_job, new, who)
        job = await _wait(store, job_id, limits, request, server.cancel_on_disconnect)
        if job is None:  # the client went away
            return Response(status_code=499)
        base = (server.public_url or str(request.base_url)).rstrip("/")
        data = [await run_in_threadpool(_image_data, store, job, i, req.response_format, base)
                for i in range(job.num_items)]
        return ImagesResponse(created=int(job.created_at), data=data)

    @v1.get("/models", response_model=ModelList, tags=["models"])
    def list_models() -> ModelList:
        return ModelList(data=[model_entry(m) for m in catalog.models.values()])

    @v1.get("/models/{model_id:path}", response_model=ModelCard, tags=["models"], responses=_doc(404))
    def get_model(model_id: str = Path(max_length=200)) -> ModelCard:
        if model_id not in catalog.models:
            raise RequestError(f"no model {clip(model_id, 80)!r}; this service serves: "
                               f"{', '.join(catalog.models)}", "model", status=404)
        return model_entry(catalog.models[model_id])

    app.include_router(v1)
    app.include_router(web.router)  # the page at / and its assets: no key (it holds no data; it calls /v1 with one)

    @app.get("/healthz", response_model=Health, tags=["service"], responses=_doc(503))
    def health():
        try:
            counts = store.counts()
        except Exception as e:
            return JSONResponse({"status": "degraded", "queue_depth": -1, "detail": str(e)[:200]}, status_code=503)
        return Health(status="ok", queue_depth=counts.get("queued", 0), running=counts.get("running", 0),
                      workers=workers_ready())

    @app.get("/metrics", tags=["service"], response_class=Response)
    def prometheus() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        metrics.queue_depth.set(store.counts().get("queued", 0))
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.state.all_routes = [r for r in (*v1.routes, *web.router.routes, *app.router.routes) if hasattr(r, "path_regex")]
    return app


class _Pace:
    """Retry-After for a full queue: how long the service needs to finish as many items as a rejected
    job has, at the rate it finished items in the last minute (read at most every 5 s), within 1-300 s."""

    def __init__(self, store: Store):
        self.store, self._rate, self._read = store, 0.0, -1e9

    def retry_after(self, n: int) -> int:
        now = time.monotonic()
        if now - self._read > 5.0:
            self._rate, self._read = self.store.recent_rate(), now
        return 30 if self._rate <= 0 else max(1, min(300, math.ceil(n / self._rate)))


async def _wait(store: Store, job_id: str, limits: LimitsConfig, request: Request, cancel_on_disconnect: bool
                ) -> Job | None:
    """Wait until the job ends: woken by the store's notifications in this process, else a slow poll of
    one count query; checks for a client that went away every 0.25 s (its job is cancelled, None
    returned). Cancels the job and answers 504 after ``generation_timeout_s``."""
    deadline = time.monotonic() + limits.generation_timeout_s
    event = store.changes.watch(job_id)
    try:
        last_poll = 0.0
        while True:
            now = time.monotonic()
            if event.is_set() or now - last_poll >= 1.0:
                event.clear()
                last_poll = now
                if await run_in_threadpool(store.active_items, job_id) == 0:
                    break
            if cancel_on_disconnect and await request.is_disconnected():
                await run_in_threadpool(store.cancel_job, job_id)
                return None
            if now > deadline:
                await run_in_threadpool(store.cancel_job, job_id)
                raise RequestError(f"generation did not finish within {limits.generation_timeout_s:.0f} s "
                                   f"(job {job_id} cancelled)", status=504)
            try:
                await asyncio.wait_for(event.wait(), 0.25)
            except asyncio.TimeoutError:
                pass
    finally:
        store.changes.unwatch(job_id, event)
    job = await run_in_threadpool(store.get_job, job_id, True)
    if job.state != "done":
        errors = {it.error for it in job.items if it.error} or {f"job {job.state}"}
        raise RequestError(f"generation failed: {'; '.join(sorted(errors))}", status=500)
    return job


def _image_data(store: Store, job: Job, index: int, fmt: str, base: str) -> ImageData:
    if fmt == "url":
        return ImageData(url=f"{base}/v1/jobs/{job.id}/images/{index}")
    return ImageData(b64_json=base64.b64encode(store.image_path(job.id, index).read_bytes()).decode())


def _zip(store: Store, job: Job, chunk: int = 1 << 20):
    """Stream a zip built in a spooled temp file (in memory up to 64 MiB, then on disk)."""
    with SpooledTemporaryFile(max_size=64 << 20) as f:
        with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED) as z:  # PNGs are compressed already
            for it in job.items:
                path = store.image_path(job.id, it.index) if it.state == "done" else None
                if path is not None:
                    z.write(path, f"{it.index:05d}.png")
            z.writestr("manifest.json", dump_manifest(job))
        f.seek(0)
        while data := f.read(chunk):
            yield data


def _error(status: int, message: str, param: str | None = None, kind: str | None = None,
           headers: dict | None = None) -> JSONResponse:
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    return JSONResponse({"error": {"message": clip(message, 1000), "type": kind, "param": param and clip(param, 100),
                                   "code": None}}, status_code=status, headers=headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def request_error(_request, e: RequestError):
        if e.status == 401:
            response = _error(401, e.message, kind="authentication_error")
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        kind = {404: "not_found", 429: "rate_limit_error"}.get(e.status)
        headers = {"Retry-After": str(e.retry_after)} if e.retry_after is not None else None
        return _error(e.status, e.message, e.param, kind, headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request, e: RequestValidationError):
        errors = e.errors()
        message, param = _describe(errors[0])
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
        return _error(400, message, param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):  # routing errors: 404, and 405 with Allow
        headers = e.headers
        if e.status_code == 405:  # Starlette names only the first route's methods; RFC 9110 wants all
            headers = {**(headers or {}), "Allow": ", ".join(_allowed(request))}
        return _error(e.status_code, str(e.detail), kind="not_found" if e.status_code == 404 else None,
                      headers=headers)

    @app.exception_handler(Exception)
    async def internal_error(_request, e: Exception):  # a bug: logged, and still the usual error shape
        log.exception("unhandled error")
        return _error(500, f"internal error: {type(e).__name__}")


def _allowed(request: Request) -> list[str]:
    """The methods of every route whose path matches the request's (routes of included routers too)."""
    methods: set[str] = set()
    for route in request.app.state.all_routes:
        if route.path_regex.match(request.url.path):
            methods |= set(route.methods or ())
    return sorted(methods)


def _describe(err: dict) -> tuple[str, str | None]:
    """One pydantic error as a sentence a user can act on, and the field it is about."""
    loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path", "header")]
    where = ".".join(loc)
    kind = err.get("type", "")
    if kind == "json_invalid":
        return f"malformed JSON body: {err.get('ctx', {}).get('error', err['msg'])}", None
    if kind == "missing" and not loc:
        return "the request needs a JSON body", None
    if kind == "extra_forbidden":
        return f"unknown field {where!r}", where
    if kind == "model_attributes_type" and not loc:
        return "the request body must be a JSON object", None
    return (f"{where}: {err['msg']}" if where else err["msg"]), where or None
