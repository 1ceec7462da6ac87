"""Edits' input images at the API: where a request's image and mask come from (an upload's id, a data URL, base64,
a multipart file) and the checks every one passes before anything is stored (``workers.request.images``, the
rules the worker decodes by: PNG, JPEG or WebP, at most 25 MP, no animation, EXIF orientation applied). Each
refusal is a ``RequestError`` naming the request's field: 413 past a size limit, 400 otherwise.

The catalog decides whether the model takes them (``Catalog.edit``); what it is handed here are ``Input``s: the
bytes as they will be stored (once per job) and their SHA-256."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
from dataclasses import dataclass
from typing import Callable

from dit_serve.schemas import UPLOAD_ID, InputImage, JobRequest, clip
from dit_serve.server.catalog import RequestError
from workers.request import images

# a data URL's media type is not trusted (a browser labels an unknown file application/octet-stream): the bytes
# themselves are checked
DATA_URL = re.compile(r"^data:[^,;]{0,100}(?:;[^,;]{0,100}){0,8};base64,", re.IGNORECASE)
SIGNATURES = ((b"\x89PNG\r\n\x1a\n", "PNG"), (b"\xff\xd8\xff", "JPEG"))


@dataclass(frozen=True)
class Input:
    """An input image (or mask) that passed the checks: its bytes as stored, and what the job records."""

    data: bytes
    width: int
    height: int
    format: str
    id: str | None = None  # the upload's, when it came from one
    sha256: str = ""

    @classmethod
    def of(cls, data: bytes, field: str, mask: bool = False, upload_id: str | None = None) -> "Input":
        """``data`` checked and decoded as an image (or a mask); RequestError naming ``field`` otherwise."""
        try:
            im = images.decode_mask(data, field) if mask else images.decode_image(data, field)
        except images.ImageError as e:
            raise RequestError(str(e), field) from None
        return cls(bytes(data), im.width, im.height, format_of(data), upload_id, hashlib.sha256(data).hexdigest())

    @property
    def size(self) -> tuple[int, int]:  # what images.check_mask_size compares
        return self.width, self.height

    def ref(self) -> InputImage:
        return InputImage(id=self.id, sha256=self.sha256, width=self.width, height=self.height)


def format_of(data: bytes) -> str:
    """PNG, JPEG or WEBP, from the file's signature (bytes that passed ``images``' checks are one of them)."""
    for signature, name in SIGNATURES:
        if data.startswith(signature):
            return name
    return "WEBP" if data[:4] == b"RIFF" and data[8:12] == b"WEBP" else "PNG"


def check_size(n: int, field: str, limit: int, what: str = "file") -> None:
    if n > limit:
        raise RequestError(f"{field}: the {what} is {n:,} bytes; this service accepts at most {limit:,}", field,
                           status=413)


def inline(value: str, field: str, limit: int, data_url: bool) -> bytes:
    """The bytes of an image sent as text: a data URL (``data_url``) or bare base64; 413 past ``limit`` decoded
    bytes (said before decoding), 400 when it is not base64."""
    text = value
    if data_url:
        m = DATA_URL.match(value)
        if m is None:
            raise RequestError(f"{field} must be an upload's id ('upl_' and 24 hex digits, from POST /v1/uploads) "
                               f"or a data URL of a PNG, JPEG or WebP image ('data:image/png;base64,...'), got "
                               f"{clip(value, 40)!r} (bare base64 goes in {field}_b64)", field)
        text = value[m.end():]
    if any(c.isspace() for c in text[:4096]) or any(c.isspace() for c in text[-4096:]):
        text = "".join(text.split())  # line-wrapped base64 (as `base64` prints it)
    check_size(len(text) // 4 * 3, field, limit, "inline image")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(f"{field} is not valid base64 (standard alphabet, padded)", field) from None


class JobInputs:
    """A ``POST /v1/jobs`` request's images and mask, read (an upload from the store, inline text decoded) and
    checked only when the catalog asks for them, after the model's card allowed them. ``image`` (or ``image_b64``)
    may be a list: an instruction edit's reference images, each read as one image is (its field ``image[i]``)."""

    def __init__(self, req: JobRequest, get_upload: Callable[[str], bytes | None], inline_limit: int):
        self.req, self.get_upload, self.inline_limit = req, get_upload, inline_limit
        for name in ("image", "mask"):
            if getattr(req, name) is not None and getattr(req, f"{name}_b64") is not None:
                raise RequestError(f"send {name} or {name}_b64, not both", f"{name}_b64")

    def given(self, name: str) -> bool:
        return getattr(self.req, name) is not None or getattr(self.req, f"{name}_b64") is not None

    def reader(self, name: str) -> Callable[[], Input] | None:
        """A function that reads and checks ``name`` (image or mask); None when the request has none."""
        found = self.readers(name)
        return found[0] if found else None

    def readers(self, name: str) -> list[Callable[[], Input]]:
        """A function per image sent as ``name`` (one, or each of a list, in order) that reads and checks it."""
        value, raw = getattr(self.req, name), getattr(self.req, f"{name}_b64")
        field, given = (name, value) if raw is None else (f"{name}_b64", raw)
        if given is None:
            return []
        if isinstance(given, str):
            return [lambda: self.read(field, given, mask=name == "mask")]
        return [lambda f=f"{field}[{i}]", v=v: self.read(f, v) for i, v in enumerate(given)]

    def read(self, field: str, value: str, mask: bool = False) -> Input:
        """The image sent as ``field``: base64 (an ``_b64`` field), else an upload's id or a data URL."""
        if field.split("[")[0].endswith("_b64"):
            return Input.of(inline(value, field, self.inline_limit, data_url=False), field, mask=mask)
        if re.match(UPLOAD_ID, value):
            data = self.get_upload(value)
            if data is None:
                raise RequestError(f"{field}: no upload {value!r} (uploads are deleted once retention's time has "
                                   "passed, and a tenant sees its own only): upload the file again", field)
            return Input.of(data, field, mask=mask, upload_id=value)
        return Input.of(inline(value, field, self.inline_limit, data_url=True), field, mask=mask)


def mask_from_alpha(data: bytes, field: str = "mask") -> bytes:
    """OpenAI's mask (the transparent area is edited) as this service's: a grayscale PNG, white = repaint."""
    try:
        mask = images.mask_from_alpha(data, field)
    except images.ImageError as e:
        raise RequestError(str(e), field) from None
    buf = io.BytesIO()
    mask.save(buf, format="PNG")
    return buf.getvalue()
