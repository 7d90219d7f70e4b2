"""Request bodies capped per route while they stream, before anything parses them and before the
caller is authenticated (FastAPI reads and parses a body before a route's dependencies run, so a
check in a dependency protects no memory: an unauthenticated 512 MiB JSON body once grew the server
by ~680 MiB).

A declared `Content-Length` over the cap is answered 413 at once, without reading a byte; a body
sent in chunks is counted as it arrives and refused as soon as it passes the cap. Routes that read
bodies on purpose (code bundles, metric and log batches) have their own caps and still check their
exact limits themselves; this is the outer guard for every route.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from phalanx.schemas.protocol import MAX_EXIT_REASON_CHARS, MAX_LOCK_CHARS, MAX_REPORTS_PER_CALL
from server.settings import Settings

# What any other route may receive: a JSON document of a spec, a registration, a token request.
DEFAULT_CAP = 1 << 20
# Multipart framing and the spec beside the bundle itself
UPLOAD_OVERHEAD = 1 << 20
# A call of node reports, each an exit with the longest reason, every character escaped as \uXXXX
REPORTS_CAP = MAX_REPORTS_PER_CALL * (6 * MAX_EXIT_REASON_CHARS + 1024)


class BodyTooLarge(HTTPException):
    """An HTTPException, so FastAPI's body parsing lets it through as it is (anything else raised
    while it reads a body becomes a 400)."""

    def __init__(self, cap: int) -> None:
        super().__init__(
            413,
            f"the request body is over this route's cap of {cap:,} bytes: send smaller batches, "
            "or keep data sets out of a job's code bundle",
        )


def caps_for(settings: Settings) -> Callable[[str, str], int]:
    """The cap of each (method, path); uploads and batches get what their settings allow."""
    upload = settings.max_bundle_bytes + UPLOAD_OVERHEAD
    rules = [
        (re.compile(r"^/api/v1/(jobs|studies|scaling)$"), upload),
        (re.compile(r"^/submit$"), upload),
        (re.compile(r"^/api/v1/allocations/[^/]+/metrics$"), settings.max_metric_batch_bytes),
        (re.compile(r"^/api/v1/agents/[^/]+(/allocations/[^/]+)?/logs$"), settings.max_log_batch_bytes),
        (re.compile(r"^/api/v1/agents/[^/]+/reports$"), REPORTS_CAP),
        (re.compile(r"^/api/v1/allocations/[^/]+/profiles/[^/]+/ranks/[^/]+$"), settings.max_profile_trace_bytes),
        # a lock as JSON: its newlines escaped, so twice its longest text is ample
        (re.compile(r"^/api/v1/agents/[^/]+/allocations/[^/]+/environment$"), 2 * MAX_LOCK_CHARS),
    ]

    def cap(method: str, path: str) -> int:
        if method in ("POST", "PUT", "PATCH"):
            for pattern, limit in rules:
                if pattern.match(path):
                    return limit
        return DEFAULT_CAP

    return cap


class BodyCapMiddleware:
    def __init__(self, app: ASGIApp, cap: Callable[[str, str], int]) -> None:
        self.app = app
        self.cap = cap

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cap = self.cap(scope["method"], scope["path"])
        declared = _content_length(scope)
        if declared is not None and declared > cap:
            await _refuse(send, BodyTooLarge(cap))
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > cap:
                    raise BodyTooLarge(cap)
            return message

        await self.app(scope, counted, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


async def _refuse(send: Send, exc: BodyTooLarge) -> None:
    body = json.dumps({"error": exc.detail, "detail": None}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [(b"content-type", b"application/json"), (b"connection", b"close")],
        }
    )
    await send({"type": "http.response.body", "body": body})
