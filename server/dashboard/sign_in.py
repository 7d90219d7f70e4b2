"""Sign in with a user token, and out."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from server.api.deps import authenticate
from server.dashboard.render import CsrfChecked, render
from server.dashboard.session import sign_in, sign_out

router = APIRouter(include_in_schema=False)
HOME = "/overview"


def _safe_next(target: str) -> str:
    """Only a path on this site (never //host or a scheme): no open redirect after signing in."""
    return target if target.startswith("/") and not target.startswith("//") else HOME


@router.get("/login", response_class=HTMLResponse)
def login_page(request: Request, next: str = HOME) -> HTMLResponse:
    return render(request, "login.html", next=_safe_next(next), error=None)


@router.post("/login", response_model=None)
def login(
    request: Request,
    _: CsrfChecked,
    token: Annotated[str, Form()] = "",
    next: Annotated[str, Form()] = HOME,
) -> Response:
    token = token.strip()
    principal = authenticate(request, token) if token else None
    if principal is None or principal.kind != "user":
        error = "That token is not a valid user token. Use the admin token `phalanx up` printed, or ask an admin."
        return render(request, "login.html", 401, next=_safe_next(next), error=error)
    return sign_in(request, RedirectResponse(_safe_next(next), status_code=303), token)


@router.post("/logout", response_model=None)
def logout(_: CsrfChecked) -> Response:
    return sign_out(RedirectResponse("/login", status_code=303))
