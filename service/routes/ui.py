"""Pages for people: the API documentation (Swagger UI, ReDoc) and the web console.

Everything a page loads is served from ``service/static`` (the Swagger UI and ReDoc
bundles are vendored with their licences under ``static/vendor``): no page refers to
an external URL, so the documentation and the console work on a lab network without
internet access. The pages are open; the API calls they make carry the API key the
user enters (Swagger UI's Authorize button, the console's key field).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles

__all__ = ["STATIC", "router", "static_files"]

STATIC = Path(__file__).resolve().parents[1] / "static"
_VENDOR = "/static/vendor"

router = APIRouter(include_in_schema=False)


def static_files() -> StaticFiles:
    """The pages' assets, mounted at ``/static``."""
    return StaticFiles(directory=STATIC)


@router.get("/docs")
async def swagger_ui() -> HTMLResponse:
    """Swagger UI on the service's OpenAPI document, from the vendored bundle."""
    return get_swagger_ui_html(
        openapi_url="/openapi.json",
        title="bagserve API",
        swagger_js_url=f"{_VENDOR}/swagger-ui/swagger-ui-bundle.js",
        swagger_css_url=f"{_VENDOR}/swagger-ui/swagger-ui.css",
        swagger_favicon_url=f"{_VENDOR}/swagger-ui/favicon-32x32.png",
        # No online validator badge (it would fetch from validator.swagger.io).
        swagger_ui_parameters={"validatorUrl": None, "persistAuthorization": True},
    )


@router.get("/redoc")
async def redoc() -> HTMLResponse:
    """ReDoc on the service's OpenAPI document, from the vendored bundle, no web fonts."""
    return get_redoc_html(
        openapi_url="/openapi.json",
        title="bagserve API",
        redoc_js_url=f"{_VENDOR}/redoc/redoc.standalone.js",
        redoc_favicon_url=f"{_VENDOR}/swagger-ui/favicon-32x32.png",
        with_google_fonts=False,
    )


@router.get("/")
async def console() -> FileResponse:
    """The web console (a static page calling the API; see ``static/console``)."""
    return FileResponse(STATIC / "console" / "index.html", media_type="text/html")
