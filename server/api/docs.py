"""The API's reference pages: Swagger UI at /docs and ReDoc at /redoc, both from the files vendored
under web/static/vendor (nothing from a CDN) and both under the Content-Security-Policy: Swagger UI
is started by web/static/swagger-init.js, which reads the schema's URL from the page, since the
policy allows no inline script (FastAPI's `get_swagger_ui_html` writes one, so /docs is written
here). Neither needs a token: the OpenAPI schema is no secret, and every call still needs one."""

from __future__ import annotations

from html import escape

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_redoc_html
from fastapi.responses import HTMLResponse

router = APIRouter(include_in_schema=False)
VENDOR = "/static/vendor"
FAVICON = f"{VENDOR}/swagger-ui/favicon-32x32.png"


def _openapi_url(request: Request) -> str:
    return str(request.scope.get("root_path", "")) + (request.app.openapi_url or "/openapi.json")


@router.get("/docs", response_class=HTMLResponse)
def swagger_ui(request: Request) -> HTMLResponse:
    root = escape(str(request.scope.get("root_path", "")))
    return HTMLResponse(
        f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1.0">
<title>{escape(request.app.title)} API</title>
<link rel="stylesheet" href="{root}{VENDOR}/swagger-ui/swagger-ui.css">
<link rel="icon" href="{root}{FAVICON}">
</head>
<body>
<div id="swagger-ui" data-openapi-url="{escape(_openapi_url(request))}"></div>
<script src="{root}{VENDOR}/swagger-ui/swagger-ui-bundle.js"></script>
<script src="{root}/static/swagger-init.js"></script>
</body>
</html>
"""
    )


@router.get("/redoc", response_class=HTMLResponse)
def redoc(request: Request) -> HTMLResponse:
    root = str(request.scope.get("root_path", ""))
    return get_redoc_html(
        openapi_url=_openapi_url(request),
        title=f"{request.app.title} API",
        redoc_js_url=f"{root}{VENDOR}/redoc/redoc.standalone.js",
        redoc_favicon_url=f"{root}{FAVICON}",
        with_google_fonts=False,
    )
