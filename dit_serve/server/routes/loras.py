"""Adapters (LoRA): ``POST /v1/loras`` registers a safetensors file for a model (multipart: ``file``, ``name``,
``model``), checked before anything is stored (``dit_serve.server.loras``); ``GET /v1/loras`` lists those the caller
may use; ``DELETE /v1/loras/{name}`` removes one. An adapter is its tenant's; one registered with the admin key (or
from ``[workers] lora_dir``) is shared with every tenant. Jobs name adapters in ``loras``."""

from __future__ import annotations

from fastapi import Path, Request, Response
from fastapi.concurrency import run_in_threadpool

from dit_serve.schemas import LORA_NAME, Lora, LoraList, clip
from dit_serve.server.catalog import RequestError
from dit_serve.server.loras import AdapterError, check_bytes, check_family, check_name
from dit_serve.server.routes import errors, form_body
from dit_serve.server.routes.deps import Caller, CatalogDep, StoreDep, v1_router
from dit_serve.server.routes.forms import one_file, read_form
from dit_serve.server.store import LoraNameTaken

router = v1_router("loras")
LoraName = Path(min_length=1, max_length=64, pattern=LORA_NAME, description="an adapter's name")
FIELDS = ("name", "model", "shared")
LORA_FORM = form_body({"properties": {
    "name": {"type": "string", "pattern": LORA_NAME, "description": "what jobs call it (loras: [{name, scale}])"},
    "model": {"type": "string", "description": "the served model it is for (GET /v1/models); the first when omitted"},
    "shared": {"type": "string", "enum": ["true", "false"], "description": "admin key only: every tenant may use "
                                                                           "it (the default for the admin key)"}}},
    ["file", "name"], {"file": "one safetensors file (diffusers/PEFT or kohya keys; at most [workers] "
                               "lora_max_bytes; a pickle is refused)"})


@router.post("/loras", status_code=201, response_model=Lora, responses=errors(403, 409), openapi_extra=LORA_FORM)
async def create_lora(request: Request, store: StoreDep, catalog: CatalogDep, who: Caller) -> Response:
    """Register an adapter (multipart/form-data: ``file``, ``name``, ``model``); 201 with what was registered. A
    file that is not a safetensors LoRA the workers read, too large, of a rank past ``[workers] lora_max_rank``
    or in a format for another family is a 400 naming the problem, and nothing is stored."""
    policy = request.app.state.lora_policy
    if policy.slots == 0:
        raise RequestError("this service applies no adapters ([workers] lora_slots is 0)", "file", status=403)
    files, fields = await read_form(request, ("file",))
    for name in fields:
        if name not in FIELDS:
            raise RequestError(f"unknown field {clip(name, 60)!r}: an adapter takes file, name, model and shared",
                               name[:100])
    part = one_file(files, "file")
    check_name(fields.get("name", ""))
    card = catalog.model(fields.get("model") or None)
    shared = _shared(fields.get("shared"), who.admin)

    def store_it() -> Lora:
        try:
            checked = check_bytes(part.data, policy)
            family = check_family(checked, card)
        except AdapterError as e:
            raise RequestError(str(e), "file", status=413 if len(part.data) > policy.max_bytes else 400) from None
        try:
            return store.put_lora(fields["name"], part.data, who.tenant, shared, card.name, family, checked.format,
                                  checked.rank, checked.modules)
        except LoraNameTaken as e:
            raise RequestError(str(e), "name", status=409) from None

    lora = await run_in_threadpool(store_it)
    return Response(lora.model_dump_json(), status_code=201, media_type="application/json",
                    headers={"Location": f"/v1/loras/{lora.name}"})


def _shared(text: str | None, admin: bool) -> bool:
    if text not in (None, "true", "false"):
        raise RequestError(f"shared is 'true' or 'false', not {clip(text, 20)!r}", "shared")
    if text == "true" and not admin:
        raise RequestError("only the admin key shares an adapter with every tenant", "shared", status=403)
    return admin if text is None else text == "true"


@router.get("/loras", response_model=LoraList)
def list_loras(store: StoreDep, who: Caller) -> LoraList:
    """The adapters the caller may name in jobs: its tenant's and the shared ones (the admin key: all)."""
    return LoraList(data=store.list_loras(tenant=who.scope))


@router.get("/loras/{name}", response_model=Lora, responses=errors(404))
def get_lora(store: StoreDep, who: Caller, name: str = LoraName) -> Lora:
    found = store.get_loras([name], tenant=who.scope)
    if name not in found:
        raise _missing(name)
    return found[name]


@router.delete("/loras/{name}", response_model=Lora, responses=errors(404))
def delete_lora(store: StoreDep, who: Caller, name: str = LoraName) -> Lora:
    """Delete an adapter the caller's tenant registered (the admin key: any). Queued jobs that name it fail
    when they come to run."""
    gone = store.delete_lora(name, tenant=who.scope)
    if gone is None:
        raise _missing(name)
    return gone


def _missing(name: str) -> RequestError:
    return RequestError(f"no adapter {clip(name, 64)!r} (or it is another tenant's)", "name", status=404)
