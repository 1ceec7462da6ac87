"""The HTTP API (FastAPI): jobs, images, an OpenAI-compatible images endpoint, models, health and
Prometheus metrics. ``create_app`` builds it from a store, a catalog and metrics; it runs no
models itself, so several API processes can serve one PostgreSQL store. The routes are in
``dit_serve.server.routes``, one router per area; ``create_app`` puts the objects they share on
``app.state``, where their dependencies (``routes.deps``) read them.

Every error body is ``{"error": {"message", "type", "param", "code"}}`` (OpenAI's shape), and every
status a route can answer is in the OpenAPI schema. Requests are validated completely before anything
is stored: a 4xx leaves no trace in the store. Callers are tenants (``dit_serve.server.keys``): each sees and
acts on its own jobs only, and a job that another tenant owns is a 404.
"""

from __future__ import annotations

import logging
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from dit_serve import __version__
from dit_serve.schemas import NOT_BLANK, clip, event_schema
from dit_serve.server import web
from dit_serve.server.access_log import AccessLogMiddleware
from dit_serve.server.catalog import Catalog, RequestError
from dit_serve.server.config import LimitsConfig, ServerConfig
from dit_serve.server.events import StreamLimits, Streams
from dit_serve.server.http_limits import LimitsMiddleware
from dit_serve.server.keys import KeyRing
from dit_serve.server.loras import LoraPolicy
from dit_serve.server.metrics import Metrics
from dit_serve.server.routes import ERRORS, docs, jobs, loras, models, openai, ops, uploads, workers
from dit_serve.server.routes.admission import Admission
from dit_serve.server.routes.jobs import EVENT_ID
from dit_serve.server.store import Store

log = logging.getLogger(__name__)
# in this order; the page at / and its assets need no key (they hold no data; the page calls /v1 with one)
ROUTERS = (jobs.router, openai.router, uploads.router, loras.router, models.router, workers.router, web.router, ops.router)


def create_app(store: Store, catalog: Catalog, server: ServerConfig, metrics: Metrics,
               workers_ready: Callable[[], int | None] = lambda: None, allow_hosts: tuple[str, ...] = (),
               stream_limits: StreamLimits = StreamLimits(), upload_ttl_s: float = 0.0,
               lora_policy: LoraPolicy = LoraPolicy()) -> FastAPI:
    """``upload_ttl_s``: uploads are deleted this long after they were made (0: kept until deleted);
    ``lora_policy``: the adapters jobs may apply (``[workers] lora_*``)."""
    local_docs = docs.assets_dir() is not None  # else FastAPI's pages, with their assets from a CDN
    app = FastAPI(title="dit-serve", version=__version__, responses=ERRORS,
                  description="Batch image generation with diffusion transformers.",
                  docs_url=None if local_docs else "/docs", redoc_url=None if local_docs else "/redoc")
    _add_error_handlers(app)
    app.add_middleware(LimitsMiddleware, max_body_bytes=server.max_body_bytes, read_timeout_s=server.read_timeout_s,
                       route_limits=edit_body_limits(server.max_body_bytes, catalog.limits, lora_policy.max_bytes,
                                                     max((m.max_images for m in catalog.models.values()), default=1)))
    if server.access_log:  # added last: outermost, it logs the status the client got
        app.add_middleware(AccessLogMiddleware)
    state = app.state  # what the routes' dependencies read (dit_serve.server.routes.deps)
    state.store, state.catalog, state.server, state.metrics = store, catalog, server, metrics
    state.workers_ready = workers_ready
    state.upload_ttl_s = upload_ttl_s
    state.lora_policy = lora_policy
    state.key_ring = KeyRing(store, [k.get_secret_value() for k in server.api_keys])
    state.admission = Admission(store, catalog.limits, metrics, allow_hosts)
    state.event_streams = Streams(stream_limits)
    for router in ROUTERS:
        app.include_router(router)
    if local_docs:
        app.include_router(docs.router)
    _add_event_models(app)
    # for 405's Allow: app.router.routes holds each included router as one entry, without a path_regex
    state.all_routes = [r for r in (*(r for router in ROUTERS for r in router.routes), *app.router.routes)
                        if hasattr(r, "path_regex")]
    return app


def edit_body_limits(max_body_bytes: int, limits: LimitsConfig, max_lora_bytes: int = 0,
                     max_images: int = 1) -> dict[str, int]:
    """The routes whose bodies carry images, and the body each may send: an upload one file, an OpenAI edit an
    image and a mask (or a served model's ``max_images`` reference images, which take no mask), a job as many
    inline (base64: 4/3 of the bytes) besides the usual JSON; each with room for the form's or the JSON's other
    fields."""
    room, files = 64 << 10, max(2, max_images)
    return {"/v1/uploads": limits.max_image_bytes + room, "/v1/loras": max_lora_bytes + room,
            "/v1/images/edits": files * limits.max_image_bytes + room,
            "/v1/jobs": max_body_bytes + files * (-(-limits.max_inline_image_bytes // 3) * 4 + 512)}


def _add_event_models(app: FastAPI) -> None:
    """The events route's itemSchema refers to the event models: put them among the schema's components."""
    base = app.openapi

    def openapi() -> dict:
        schema = base()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name, model in event_schema()["components"].items():
            components.setdefault(name, model)
        return schema

    app.openapi = openapi


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
    async def validation_error(request: Request, e: RequestValidationError):
        if (why := _not_json(request, e)) is not None:
            return _error(415, why)
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


def _not_json(request: Request, e: RequestValidationError) -> str | None:
    """Why a body that failed validation is a 415: it was sent with a content type other than JSON."""
    kind = request.headers.get("content-type", "")
    media = kind.split(";")[0].strip().lower()
    if not media or media == "application/json" or media.endswith("+json"):
        return None
    if not any(err.get("loc", ())[:1] == ("body",) for err in e.errors()):
        return None
    return f"the request body must be JSON sent with Content-Type: application/json, not {clip(kind, 100)!r}"


# what a pattern in the schema asks for, in words
PATTERNS = {r"^https?://[^\s]+$": "an http:// or https:// URL without spaces", NOT_BLANK: "some text, not only spaces",
            EVENT_ID: "the id of an event of this stream (e.g. '3.17.1520413.2'), or none",
            r"^[0-9a-zA-Z_-]+$": "letters, digits, '_' and '-' only", r"^[!-~]+$": "printable ASCII without spaces"}
KINDS = {"int": "a whole number", "float": "a number", "bool": "true or false", "string": "a string",
         "list": "a list", "dict": "a JSON object", "model": "a JSON object", "finite": "a finite number"}


def _describe(err: dict) -> tuple[str, str | None]:
    """One pydantic error as a sentence a user can act on (the field, what was wrong, what is allowed),
    and the field it is about."""
    loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path", "header")]
    where = ".".join(loc)
    kind, ctx, given = err.get("type", ""), err.get("ctx", {}), err.get("input")
    if kind == "json_invalid":
        return f"malformed JSON body: {ctx.get('error', err['msg'])}", None
    if kind == "missing" and not loc:
        return "the request needs a JSON body", None
    if kind == "extra_forbidden":
        return f"unknown field {where!r}", where
    if kind in ("model_attributes_type", "model_type", "dict_type") and not loc:
        return "the request body must be a JSON object", None
    if kind == "value_error":  # our own validators' messages, without pydantic's "Value error, " prefix
        message = str(ctx.get("error", err["msg"]))
        return (f"{where}: {message}" if where else message), where or None
    message = _sentence(kind, ctx, given, err["msg"])
    return (f"{where} {message}" if where else message), where or None


def _sentence(kind: str, ctx: dict, given, fallback: str) -> str:
    """What is wrong, as the predicate of a sentence whose subject is the field."""
    shown = clip(repr(given), 60)
    if kind == "missing":
        return "is required"
    if kind in ("too_long", "string_too_long"):
        unit = "characters" if isinstance(given, str) else "items"
        return f"has {len(given)} {unit}; at most {ctx['max_length']} are allowed"
    if kind in ("too_short", "string_too_short"):
        unit = "characters" if isinstance(given, str) else "items"
        return "must not be empty" if ctx.get("min_length") == 1 else \
            f"has {len(given)} {unit}; at least {ctx['min_length']} are needed"
    bounds = {"greater_than_equal": ("at least", "ge"), "less_than_equal": ("at most", "le"),
              "greater_than": ("more than", "gt"), "less_than": ("less than", "lt")}
    if kind in bounds:
        words, key = bounds[kind]
        limit = f"{ctx[key]:g}" if isinstance(ctx[key], float) else ctx[key]
        return f"must be {words} {limit}, got {shown}"
    if kind == "string_pattern_mismatch":
        return f"must be {PATTERNS.get(ctx.get('pattern'), 'of the form ' + repr(ctx.get('pattern')))}, got {shown}"
    if kind in ("literal_error", "enum"):
        return f"must be {ctx.get('expected', '')}, got {shown}"
    if kind == "finite_number":
        return f"must be a finite number, got {shown}"
    if kind in ("int_from_float", "int_parsing_size"):
        return f"must be a whole number within its range, got {shown}"
    base = kind.split("_")[0]
    if base in KINDS and kind.endswith(("_type", "_parsing")):
        return f"must be {KINDS[base]}, got {shown}"
    return f"is not valid: {fallback}"
