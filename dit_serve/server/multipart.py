"""``multipart/form-data`` bodies (RFC 7578), read whole and split here: the uploads and OpenAI's image edits
send files this way. The body has already been bounded by ``http_limits`` (its route's limit), so it is parsed
in memory, exactly (a file's bytes are the bytes between its headers and the next boundary, nothing decoded or
normalised), with bounds of its own on the number of parts and the size of their headers. Anything malformed is
a ``FormError`` (a 400 with a message that says what), never a guess."""

from __future__ import annotations

from dataclasses import dataclass
from email.message import Message

MAX_PARTS = 64
MAX_HEADER_BYTES = 8192  # one part's headers
MAX_FIELD_BYTES = 64 << 10  # a text field (a prompt is at most 32,000 characters)


class FormError(ValueError):
    """A body that is not a well-formed multipart/form-data body; ``status`` 415 when it is not multipart."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Part:
    name: str
    data: bytes
    filename: str | None = None  # set for a file part (even an empty name: "")
    content_type: str | None = None

    @property
    def is_file(self) -> bool:
        return self.filename is not None


def boundary_of(content_type: str) -> bytes:
    """The boundary of a ``multipart/form-data`` Content-Type; FormError (415 for another type)."""
    media, params = _header_params(content_type or "")
    if media != "multipart/form-data":
        raise FormError(f"the request body must be multipart/form-data (files as form parts), not "
                        f"{(content_type or 'none')[:100]!r}", status=415)
    boundary = params.get("boundary", "")
    if not 1 <= len(boundary) <= 200 or not boundary.isascii():  # RFC 2046 says 70; clients send longer
        raise FormError("the multipart/form-data Content-Type has no valid boundary parameter")
    return boundary.encode("ascii")


def parse(content_type: str, body: bytes) -> list[Part]:
    """The parts of a multipart/form-data body, in order."""
    boundary = boundary_of(content_type)
    delimiter = b"--" + boundary
    if body.startswith(delimiter):
        pos = len(delimiter)
    else:  # a preamble (allowed, ignored) ends with CRLF before the first delimiter
        first = body.find(b"\r\n" + delimiter)
        if first < 0:
            raise FormError("the multipart body has no part (its boundary does not occur in it)")
        pos = first + 2 + len(delimiter)
    parts: list[Part] = []
    while True:
        if body.startswith(b"--", pos):  # the close delimiter; an epilogue after it is ignored
            return parts
        eol = body.find(b"\r\n", pos)
        if eol < 0 or body[pos:eol].strip(b" \t"):  # only transport padding may follow a delimiter
            raise FormError("the multipart body is cut short or malformed after a boundary")
        pos = eol + 2
        if len(parts) == MAX_PARTS:
            raise FormError(f"the multipart body has more than {MAX_PARTS} parts")
        if body.startswith(b"\r\n", pos):
            raw, start = b"", pos + 2
        else:
            end = body.find(b"\r\n\r\n", pos, pos + MAX_HEADER_BYTES + 4)
            if end < 0:
                raise FormError(f"a part's headers do not end within {MAX_HEADER_BYTES} bytes")
            raw, start = body[pos:end], end + 4
        close = body.find(b"\r\n" + delimiter, start)
        if close < 0:
            raise FormError("the multipart body ends without its closing boundary (cut short?)")
        parts.append(_part(raw, body[start:close]))
        pos = close + 2 + len(delimiter)


def _part(raw: bytes, data: bytes) -> Part:
    headers: dict[str, str] = {}
    for line in raw.split(b"\r\n"):
        name, sep, value = line.decode("utf-8", "replace").partition(":")
        if not sep or not name.strip():
            raise FormError("a part of the multipart body has a malformed header line")
        headers[name.strip().lower()] = value.strip()
    kind, params = _header_params(headers.get("content-disposition", ""))
    if kind != "form-data" or not params.get("name"):
        raise FormError("each part of a multipart/form-data body needs Content-Disposition: form-data; name=...")
    filename = params.get("filename")
    if filename is None and len(data) > MAX_FIELD_BYTES:
        raise FormError(f"form field {params['name'][:60]!r} is {len(data)} bytes; a text field may have at most "
                        f"{MAX_FIELD_BYTES} (send files as files)")
    return Part(params["name"], data, filename, headers.get("content-type"))


def _header_params(value: str) -> tuple[str, dict[str, str]]:
    """A header's main value (lower case) and its parameters, unquoted (RFC 2231 ones decoded), as the email
    package reads them."""
    msg = Message()
    msg["x"] = value
    params = msg.get_params(header="x") or []
    if not params:
        return "", {}
    out = {}
    for key, val in params[1:]:
        if isinstance(val, tuple):  # RFC 2231: (charset, language, value)
            val = val[2]
        out[key.lower()] = val
    return params[0][0].strip().lower(), out
