"""The HTTP API (FastAPI): jobs, images, an OpenAI-compatible images endpoint, models, health and
Prometheus metrics. ``create_app`` builds it from a store, a catalog and metrics; it runs no
models itself, so several API processes can serve one PostgreSQL store.

Every error body is ``{"error": {"message", "type", "param", "code"}}`` (OpenAI's shape). Requests
are validated completely before anything is stored: a 4xx leaves no trace in the store.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import time
import zipfile
from tempfile import SpooledTemporaryFile
from typing import Callable

from fastapi import APIRouter, FastAPI, Header, Query, Request, Security
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException

from dit_serve import __version__
from dit_serve.catalog import Catalog, NewJob, RequestError
from dit_serve.config import ServerConfig
from dit_serve.metrics import Metrics
from dit_serve.schemas import (ErrorResponse, Health, ImageData, ImageGenerationRequest, ImagesResponse, Job,
                               JobList, JobRequest, ModelList)
from dit_serve.store import IdempotencyConflict, Store, dump_manifest

ERRORS = {400: {"model": ErrorResponse}, 401: {"model": ErrorResponse}, 404: {"model": ErrorResponse}}
_bearer = HTTPBearer(auto_error=False, description="one of the server's API keys, when it has any")


def create_app(store: Store, catalog: Catalog, server: ServerConfig, metrics: Metrics,
               workers_ready: Callable[[], int | None] = lambda: None) -> FastAPI:
    app = FastAPI(title="dit-serve", version=__version__, responses=ERRORS,
                  description="Batch image generation with diffusion transformers.")
    _add_error_handlers(app)
    keys = [k.get_secret_value().encode() for k in server.api_keys]

    def authorize(cred: HTTPAuthorizationCredentials | None = Security(_bearer)) -> None:
        """Every /v1 route, when the server has API keys (health and metrics stay open, for probes)."""
        if not keys:
            return
        if cred is None:
            raise RequestError("this service needs an API key: send 'Authorization: Bearer <key>'", status=401)
        given = cred.credentials.encode()
        if not sum(hmac.compare_digest(given, k) for k in keys):  # every key compared: constant time
            raise RequestError("invalid API key", status=401)

    v1 = APIRouter(prefix="/v1", dependencies=[Security(authorize)])

    def job_or_404(job_id: str, with_items: bool = True) -> Job:
        job = store.get_job(job_id, with_items)
        if job is None:
            raise RequestError(f"no job with id {job_id!r}", "job_id", status=404)
        return job

    def create(new: NewJob) -> Job:
        return store.get_job(store.create_job(new.model, new.params, new.labels, new.seeds, priority=new.priority))

    @v1.post("/jobs", status_code=202, response_model=Job, tags=["jobs"],
             responses={409: {"model": ErrorResponse, "description": "Idempotency-Key reused for another job"}})
    def submit_job(req: JobRequest, response: Response,
                   idempotency_key: str | None = Header(None, min_length=1, max_length=200, pattern=r"^[!-~]+$",
                                                        description="a retried submission with the same key "
                                                                    "gets the first one's job")) -> Job:
        """Queue a job; 202 once it is committed to the store."""
        new = catalog.resolve_job(req)
        try:
            job_id, created = store.submit(new.model, new.params, new.labels, new.seeds, idempotency_key, new.priority,
                                           new.webhook_url)
        except IdempotencyConflict as e:
            raise RequestError(str(e), "Idempotency-Key", status=409) from None
        response.headers["Location"] = f"/v1/jobs/{job_id}"
        if not created:
            response.headers["Idempotent-Replayed"] = "true"
        return store.get_job(job_id)

    @v1.get("/jobs/{job_id}", response_model=Job, tags=["jobs"])
    def get_job(job_id: str, items: bool = Query(True, description="include per-item progress")) -> Job:
        """State and per-item progress (each running item's current step)."""
        return job_or_404(job_id, items)

    @v1.get("/jobs", response_model=JobList, tags=["jobs"])
    def list_jobs(limit: int = Query(20, ge=1, le=100), offset: int = Query(0, ge=0)) -> JobList:
        """Jobs, newest first, without their items."""
        jobs, total = store.list_jobs(limit, offset)
        return JobList(data=jobs, total=total, next_offset=offset + limit if offset + limit < total else None)

    @v1.delete("/jobs/{job_id}", response_model=Job, tags=["jobs"])
    def cancel_job(job_id: str, purge: bool = Query(False, description="also delete the job and its images "
                                                                       "(answers with the job as it was)")) -> Job:
        """Queued items never run; running ones stop at their next step boundary. Finished items stay,
        unless ``purge``: then the job's record and images are deleted too."""
        if not store.cancel_job(job_id):
            job_or_404(job_id)
        job = job_or_404(job_id)
        if purge and not store.delete_job(job_id):
            job_or_404(job_id)  # deleted meanwhile by another request: 404
            raise RequestError(f"job {job_id} still has running items", status=409)
        return job

    @v1.get("/jobs/{job_id}/images/{index}", response_class=FileResponse, tags=["jobs"],
             responses={200: {"content": {"image/png": {}}}, 409: {"model": ErrorResponse}})
    def get_image(job_id: str, index: int):
        path = store.image_path(job_id, index)
        if path is None:
            job = job_or_404(job_id)
            if not 0 <= index < job.num_items:
                raise RequestError(f"job {job_id} has {job.num_items} images (0..{job.num_items - 1}), "
                                   f"not {index}", "index", status=404)
            state = job.items[index].state
            raise RequestError(f"image {index} of job {job_id} is not ready (item state: {state})", "index",
                               status=409)
        return FileResponse(path, media_type="image/png")

    @v1.get("/jobs/{job_id}/archive", tags=["jobs"], responses={200: {"content": {"application/zip": {}}}})
    def get_archive(job_id: str):
        """A zip of the finished images and a manifest.json describing every item."""
        job = job_or_404(job_id)
        return StreamingResponse(_zip(store, job), media_type="application/zip",
                                 headers={"Content-Disposition": f'attachment; filename="{job_id}.zip"'})

    @v1.post("/images/generations", response_model=ImagesResponse, response_model_exclude_none=True,
              tags=["openai"])
    async def generate_images(req: ImageGenerationRequest, request: Request) -> ImagesResponse:
        """OpenAI-compatible: runs a job of ``n`` images of the class the prompt names and waits for it."""
        job = await run_in_threadpool(create, catalog.resolve_images(req))
        job = await _wait(store, job.id, catalog.limits.generation_timeout_s)
        base = (server.public_url or str(request.base_url)).rstrip("/")
        data = [await run_in_threadpool(_image_data, store, job, i, req.response_format, base)
                for i in range(job.num_items)]
        return ImagesResponse(created=int(job.created_at), data=data)

    @v1.get("/models", response_model=ModelList, tags=["models"])
    def list_models() -> ModelList:
        return ModelList(data=[m.card() for m in catalog.models.values()])

    app.include_router(v1)

    @app.get("/healthz", response_model=Health, tags=["service"])
    def health():
        try:
            depth = store.counts().get("queued", 0)
        except Exception as e:
            return JSONResponse({"status": "degraded", "queue_depth": -1, "detail": str(e)[:200]}, status_code=503)
        return Health(status="ok", queue_depth=depth, workers=workers_ready())

    @app.get("/metrics", tags=["service"], response_class=Response)
    def prometheus() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        metrics.queue_depth.set(store.counts().get("queued", 0))
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


async def _wait(store: Store, job_id: str, timeout_s: float) -> Job:
    """Poll the store until the job is finished; cancel it and answer 504 after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        job = await run_in_threadpool(store.get_job, job_id, True)
        if job.state == "done":
            return job
        if job.finished:
            errors = {it.error for it in job.items if it.error} or {f"job {job.state}"}
            raise RequestError(f"generation failed: {'; '.join(sorted(errors))}", status=500)
        if time.monotonic() > deadline:
            await run_in_threadpool(store.cancel_job, job_id)
            raise RequestError(f"generation did not finish within {timeout_s:.0f} s (job {job_id} cancelled)",
                               status=504)
        await asyncio.sleep(0.05)


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


def _error(status: int, message: str, param: str | None = None, kind: str | None = None) -> JSONResponse:
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}},
                        status_code=status)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def request_error(_request, e: RequestError):
        if e.status == 401:
            response = _error(401, e.message, kind="authentication_error")
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        kind = "not_found" if e.status == 404 else None
        return _error(e.status, e.message, e.param, kind)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request, e: RequestValidationError):
        errors = e.errors()
        message, param = _describe(errors[0])
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
        return _error(400, message, param)

    @app.exception_handler(HTTPException)
    async def http_error(_request, e: HTTPException):
        return _error(e.status_code, str(e.detail), kind="not_found" if e.status_code == 404 else None)


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
