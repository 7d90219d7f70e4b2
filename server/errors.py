"""Domain errors, and the one place that maps them to HTTP responses."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect


class PhalanxError(Exception):
    status_code = 400

    def __init__(self, message: str, detail: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail


class NotFound(PhalanxError):
    status_code = 404


class Unauthorized(PhalanxError):
    status_code = 401


class Forbidden(PhalanxError):
    status_code = 403


class Conflict(PhalanxError):
    status_code = 409


class TooLarge(PhalanxError):
    status_code = 413


class Unprocessable(PhalanxError):
    status_code = 422


class TooManyRequests(PhalanxError):
    """A cap on what one client (or all) may hold at once was met: retry after `retry_after` s."""

    status_code = 429

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class IllegalTransition(Conflict):
    """A state change its rule table refuses, or one that lost a race: the row moved (another
    request committed first) between the read and the compare-and-set write."""

    def __init__(self, kind: str, row_id: int, current: str, target: str, *, raced_from: str | None = None) -> None:
        if raced_from is None:
            message = f"{kind} {row_id} is {current} and cannot become {target}"
        else:
            message = (
                f"{kind} {row_id} became {current} while this request moved it from {raced_from}, "
                f"so it cannot become {target}; read it again and retry if that is still wanted"
            )
        super().__init__(message)
        self.kind, self.current, self.target = kind, current, target


log = logging.getLogger(__name__)
API_PREFIX = "/api/"


def install_handlers(app: FastAPI, pages: Callable[[Request, PhalanxError], Response] | None = None) -> None:
    """Domain errors become JSON under `/api/`, and pages elsewhere (`pages`: the dashboard's)."""

    @app.exception_handler(PhalanxError)
    async def _domain(request: Request, exc: PhalanxError) -> Response:
        if pages is not None and not request.url.path.startswith(API_PREFIX):
            response = pages(request, exc)
        else:
            headers = {"WWW-Authenticate": "Bearer"} if exc.status_code == 401 else None
            response = JSONResponse({"error": exc.message, "detail": exc.detail}, exc.status_code, headers=headers)
        if isinstance(exc, TooManyRequests):
            response.headers["Retry-After"] = str(exc.retry_after)
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        if errors and all(err.get("loc", ("",))[0] == "path" for err in errors):
            # a path naming no row that could exist (id 0, past 2^31, not a number) names nothing
            named = ", ".join(f"{err['loc'][-1]} {err.get('input')!s:.40}" for err in errors)
            return await _domain(request, NotFound(f"there is no {named}: no such row can exist"))
        problems = [
            {"field": ".".join(str(p) for p in err.get("loc", ()) if p != "body"), "problem": err.get("msg")}
            for err in errors
        ]
        summary = "; ".join(f"{p['field'] or 'body'}: {p['problem']}" for p in problems)
        return JSONResponse({"error": f"invalid request: {summary}", "detail": problems}, 422)

    @app.exception_handler(ClientDisconnect)
    async def _hung_up(request: Request, _: ClientDisconnect) -> Response:
        # Nobody reads this answer. Not an error of the server's: under load, thousands of clients
        # that time out would otherwise each cost a logged traceback (~10 ms of the one core each,
        # with 3.11's caret anchors), and the server spent its core logging instead of serving.
        log.debug("%s %s: the client hung up before its request was read", request.method, request.url.path)
        return Response(status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": str(exc.detail), "detail": None}, exc.status_code)
