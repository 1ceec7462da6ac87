"""The web page: one framework-free page at ``/``, its script and style under ``/static/``.

The files live in ``dit_serve/server/static`` (shipped as package data); nothing is built, and the page loads
nothing from elsewhere. The page and its assets need no key: they hold no data. The page then calls
``/v1`` like any other client, sending the key the user typed in (kept in the tab's sessionStorage) as
``Authorization: Bearer``, so every rule of the API (tenants, limits, validation) applies to it
unchanged. Its Content-Security-Policy allows only this origin, plus ``blob:`` images: images are
fetched with the key and shown from blob URLs.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response
from starlette.exceptions import HTTPException

STATIC = Path(__file__).with_name("static")
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' blob:; "
                               "connect-src 'self'; form-action 'none'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # an upgraded service serves its new page at once
}

router = APIRouter(include_in_schema=False)


@cache
def assets() -> frozenset[str]:
    """The names under ``/static/``: the files of ``dit_serve/server/static`` of a type in ``TYPES``."""
    return frozenset(p.name for p in STATIC.iterdir() if p.suffix in TYPES)


def _file(name: str) -> Response:
    if name not in assets():  # also what keeps '..' and other paths out
        raise HTTPException(404, f"no file {name[:80]!r} under /static/")
    path = STATIC / name
    return Response(path.read_bytes(), media_type=TYPES[path.suffix], headers=HEADERS)


@router.get("/")
def page() -> Response:
    return _file("index.html")


@router.get("/static/{name}")
def asset(name: str) -> Response:
    return _file(name)
