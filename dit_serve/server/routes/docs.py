"""The API's documentation pages, ``/docs`` (Swagger UI) and ``/redoc``, with their scripts served from
here, not from a CDN: they work offline and on a network that blocks CDNs. The assets are those the
``fastapi-offline`` package ships (Swagger UI 5, which reads OpenAPI 3.1, and ReDoc); without it, the
pages are FastAPI's own, which load their assets from a CDN."""

from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
from starlette.exceptions import HTTPException

ASSETS = "/docs/assets"
TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8", ".png": "image/png"}


@cache
def assets_dir() -> Path | None:
    """The folder of the packaged assets, or None when the package is not installed."""
    spec = importlib.util.find_spec("fastapi_offline")
    if spec is None or spec.origin is None:
        return None
    folder = Path(spec.origin).with_name("static")
    return folder if (folder / "swagger-ui-bundle.js").is_file() else None


router = APIRouter(include_in_schema=False)


@router.get("/docs")
def swagger_ui(request: Request) -> HTMLResponse:
    root = request.scope.get("root_path", "")
    return get_swagger_ui_html(openapi_url=f"{root}{request.app.openapi_url}", title=f"{request.app.title} - Swagger UI",
                               swagger_js_url=f"{root}{ASSETS}/swagger-ui-bundle.js",
                               swagger_css_url=f"{root}{ASSETS}/swagger-ui.css",
                               swagger_favicon_url=f"{root}{ASSETS}/favicon.png")


@router.get("/redoc")
def redoc(request: Request) -> HTMLResponse:
    root = request.scope.get("root_path", "")
    return get_redoc_html(openapi_url=f"{root}{request.app.openapi_url}", title=f"{request.app.title} - ReDoc",
                          redoc_js_url=f"{root}{ASSETS}/redoc.standalone.js",
                          redoc_favicon_url=f"{root}{ASSETS}/favicon.png", with_google_fonts=False)


@router.get(ASSETS + "/{name}")
def asset(name: str) -> FileResponse:
    folder = assets_dir()
    path = None if folder is None else folder / name
    if path is None or Path(name).name != name or path.suffix not in TYPES or not path.is_file():
        raise HTTPException(404, f"no file {name[:80]!r} under {ASSETS}/")
    return FileResponse(path, media_type=TYPES[path.suffix], headers={"Cache-Control": "max-age=86400"})
