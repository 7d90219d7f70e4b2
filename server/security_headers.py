"""Headers every response carries so that a page cannot be framed, sniffed into another type, or
made to run script it did not load from this server.

The dashboard loads scripts only from /static (no inline script: buttons ask through
`data-confirm`, read by web/static/charts.js); inline styles stay allowed (uPlot, htmx's indicator
style, the templates' <style>). The API docs at /docs and /redoc are under the same policy: Swagger UI
and ReDoc are vendored, Swagger UI is started by a static script (`server/api/docs.py`). Workers
may start from blob: URLs (ReDoc's search index runs in one): only script already running here, so
from /static, can make such a URL. ReDoc's sidebar links to Redocly with a logo from their CDN;
img-src blocks it and ReDoc hides the broken image, so the page still asks nothing of another host.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "connect-src 'self'; font-src 'self'; worker-src 'self' blob:; object-src 'none'; base-uri 'self'; "
    "form-action 'self'; frame-ancestors 'none'"
)
ALWAYS = [
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
    (b"x-frame-options", b"DENY"),
]


class SecurityHeadersMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = [*ALWAYS, (b"content-security-policy", CONTENT_SECURITY_POLICY.encode())]

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *headers]
            await send(message)

        await self.app(scope, receive, send_with_headers)
