"""Dashboard sessions and CSRF protection.

Contract: the session cookie holds the user's API token (http-only, SameSite=Strict, Secure over
HTTPS), so a page knows exactly what the REST API would know and signing out only drops the
cookie. CSRF: double submit. Every page sets a random `phalanx_csrf` cookie (SameSite=Strict) once
and puts its value into every form; a POST whose form field differs from the cookie is refused
with 403, whatever session it has. Another site can neither read nor set our cookies.
"""

from __future__ import annotations

import hmac
import secrets
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response

from server.api.deps import authenticate
from server.auth import Principal

SESSION_COOKIE = "phalanx_session"
CSRF_COOKIE = "phalanx_csrf"
R = TypeVar("R", bound=Response)


def current_user(request: Request) -> Principal | None:
    """The signed-in user, or None (no cookie, an unknown token, or an agent's token)."""
    token = request.cookies.get(SESSION_COOKIE, "")
    principal = authenticate(request, token) if token else None
    return principal if principal is not None and principal.kind == "user" else None


def csrf_token(request: Request) -> str:
    """This browser's CSRF token (a new one when it has none; `remember_csrf` sets the cookie)."""
    token = request.cookies.get(CSRF_COOKIE) or getattr(request.state, "new_csrf", None)
    if not token:
        token = secrets.token_urlsafe(32)
        request.state.new_csrf = token
    return str(token)


def remember_csrf(request: Request, response: R) -> R:
    new = getattr(request.state, "new_csrf", None)
    if new:
        response.set_cookie(CSRF_COOKIE, new, httponly=True, samesite="strict", secure=_https(request))
    return response


def csrf_ok(request: Request, submitted: str | None) -> bool:
    expected = request.cookies.get(CSRF_COOKIE, "")
    return bool(expected and submitted) and hmac.compare_digest(expected, submitted or "")


def sign_in(request: Request, response: Response, token: str) -> Response:
    response.set_cookie(SESSION_COOKIE, token, httponly=True, samesite="strict", secure=_https(request))
    return response


def sign_out(response: Response) -> Response:
    response.delete_cookie(SESSION_COOKIE)
    return response


def _https(request: Request) -> bool:
    return request.url.scheme == "https"
