"""Domain errors, and the one place that maps them to HTTP responses."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from phalanx.schemas import JobState, StudyState


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


class IllegalTransition(Conflict):
    def __init__(self, job_id: int, current: JobState, target: JobState) -> None:
        super().__init__(f"job {job_id} is {current.value} and cannot become {target.value}")
        self.current, self.target = current, target


class IllegalStudyTransition(Conflict):
    def __init__(self, study_id: int, current: StudyState, target: StudyState) -> None:
        super().__init__(f"study {study_id} is {current.value} and cannot become {target.value}")
        self.current, self.target = current, target


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(PhalanxError)
    async def _domain(_: Request, exc: PhalanxError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status_code == 401 else None
        return JSONResponse({"error": exc.message, "detail": exc.detail}, exc.status_code, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = [
            {"field": ".".join(str(p) for p in err.get("loc", ()) if p != "body"), "problem": err.get("msg")}
            for err in exc.errors()
        ]
        summary = "; ".join(f"{p['field'] or 'body'}: {p['problem']}" for p in problems)
        return JSONResponse({"error": f"invalid request: {summary}", "detail": problems}, 422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": str(exc.detail), "detail": None}, exc.status_code)
