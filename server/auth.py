"""Bearer tokens: hashing, lookup, and the first admin / agent tokens.

Tokens are random strings shown once; only their SHA-256 is stored. A token's kind ("user" or
"agent") decides which routes it may call.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from server.models import ApiToken, User

_CACHE_SECONDS = 30.0


@dataclass(frozen=True, slots=True)
class Principal:
    kind: str  # "user" | "agent"
    token_id: int
    name: str
    user_id: int | None
    is_admin: bool


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token(kind: str) -> str:
    return f"phx_{kind[0]}_{secrets.token_urlsafe(24)}"


class TokenCache:
    """Hot routes (metrics, logs, long-polls) must not pay a query per request to authenticate."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[float, Principal]] = {}

    def get(self, token_hash: str) -> Principal | None:
        with self._lock:
            entry = self._entries.get(token_hash)
        if entry and entry[0] > time.monotonic():
            return entry[1]
        return None

    def put(self, token_hash: str, principal: Principal) -> None:
        with self._lock:
            if len(self._entries) > 10_000:
                self._entries.clear()
            self._entries[token_hash] = (time.monotonic() + _CACHE_SECONDS, principal)


def lookup(session: Session, token: str) -> Principal | None:
    row = session.execute(
        select(ApiToken, User)
        .outerjoin(User, ApiToken.user_id == User.id)
        .where(ApiToken.token_hash == hash_token(token))
    ).first()
    if row is None:
        return None
    api_token, user = row
    return Principal(
        kind=api_token.kind,
        token_id=api_token.id,
        name=user.name if user else api_token.name,
        user_id=user.id if user else None,
        is_admin=bool(user and user.is_admin),
    )


def mint(session: Session, kind: str, name: str, user_id: int | None, token: str | None = None) -> tuple[int, str]:
    token = token or new_token(kind)
    row = ApiToken(kind=kind, name=name, token_hash=hash_token(token), user_id=user_id)
    session.add(row)
    session.flush()
    return row.id, token


def bootstrap(session: Session, admin_token: str | None, agent_token: str | None) -> str | None:
    """Create the admin user on first start and accept configured tokens.

    Returns the admin token when one was generated (it is printed once and never stored in clear).
    """
    generated = None
    admin = session.execute(select(User).where(User.name == "admin")).scalar_one_or_none()
    if admin is None:
        admin = User(name="admin", is_admin=True)
        session.add(admin)
        session.flush()
        if admin_token is None:
            admin_token = generated = new_token("user")
    for kind, token, owner in (("user", admin_token, admin.id), ("agent", agent_token, None)):
        if (
            token
            and session.execute(select(ApiToken.id).where(ApiToken.token_hash == hash_token(token))).first() is None
        ):
            mint(session, kind, "admin" if kind == "user" else "agents", owner, token)
    return generated
