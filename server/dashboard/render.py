"""What every dashboard page shares: rendering, and its three refusals, raised from anywhere in a
route and turned into pages in one place: no session (→ /login and back), a forged form (403),
an unknown or foreign id (404)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import Depends, FastAPI, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse

from server.api.deps import get_services
from server.auth import Principal
from server.dashboard.session import csrf_ok, csrf_token, current_user, remember_csrf
from server.errors import PhalanxError


class SignInRequired(Exception):
    pass


class CsrfRejected(Exception):
    pass


class PageNotFound(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def age(since: datetime) -> str:
    """How long ago a naive-UTC time was, as a person says it: "42 s", "5 min", "3 h", "2 d"."""
    seconds = max((datetime.now(UTC).replace(tzinfo=None) - since).total_seconds(), 0.0)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{int(seconds // size)} {unit}"
    return f"{int(seconds)} s"


def render(request: Request, template: str, status: int = 200, **context: Any) -> HTMLResponse:
    context = {"user": current_user(request), "csrf_token": csrf_token(request), **context}
    response: HTMLResponse = get_services(request).templates.TemplateResponse(
        request, template, context, status_code=status
    )
    return remember_csrf(request, response)


TITLES = {403: "Forbidden", 404: "Not found", 409: "Conflict", 413: "Too large", 422: "Cannot be done"}


def error_page(request: Request, exc: PhalanxError) -> HTMLResponse:
    """A domain error met on a page (an id the user cannot see, ...), as a page with its status."""
    title = TITLES.get(exc.status_code, "Refused")
    return render(request, "error.html", exc.status_code, title=title, message=exc.message)


def signed_in(request: Request) -> Principal:
    user = current_user(request)
    if user is None:
        raise SignInRequired
    return user


def csrf_checked(request: Request, csrf_token: Annotated[str, Form()] = "") -> None:
    if not csrf_ok(request, csrf_token):
        raise CsrfRejected


SignedIn = Annotated[Principal, Depends(signed_in)]
CsrfChecked = Annotated[None, Depends(csrf_checked)]  # declare it after SignedIn: session first


def install(app: FastAPI) -> None:
    @app.exception_handler(SignInRequired)
    async def _sign_in(request: Request, _: SignInRequired) -> RedirectResponse:
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return RedirectResponse(f"/login?next={quote(target)}", status_code=303)

    @app.exception_handler(CsrfRejected)
    async def _forbidden(request: Request, _: CsrfRejected) -> HTMLResponse:
        message = "The form's CSRF token is missing or wrong. Reload the page and try again."
        return render(request, "error.html", 403, title="Forbidden", message=message)

    @app.exception_handler(PageNotFound)
    async def _not_found(request: Request, exc: PageNotFound) -> HTMLResponse:
        return render(request, "error.html", 404, title="Not found", message=exc.message)
