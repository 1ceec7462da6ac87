"""Reading the multipart/form-data bodies of the uploads and image-edit routes (``dit_serve.server.multipart``):
files by name, and the text fields validated by a request model, with the same 400s as a JSON body's."""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from dit_serve.server import multipart
from dit_serve.server.catalog import RequestError


async def read_form(request: Request, file_fields: tuple[str, ...]) -> tuple[dict[str, list[multipart.Part]], dict]:
    """(files by field name, text fields by name) of the request's multipart body. Parts named in
    ``file_fields`` (also as OpenAI's SDK names repeated ones: ``image[]``) are files; the others text (UTF-8),
    each at most once."""
    body = await request.body()
    try:
        parts = multipart.parse(request.headers.get("content-type", ""), body)
    except multipart.FormError as e:
        raise RequestError(str(e), status=e.status) from None
    files: dict[str, list[multipart.Part]] = {}
    fields: dict[str, str] = {}
    for part in parts:
        name = part.name.removesuffix("[]")
        if name in file_fields:
            files.setdefault(name, []).append(part)
            continue
        if part.is_file:
            raise RequestError(f"unknown file field {part.name[:60]!r}; this route takes files as "
                               f"{' and '.join(repr(f) for f in file_fields)}", part.name[:100])
        if part.name in fields:
            raise RequestError(f"form field {part.name[:60]!r} is sent twice", part.name[:100])
        try:
            fields[part.name] = part.data.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError(f"form field {part.name[:60]!r} is not UTF-8 text", part.name[:100]) from None
    return files, fields


def validate_fields(model: type[BaseModel], fields: dict) -> BaseModel:
    """The text fields as ``model``; a 400 naming the field as for a JSON body (the app's validation handler)."""
    try:
        return model.model_validate(fields)
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False)) from None


def one_file(files: dict[str, list[multipart.Part]], name: str, required: bool = True) -> multipart.Part | None:
    """The one file sent as ``name``; 400 when there are several, or none and it is ``required``."""
    got = files.get(name, [])
    if len(got) > 1:
        raise RequestError(f"{name}: send one file, not {len(got)}", name)
    if not got and required:
        raise RequestError(f"{name} is required: a PNG, JPEG or WebP file (a multipart/form-data file part)", name)
    return got[0] if got else None
