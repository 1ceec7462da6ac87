"""Uploads: an edit's input image (or mask) sent once, as a multipart file, and named by its id in jobs
(``POST /v1/jobs``' ``image`` and ``mask``). Checked as every input is (``dit_serve.server.inputs``), stored under
the data dir, counted in the tenant's quota (``[limits] tenant_max_upload_bytes``), deleted by retention
(``[store] upload_retention_hours``) or by ``DELETE``. A tenant sees its own uploads only."""

from __future__ import annotations

from fastapi import Path, Request, Response
from fastapi.concurrency import run_in_threadpool

from dit_serve.schemas import UPLOAD_ID, Upload, clip
from dit_serve.server.catalog import RequestError
from dit_serve.server.inputs import Input, check_size
from dit_serve.server.routes import errors, form_body
from dit_serve.server.routes.deps import Caller, LimitsDep, StoreDep, v1_router
from dit_serve.server.routes.forms import one_file, read_form
from dit_serve.server.store import UploadQuotaFull

router = v1_router("uploads")
UploadId = Path(min_length=1, max_length=64, pattern=UPLOAD_ID, description="an upload's id")
UPLOAD_FORM = form_body({}, ["file"], {"file": "one PNG, JPEG or WebP image (at most [limits] max_image_bytes; "
                                               "25 MP; not animated)"})


@router.post("/uploads", status_code=201, response_model=Upload, responses=errors(403), openapi_extra=UPLOAD_FORM)
async def create_upload(request: Request, store: StoreDep, limits: LimitsDep, who: Caller) -> Response:
    """Upload one image (multipart/form-data, the file as ``file``); 201 with its id, which ``POST /v1/jobs``
    takes as ``image`` or ``mask``. Checked before it is stored: an undecodable, animated or too large image is
    a 4xx naming ``file``, and nothing is stored."""
    files, fields = await read_form(request, ("file",))
    part = one_file(files, "file")
    if fields:
        name = next(iter(fields))
        raise RequestError(f"unknown field {clip(name, 60)!r}: an upload takes one file, as 'file'", name[:100])
    check_size(len(part.data), "file", limits.max_image_bytes)
    ttl_s = request.app.state.upload_ttl_s

    def store_it() -> Upload:
        image = Input.of(part.data, "file")
        try:
            return store.put_upload(who.tenant, image.data, image.format, image.width, image.height, part.filename,
                                    max_tenant_bytes=limits.tenant_max_upload_bytes, ttl_s=ttl_s)
        except UploadQuotaFull as e:
            raise RequestError(str(e), "file", status=403) from None

    upload = await run_in_threadpool(store_it)
    return Response(upload.model_dump_json(), status_code=201, media_type="application/json",
                    headers={"Location": f"/v1/uploads/{upload.id}"})


@router.get("/uploads/{upload_id}", response_model=Upload, responses=errors(404))
def get_upload(store: StoreDep, who: Caller, upload_id: str = UploadId) -> Upload:
    """An upload's size, format, hash and expiry."""
    found = store.get_upload(upload_id, tenant=who.scope)
    if found is None:
        raise _missing(upload_id)
    return found[0]


@router.delete("/uploads/{upload_id}", response_model=Upload, responses=errors(404))
def delete_upload(store: StoreDep, who: Caller, upload_id: str = UploadId) -> Upload:
    """Delete an upload (its bytes stop counting in the quota); jobs that used it keep their own copy."""
    found = store.get_upload(upload_id, tenant=who.scope)
    if found is None or not store.delete_upload(upload_id, tenant=who.scope):
        raise _missing(upload_id)
    return found[0]


def _missing(upload_id: str) -> RequestError:
    return RequestError(f"no upload {clip(upload_id, 64)!r} (or it expired, or it is another tenant's)", "upload_id",
                        status=404)
