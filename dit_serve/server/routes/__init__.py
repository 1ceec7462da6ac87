"""The HTTP API's routes, one module-level router per area: ``jobs`` (submit, read, list, cancel, retry,
images, previews, archive, events), ``openai`` (POST /v1/images/generations), ``models``, ``workers`` (what
each worker serves), and ``ops`` (health and metrics, open to probes). A route asks for what it uses with ``Depends`` (``deps``); the
objects themselves are the app's, put on ``app.state`` by ``dit_serve.server.api.create_app``.

Here: the error statuses a route documents (``errors(404, 409)``), so that every status a route can
answer is in the OpenAPI schema."""

from __future__ import annotations

from dit_serve.schemas import ErrorResponse

DESCRIPTIONS = {400: "Bad request: the message names the field", 401: "Missing or invalid API key",
                403: "Not allowed for this tenant", 404: "No such job, image or model (or another tenant's)",
                405: "Method not allowed (see the Allow header)", 408: "The request body did not arrive in time",
                409: "Conflict (an image not made yet: the message says its state)",
                410: "Gone: the item failed (the message says why) or was cancelled", 413: "Request body too large",
                415: "The body is not sent as JSON (Content-Type: application/json), or for uploads and image "
                "edits as multipart/form-data", 429: "Too many queued items: retry after Retry-After "
                "seconds", 500: "Internal error, or the generation failed", 503: "Not ready",
                504: "The generation did not finish in time"}


def errors(*statuses: int) -> dict:
    """OpenAPI ``responses`` for error statuses: each one's body is an ``ErrorResponse``."""
    return {s: {"model": ErrorResponse, "description": DESCRIPTIONS[s]} for s in statuses}


ERRORS = errors(400, 401, 405, 408, 413, 415, 500)  # any route can answer these (validation, key, limits, bugs)


def form_body(schema: dict, required: list[str], files: dict[str, str]) -> dict:
    """A route's ``openapi_extra`` for a multipart/form-data body: ``files`` (name -> description) as binary
    parts, and the text fields of a request model's JSON ``schema`` (``model_json_schema()``), each as the type it
    has when given (a form has no null)."""
    properties = {name: {"type": "string", "format": "binary", "description": text} for name, text in files.items()}
    for name, field in schema.get("properties", {}).items():
        branches = [b for b in field.get("anyOf", [field]) if b.get("type") != "null"]
        properties[name] = {**{k: v for k, v in field.items() if k not in ("anyOf", "default")}, **branches[0]}
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
        "type": "object", "required": required, "properties": properties, "additionalProperties": False}}}}}
