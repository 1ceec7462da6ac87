"""OpenAI-compatible images: ``POST /v1/images/generations`` and ``POST /v1/images/edits`` (multipart/form-data:
an image, a mask whose transparent area is repainted) run a job and answer when it ends.

The wait is woken by the store's change notifications (``Store.changes``: in-process, and from other
processes through PostgreSQL's NOTIFY), so a finished image is handed over at once; one count query a
second covers a lost notification. It wakes every 0.25 s to see whether the client went away."""

from __future__ import annotations

import asyncio
import base64
import time

from fastapi import Request, Response
from fastapi.concurrency import run_in_threadpool

from dit_serve.schemas import ImageData, ImageEditRequest, ImageGenerationRequest, ImagesResponse, Job
from dit_serve.server.catalog import RequestError
from dit_serve.server.config import LimitsConfig
from dit_serve.server.inputs import Input, check_size, mask_from_alpha
from dit_serve.server.loras import resolve_loras
from dit_serve.server.routes import errors, form_body
from dit_serve.server.routes.forms import one_file, read_form, validate_fields
from dit_serve.server.routes.deps import (AdmissionDep, Caller, CatalogDep, LimitsDep, LoraPolicyDep, ServerDep,
                                         StoreDep, v1_router)
from dit_serve.server.store import Store

router = v1_router("openai")


@router.post("/images/generations", response_model=ImagesResponse, response_model_exclude_none=True,
             responses=errors(403, 429, 504))
async def generate_images(req: ImageGenerationRequest, request: Request, store: StoreDep, catalog: CatalogDep,
                          admission: AdmissionDep, limits: LimitsDep, server: ServerDep,
                          lora_policy: LoraPolicyDep, who: Caller) -> Response | ImagesResponse:
    """OpenAI-compatible: runs a job of ``n`` images of the class the prompt names and waits for it.
    A client that hangs up before it finishes gets its job cancelled (``[server] cancel_on_disconnect``)."""
    new = catalog.resolve_images(req)
    new = await run_in_threadpool(resolve_loras, new, req.loras, store, who.scope, catalog.models[new.model],
                                  lora_policy)
    job_id, _, _ = await run_in_threadpool(admission.submit, new, who)
    job = await _wait(store, job_id, limits, request, server.cancel_on_disconnect)
    if job is None:  # the client went away
        return Response(status_code=499)
    base = (server.public_url or str(request.base_url)).rstrip("/")
    data = [await run_in_threadpool(_image_data, store, job, i, req.response_format, base)
            for i in range(job.num_items)]
    return ImagesResponse(created=int(job.created_at), data=data)


EDIT_FORM = form_body(ImageEditRequest.model_json_schema(), ["image", "prompt"], {
    "image": "the image to edit: a PNG, JPEG or WebP file; several (OpenAI's SDK sends them as image[]) for a model "
             "that takes several reference images, in order, at most its max_images (GET /v1/models; "
             "Qwen-Image-Edit-Plus: 3)",
    "mask": "where to edit: an image of the input's size whose fully transparent pixels are repainted "
            "(OpenAI's rule), for models that inpaint; without it the whole image is varied (image-to-image)"})
EDIT_FORM["requestBody"]["content"]["multipart/form-data"]["schema"]["properties"]["loras"] = {
    "type": "string", "contentMediaType": "application/json",
    "description": "adapters, as for jobs: the list as JSON text, [{\"name\": ..., \"scale\": 0.8}]"}


@router.post("/images/edits", response_model=ImagesResponse, response_model_exclude_none=True,
             responses=errors(403, 429, 504), openapi_extra=EDIT_FORM)
async def edit_images(request: Request, store: StoreDep, catalog: CatalogDep, admission: AdmissionDep,
                      limits: LimitsDep, server: ServerDep, lora_policy: LoraPolicyDep,
                      who: Caller) -> Response | ImagesResponse:
    """OpenAI-compatible image edits (multipart/form-data): ``n`` images made from ``image``, inpainted where the
    ``mask`` is transparent (models that inpaint), else image-to-image at ``strength``; several ``image`` files
    are a model's reference images (at most its ``max_images``); waits as generations do."""
    files, fields = await read_form(request, ("image", "mask"))
    req = validate_fields(ImageEditRequest, fields)
    sent, mask = files.get("image", []), one_file(files, "mask", required=False)
    if not sent:
        one_file(files, "image")  # its 400: image is required
    names = ["image"] if len(sent) == 1 else [f"image[{i}]" for i in range(len(sent))]
    for name, part in [*zip(names, sent), ("mask", mask)]:
        if part is not None:
            check_size(len(part.data), name, limits.max_image_bytes)
    images = [lambda part=part, name=name: Input.of(part.data, name) for name, part in zip(names, sent)]
    read_mask = None if mask is None else (lambda: Input.of(mask_from_alpha(mask.data), "mask", mask=True))
    new = await run_in_threadpool(catalog.resolve_edit, req, images, read_mask)
    new = await run_in_threadpool(resolve_loras, new, req.loras, store, who.scope, catalog.models[new.model],
                                  lora_policy)
    job_id, _, _ = await run_in_threadpool(admission.submit, new, who)
    job = await _wait(store, job_id, limits, request, server.cancel_on_disconnect)
    if job is None:  # the client went away
        return Response(status_code=499)
    base = (server.public_url or str(request.base_url)).rstrip("/")
    data = [await run_in_threadpool(_image_data, store, job, i, req.response_format, base)
            for i in range(job.num_items)]
    return ImagesResponse(created=int(job.created_at), data=data)


async def _wait(store: Store, job_id: str, limits: LimitsConfig, request: Request, cancel_on_disconnect: bool
                ) -> Job | None:
    """Wait until the job ends: its items are counted when a notification comes, and once a second
    anyway. A client that went away (checked every 0.25 s) gets its job cancelled, and None. Cancels
    the job and answers 504 after ``generation_timeout_s``; 500 when the job did not end done."""
    deadline = time.monotonic() + limits.generation_timeout_s
    event = store.changes.watch(job_id)
    try:
        last_poll = 0.0
        while True:
            now = time.monotonic()
            if event.is_set() or now - last_poll >= 1.0:
                event.clear()  # before counting: a change during the count wakes the next turn
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
        failures = {it.error for it in job.items if it.error} or {f"job {job.state}"}
        raise RequestError(f"generation failed: {'; '.join(sorted(failures))}", status=500)
    return job


def _image_data(store: Store, job: Job, index: int, fmt: str, base: str) -> ImageData:
    if fmt == "url":
        return ImageData(url=f"{base}/v1/jobs/{job.id}/images/{index}")
    return ImageData(b64_json=base64.b64encode(store.image_path(job.id, index).read_bytes()).decode())
