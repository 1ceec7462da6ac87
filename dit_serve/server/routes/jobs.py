"""Jobs: submit, read, list, cancel (and purge), retry, and a job's images, previews, archive, events and an
edit's inputs. Callers are tenants (``dit_serve.server.keys``): each sees and acts on its own jobs only, and
a job that another tenant owns is a 404."""

from __future__ import annotations

import zipfile
from tempfile import SpooledTemporaryFile

from fastapi import Header, Path, Query, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, StreamingResponse

from dit_serve.schemas import INPUT_NAME, MAX_ITEMS, Job, JobList, JobRequest, clip, event_schema
from dit_serve.server.catalog import RequestError
from dit_serve.server.events import END_EVENT_ITEMS, Cursor, EventResponse, JobEvents
from dit_serve.server.inputs import JobInputs, format_of
from dit_serve.server.keys import Principal
from dit_serve.server.loras import resolve_loras
from dit_serve.server.routes import errors
from dit_serve.server.routes.deps import (AdmissionDep, Caller, CatalogDep, LoraPolicyDep, StoreDep, StreamsDep,
                                         v1_router)
from dit_serve.server.store import Store, dump_manifest

MAX_OFFSET = 10**12
JobId = Path(min_length=1, max_length=64, pattern=r"^[0-9a-zA-Z_-]+$", description="a job id")
IdempotencyKey = Header(None, alias="Idempotency-Key", min_length=1, max_length=200, pattern=r"^[!-~]+$",
                        description="a retried submission with the same key gets the first one's job")
# an id this service sends, as events.Cursor.parse reads it ("3.17" or "3.17.1520413.2"), or empty
EVENT_ID = r"^(?:\d{1,12}\.\d{1,15}(?:\.-?\d{1,18}\.\d{1,9})?)?$"
# a string, not nullable: a header has no null (a schema that allowed it had clients send "null")
LastEventId = Header("", alias="Last-Event-ID", max_length=100, pattern=EVENT_ID,
                     description="resume: the id of the last event received")
# Each event of the stream (itemSchema, OpenAPI 3.2's way to describe a stream's items) carries one JSON
# object in its `data`, a JobEvent by its `event` field (api.create_app adds the models to the components).
EVENTS_DOC = {"description": "Server-Sent Events: `progress`, `item` (once per item ending), `preview`, `end`, "
                             "then the stream closes; each event's data is a JSON object (itemSchema); a "
                             "reconnect with Last-Event-ID resumes (docs/service.md, Events)",
              "content": {"text/event-stream": {"itemSchema": {
                  "type": "object", "required": ["data"],
                  "properties": {"event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"},
                                 "data": {"type": "string", "contentMediaType": "application/json",
                                          "contentSchema": event_schema()["schema"]}}}}}}

router = v1_router("jobs")


def job_or_404(store: Store, job_id: str, who: Principal, with_items: bool = True) -> Job:
    job = store.get_job(job_id, with_items, tenant=who.scope)
    if job is None:
        raise RequestError(f"no job with id {clip(job_id, 64)!r}", "job_id", status=404)
    return job


@router.post("/jobs", status_code=202, response_model=Job, responses=errors(403, 409, 429))
def submit_job(req: JobRequest, store: StoreDep, catalog: CatalogDep, admission: AdmissionDep,
               lora_policy: LoraPolicyDep, who: Caller, idempotency_key: str | None = IdempotencyKey) -> Job:
    """Queue a job; 202 once it is committed to the store (429 with Retry-After when the queue is full).
    Edits send ``image`` (an upload's id or a data URL; or ``image_b64``; a list of them for a model's several
    reference images, GET /v1/models: max_images), ``mask`` and ``strength``; adapters
    ``loras`` ([{"name", "scale"}], GET /v1/loras)."""
    def upload(upload_id: str) -> bytes | None:
        found = store.get_upload(upload_id, tenant=who.scope, data=True)
        return None if found is None else found[1]

    inputs = JobInputs(req, upload, catalog.limits.max_inline_image_bytes)
    new = catalog.resolve_job(req, idempotency_key, inputs)
    new = resolve_loras(new, req.loras, store, who.scope, catalog.models[new.model], lora_policy)
    job_id, created, job = admission.submit(new, who, idempotency_key)
    headers = {"Location": f"/v1/jobs/{job_id}"} | ({} if created else {"Idempotent-Replayed": "true"})
    # a new job as written, not read back, and serialised here: this answer is on every image's path,
    # and the scheduler leasing the job meanwhile needs the interpreter that a re-validation would hold
    job = job or store.get_job(job_id)
    return Response(job.model_dump_json(), status_code=202, media_type="application/json", headers=headers)


@router.get("/jobs/{job_id}", response_model=Job, responses=errors(404))
def get_job(store: StoreDep, who: Caller, job_id: str = JobId,
            items: bool = Query(True, description="include per-item progress")) -> Job:
    """State and per-item progress (each running item's current step); ``waiting`` says why queued items wait
    while no worker serves the job's model (none started yet, or being started or switched to it)."""
    job = job_or_404(store, job_id, who, items)
    if job.counts.get("queued") and (note := store.waiting_note(job.model)) is not None:
        job = job.model_copy(update={"waiting": note})
    return job


@router.get("/jobs/{job_id}/events", status_code=200, response_class=EventResponse,
            responses={200: EVENTS_DOC, **errors(404, 429)})
async def job_events(store: StoreDep, streams: StreamsDep, who: Caller, job_id: str = JobId,
                     last_event_id: str = LastEventId) -> EventResponse:
    """The job's events as they happen (Server-Sent Events), ending with ``end``. With ``Last-Event-ID``,
    the items that ended since that event come first, and none sent before. 429 (Retry-After) past
    the open streams allowed: poll ``GET /v1/jobs/{id}`` instead."""
    try:
        cursor = Cursor.parse(last_event_id)
    except ValueError as e:
        raise RequestError(str(e), "Last-Event-ID") from None
    changed = store.changes.watch(job_id)  # before the read: a change after it wakes the stream

    def release() -> None:
        store.changes.unwatch(job_id, changed)
        streams.release(who.tenant)

    try:  # on the event loop when the stream's own reads will be (``Streams.reads_inline``)
        job = (_job_for_stream(store, job_id, who) if streams.reads_inline(store, opening=True)
               else await run_in_threadpool(_job_for_stream, store, job_id, who))
        if (why := streams.acquire(who.tenant)) is not None:
            raise RequestError(why, status=429, retry_after=streams.limits.retry_after_s)
    except BaseException:
        store.changes.unwatch(job_id, changed)
        raise
    return EventResponse(JobEvents(store, job, cursor, streams, changed).stream(), release)


def _job_for_stream(store: Store, job_id: str, who: Principal) -> Job:
    """The job (404 if none), with its items when it is small: the stream's first read (``JobEvents``)."""
    job = store.get_job(job_id, tenant=who.scope, items_up_to=END_EVENT_ITEMS)
    if job is None:
        raise RequestError(f"no job with id {clip(job_id, 64)!r}", "job_id", status=404)
    return job


@router.get("/jobs", response_model=JobList)
def list_jobs(store: StoreDep, who: Caller, limit: int = Query(20, ge=1, le=100),
              offset: int = Query(0, ge=0, le=MAX_OFFSET)) -> JobList:
    """Your jobs (every tenant's for an admin key), newest first, without their items."""
    jobs, total = store.list_jobs(limit, offset, tenant=who.scope)
    return JobList(data=jobs, total=total, next_offset=offset + limit if offset + limit < total else None)


@router.delete("/jobs/{job_id}", response_model=Job, responses=errors(404, 409))
def cancel_job(store: StoreDep, who: Caller, job_id: str = JobId,
               purge: bool = Query(False, description="also delete the job and its images "
                                                      "(answers with the job as it was)")) -> Job:
    """Queued items never run; running ones stop at their next step boundary. Finished items stay,
    unless ``purge``: then the job's record and images are deleted too."""
    if not store.cancel_job(job_id, tenant=who.scope):
        job_or_404(store, job_id, who)
    job = job_or_404(store, job_id, who)
    if purge and not store.delete_job(job_id, tenant=who.scope):
        job_or_404(store, job_id, who)  # deleted meanwhile by another request: 404
        raise RequestError(f"job {job_id} still has running items", status=409)
    return job


@router.post("/jobs/{job_id}/retry", response_model=Job, responses=errors(404))
def retry_job(store: StoreDep, who: Caller, job_id: str = JobId) -> Job:
    """Queue the job's failed items again (their failure counters reset); the others are untouched."""
    if store.retry_failed(job_id, tenant=who.scope) is None:
        job_or_404(store, job_id, who)
    return job_or_404(store, job_id, who)


@router.get("/jobs/{job_id}/images/{index}", response_class=FileResponse,
            responses={200: {"content": {"image/png": {}}}, **errors(404, 409, 410)})
def get_image(store: StoreDep, who: Caller, job_id: str = JobId, index: int = Path(ge=0, le=MAX_ITEMS)):
    path = store.image_path(job_id, index, tenant=who.scope)
    if path is None:
        job = job_or_404(store, job_id, who)
        if not 0 <= index < job.num_items:
            raise RequestError(f"job {job_id} has {job.num_items} images (0..{job.num_items - 1}), "
                               f"not {index}", "index", status=404)
        raise _no_image(job, index)
    return FileResponse(path, media_type="image/png")


def _no_image(job: Job, index: int) -> RequestError:
    """Why item ``index`` has no image: 409 while it may still come (queued, running); 410 once it cannot
    without a retry (failed: with its reason) or at all (cancelled)."""
    item = job.items[index]
    where = f"image {index} of job {job.id}"
    if item.state == "failed":
        return RequestError(f"{where} failed: {clip(item.error or 'no reason recorded', 600)} (POST "
                            f"/v1/jobs/{job.id}/retry queues the job's failed items again)", "index", status=410)
    if item.state == "cancelled":
        return RequestError(f"{where} was cancelled before it was made", "index", status=410)
    return RequestError(f"{where} is not ready yet ({item.state}, step {item.step} of {item.total_steps})", "index",
                        status=409)


@router.get("/jobs/{job_id}/inputs/{name}", response_class=Response,
            responses={200: {"content": {"image/png": {}, "image/jpeg": {}, "image/webp": {}}}, **errors(404)})
def get_input(store: StoreDep, who: Caller, job_id: str = JobId,
              name: str = Path(pattern=INPUT_NAME, description="image, image2, image3, ... or mask")):
    """An edit's input image or mask, as the job stored it (``params.image``, ``params.mask``: its SHA-256); an
    instruction edit's further references as image2, image3, ... (``params.extra_images``)."""
    job_or_404(store, job_id, who, with_items=False)
    data = store.job_input(job_id, name)
    if data is None:
        raise RequestError(f"job {job_id} has no input {name}", "name", status=404)
    return Response(data, media_type=f"image/{format_of(data).lower()}",
                    headers={"Cache-Control": "private, max-age=86400", "X-Content-Type-Options": "nosniff",
                             "Content-Security-Policy": "default-src 'none'"})


@router.get("/jobs/{job_id}/items/{index}/preview", response_class=Response,
            responses={200: {"content": {"image/png": {}}}, **errors(404)})
def get_preview(store: StoreDep, who: Caller, job_id: str = JobId, index: int = Path(ge=0, le=MAX_ITEMS)):
    """The latest preview of a running item of a job with ``preview_every`` (a small PNG of its denoised
    estimate); 404 when it has none (not started, ended, or no previews asked)."""
    found = store.preview(job_id, index, tenant=who.scope)
    if found is None:
        job_or_404(store, job_id, who, with_items=False)
        raise RequestError(f"item {index} of job {job_id} has no preview now (previews exist while an item "
                           "runs, for jobs submitted with preview_every)", "index", status=404)
    step, png = found
    return Response(png, media_type="image/png", headers={"Cache-Control": "no-store", "X-Preview-Step": str(step)})


@router.get("/jobs/{job_id}/archive", responses={200: {"content": {"application/zip": {}}}, **errors(404)})
def get_archive(store: StoreDep, who: Caller, job_id: str = JobId):
    """A zip of the finished images and a manifest.json describing every item."""
    job = job_or_404(store, job_id, who)
    return StreamingResponse(_zip(store, job), media_type="application/zip",
                             headers={"Content-Disposition": f'attachment; filename="{job_id}.zip"'})


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
