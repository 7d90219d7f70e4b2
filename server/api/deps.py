"""Dependency aliases shared by every router: settings, sessions, and who is calling."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session, sessionmaker

from server.auth import Principal, TokenCache, hash_token, lookup
from server.errors import Forbidden, TooLarge, Unauthorized
from server.settings import Settings
from server.wakeups import Publisher, Waiter


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_sessions(request: Request) -> sessionmaker[Session]:
    sessions: sessionmaker[Session] = request.app.state.sessions
    return sessions


def get_session(request: Request) -> Iterator[Session]:
    """A session with no transaction begun: the route owns `with session.begin():`."""
    with get_sessions(request)() as session:
        yield session


def get_publisher(request: Request) -> Publisher:
    publisher: Publisher = request.app.state.publisher
    return publisher


def get_waiter(request: Request) -> Waiter:
    waiter: Waiter = request.app.state.waiter
    return waiter


def get_principal(request: Request) -> Principal:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("missing bearer token: set PHALANX_TOKEN (or pass Authorization: Bearer <token>)")
    principal = authenticate(request, token)
    if principal is None:
        raise Unauthorized("the bearer token is not valid: check PHALANX_TOKEN, or ask an admin for a new one")
    return principal


def authenticate(request: Request, token: str) -> Principal | None:
    """Who `token` belongs to (cached for a few seconds), or None for an unknown token."""
    cache: TokenCache = request.app.state.token_cache
    token_hash = hash_token(token)
    principal = cache.get(token_hash)
    if principal is None:
        with get_sessions(request)() as session:
            principal = lookup(session, token)
        if principal is not None:
            cache.put(token_hash, principal)
    return principal


def require_user(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
    if principal.kind != "user":
        raise Forbidden("this route needs a user token; an agent token was given")
    return principal


def require_admin(principal: Annotated[Principal, Depends(require_user)]) -> Principal:
    if not principal.is_admin:
        raise Forbidden("this route needs an admin token")
    return principal


def require_agent(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
    if principal.kind != "agent":
        raise Forbidden("this route is for agents and their workers; use an agent token (PHALANX_AGENT_TOKEN)")
    return principal


async def read_capped_body(request: Request, limit: int, what: str) -> bytes:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"{what} is {int(declared)} bytes, over the {limit}-byte limit; send smaller batches")
    body = await request.body()
    if len(body) > limit:
        raise TooLarge(f"{what} is {len(body)} bytes, over the {limit}-byte limit; send smaller batches")
    return body


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_session)]
SessionsDep = Annotated[sessionmaker[Session], Depends(get_sessions)]
PublisherDep = Annotated[Publisher, Depends(get_publisher)]
WaiterDep = Annotated[Waiter, Depends(get_waiter)]
UserDep = Annotated[Principal, Depends(require_user)]
AdminDep = Annotated[Principal, Depends(require_admin)]
AgentDep = Annotated[Principal, Depends(require_agent)]
