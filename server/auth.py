"""Bearer tokens: hashing, lookup, and the first admin / agent tokens.

Tokens are random strings shown once; only their SHA-256 is stored. A token's kind ("user" or
"agent") decides which routes it may call. An attempt's ranks get a token of their own
(`rank_token`: the allocation id and its random credential), which may report metrics and
checkpoints for that allocation and nothing else. Each agent likewise gets its own token at its
first registration (`agent_token`), which acts for that agent only; the cluster's agent token
(PHALANX_AGENT_TOKEN) only registers. A token may expire (`expires_at`, by the database
clock); revoking deletes it. The tokens from PHALANX_ADMIN_TOKEN / PHALANX_AGENT_TOKEN are marked
`configured`: when the setting changes, the old value is retired at the next start.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import delete, or_, select
from sqlalchemy.orm import Session

from server.models import Agent, Allocation, ApiToken, User, utcnow

# How long a process trusts a token it looked up: a revoked or expired token stops working within
# this (at once in the process that revoked it).
_CACHE_SECONDS = 5.0
# An agent's own token is replaced only when the agent registers again, which the replica that
# registers it applies at once; other replicas may accept the old one this long. 5 s would cost
# a thousand agents 200 lookups a second. An attempt's credential never changes, and every route
# a rank may call refuses an ended attempt by its allocation's state, not by its credential.
_AGENT_AND_RANK_CACHE_SECONDS = 30.0
# The most tokens a process keeps. Over it, the expired go first, then the oldest: every attempt
# brings a credential, and a cache emptied whole when it filled (7,000 running attempts and a
# thousand agents) sent every agent's next heartbeat to a lookup at once, behind the ranks'; the
# heartbeats waited past the agents' timeout (`bench/bench_scale.py`).
MAX_CACHED_TOKENS = 50_000


@dataclass(frozen=True, slots=True)
class Principal:
    kind: str  # "user" | "agent" | "rank" (an allocation's own credential)
    token_id: int
    name: str
    user_id: int | None
    is_admin: bool
    allocation_id: int | None = None  # a rank's: the one allocation it may report for
    agent_id: int | None = None  # an agent's own token: the one agent it acts for (None: may only register)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token(kind: str) -> str:
    return f"phx_{kind[0]}_{secrets.token_urlsafe(24)}"


@dataclass(frozen=True, slots=True)
class _Cached:
    expires: float  # time.monotonic()
    principal: Principal
    seconds: float  # how long it was put for


class TokenCache:
    """Hot routes (metrics, logs, long-polls) must not pay a query per request to authenticate.

    A token in use is looked up again before it leaves the cache (`get_refreshing`), by a thread
    that no request waits for: at 1,000 agents, their tokens leaving the cache every 30 s sent 33
    heartbeats a second to wait for a lookup, behind the lookups of the ranks' credentials, and on
    a loaded database some waited past the agents' timeout."""

    def __init__(self, capacity: int = MAX_CACHED_TOKENS) -> None:
        self._lock = threading.Lock()
        self._capacity = capacity
        self._entries: OrderedDict[str, _Cached] = OrderedDict()  # oldest put first
        self._hashes: dict[int, set[str]] = {}  # token id -> its hashes here (an agent's old and new)
        self._refreshing: set[str] = set()  # hashes being looked up again

    def get(self, token_hash: str) -> Principal | None:
        return self.get_refreshing(token_hash, refresh=False)[0]

    def get_refreshing(self, token_hash: str, *, refresh: bool = True) -> tuple[Principal | None, bool]:
        """The token's principal while it is cached, and whether the caller is to look it up again
        now (in its last third of its time, once: `refreshed` or `refresh_failed` ends that)."""
        now = time.monotonic()
        with self._lock:
            entry = self._entries.get(token_hash)
            if entry is None or entry.expires <= now:
                return None, False
            due = refresh and entry.expires - now < entry.seconds / 3 and token_hash not in self._refreshing
            if due:
                self._refreshing.add(token_hash)
        return entry.principal, due

    def refreshed(self, token_hash: str, principal: Principal | None) -> None:
        """A lookup that `get_refreshing` asked for found `principal` (None: no longer valid). One
        whose token was forgotten meanwhile (revoked) puts nothing back."""
        with self._lock:
            if token_hash not in self._refreshing:
                return
            self._refreshing.discard(token_hash)
            if principal is None:
                self._drop(token_hash)
            else:
                self._put(token_hash, principal)

    def refresh_failed(self, token_hash: str) -> None:
        """The lookup failed (the database unreachable): the next use asks again."""
        with self._lock:
            self._refreshing.discard(token_hash)

    def forget(self, token_id: int) -> None:
        """A revoked token stops working in this process at once (others: within the cache time)."""
        with self._lock:
            for token_hash in self._hashes.pop(token_id, ()):
                self._entries.pop(token_hash, None)
                self._refreshing.discard(token_hash)

    def put(self, token_hash: str, principal: Principal) -> None:
        with self._lock:
            self._put(token_hash, principal)

    def __len__(self) -> int:
        return len(self._entries)

    def _put(self, token_hash: str, principal: Principal) -> None:
        seconds = _CACHE_SECONDS if principal.kind == "user" else _AGENT_AND_RANK_CACHE_SECONDS
        now = time.monotonic()
        self._drop(token_hash)
        self._entries[token_hash] = _Cached(now + seconds, principal, seconds)
        self._hashes.setdefault(principal.token_id, set()).add(token_hash)
        if len(self._entries) > self._capacity:
            self._evict(now)

    def _drop(self, token_hash: str) -> None:
        entry = self._entries.pop(token_hash, None)
        if entry is not None:
            hashes = self._hashes.get(entry.principal.token_id)
            if hashes is not None:
                hashes.discard(token_hash)
                if not hashes:
                    del self._hashes[entry.principal.token_id]

    def _evict(self, now: float) -> None:
        """Down to nine tenths of the capacity (a scan per put at the brim would cost a scan per
        lookup): the expired first, then the oldest put."""
        for token_hash in [key for key, entry in self._entries.items() if entry.expires <= now]:
            self._drop(token_hash)
        while len(self._entries) > self._capacity * 9 // 10:
            self._drop(next(iter(self._entries)))


RANK_TOKEN_PREFIX = "phx_r_"
AGENT_TOKEN_PREFIX = "phx_n_"


def agent_token_id(agent_id: int) -> int:
    """The `Principal.token_id` of an agent's own token (apart from every other token's)."""
    return -(2**31) - agent_id


def agent_principal(agent_id: int) -> Principal:
    """Who an agent's own token makes its caller."""
    return Principal(
        kind="agent",
        token_id=agent_token_id(agent_id),
        name=f"agent {agent_id}",
        user_id=None,
        is_admin=False,
        agent_id=agent_id,
    )


def agent_token(agent_id: int, secret: str) -> str:
    """The token an agent gets at its first registration: it names its agent and proves it."""
    return f"{AGENT_TOKEN_PREFIX}{agent_id}_{secret}"


def new_agent_secret() -> tuple[str, str]:
    """A fresh agent secret and the hash the server keeps of it."""
    secret = secrets.token_urlsafe(24)
    return secret, hash_token(secret)


def _split_named_token(token: str, prefix: str) -> tuple[int, str] | None:
    row_id, _, secret = token.removeprefix(prefix).partition("_")
    if not row_id.isdigit() or len(row_id) > 10 or int(row_id) > 2**31 - 1 or not secret:
        return None
    return int(row_id), secret


def agent_id_of(session: Session, token: str | None) -> int | None:
    """The agent `token` belongs to, if it is a valid agent token."""
    parts = _split_named_token(token, AGENT_TOKEN_PREFIX) if token and token.startswith(AGENT_TOKEN_PREFIX) else None
    if parts is None:
        return None
    agent_id, secret = parts
    stored = session.execute(select(Agent.credential_hash).where(Agent.id == agent_id)).scalar_one_or_none()
    if stored is None or not hmac.compare_digest(stored, hash_token(secret)):
        return None
    return agent_id


def rank_token(allocation_id: int, credential: str) -> str:
    """The token an attempt's ranks get (PHALANX_TOKEN): it names its allocation and proves it."""
    return f"{RANK_TOKEN_PREFIX}{allocation_id}_{credential}"


def _rank_principal(session: Session, token: str) -> Principal | None:
    parts = _split_named_token(token, RANK_TOKEN_PREFIX)
    if parts is None:
        return None
    allocation_id, credential = parts
    stored = session.execute(select(Allocation.credential).where(Allocation.id == allocation_id)).scalar_one_or_none()
    if stored is None or not hmac.compare_digest(stored, credential):
        return None
    return rank_principal(allocation_id)


def rank_principal(allocation_id: int) -> Principal:
    """Who an attempt's credential makes its caller."""
    return Principal(
        kind="rank",
        token_id=-allocation_id,
        name=f"allocation {allocation_id}",
        user_id=None,
        is_admin=False,
        allocation_id=allocation_id,
    )


def lookup_many(session: Session, tokens: Collection[str]) -> dict[str, Principal | None]:
    """`lookup` of every token, agents' tokens and attempts' credentials one statement per kind
    however many there are (the lookups of a thousand agents and seven thousand attempts)."""
    found: dict[str, Principal | None] = {}
    agents: dict[str, tuple[int, str]] = {}
    ranks: dict[str, tuple[int, str]] = {}
    for token in tokens:
        if token.startswith(AGENT_TOKEN_PREFIX) and (parts := _split_named_token(token, AGENT_TOKEN_PREFIX)):
            agents[token] = parts
        elif token.startswith(RANK_TOKEN_PREFIX) and (parts := _split_named_token(token, RANK_TOKEN_PREFIX)):
            ranks[token] = parts
        else:
            found[token] = lookup(session, token)
    if agents:
        ids = {agent_id for agent_id, _ in agents.values()}
        hashes = dict(session.execute(select(Agent.id, Agent.credential_hash).where(Agent.id.in_(ids))).all())
        for token, (agent_id, secret) in agents.items():
            stored = hashes.get(agent_id)
            valid = stored is not None and hmac.compare_digest(stored, hash_token(secret))
            found[token] = agent_principal(agent_id) if valid else None
    if ranks:
        ids = {allocation_id for allocation_id, _ in ranks.values()}
        credentials = dict(
            session.execute(select(Allocation.id, Allocation.credential).where(Allocation.id.in_(ids))).all()
        )
        for token, (allocation_id, credential) in ranks.items():
            stored = credentials.get(allocation_id)
            valid = stored is not None and hmac.compare_digest(stored, credential)
            found[token] = rank_principal(allocation_id) if valid else None
    return found


def lookup(session: Session, token: str) -> Principal | None:
    if token.startswith(RANK_TOKEN_PREFIX):
        return _rank_principal(session, token)
    if token.startswith(AGENT_TOKEN_PREFIX):
        agent_id = agent_id_of(session, token)
        return None if agent_id is None else agent_principal(agent_id)
    row = session.execute(
        select(ApiToken, User)
        .outerjoin(User, ApiToken.user_id == User.id)
        .where(
            ApiToken.token_hash == hash_token(token),
            or_(ApiToken.expires_at.is_(None), ApiToken.expires_at > utcnow()),
        )
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


def mint(
    session: Session,
    kind: str,
    name: str,
    user_id: int | None,
    token: str | None = None,
    *,
    expires_in_s: int | None = None,
    configured: bool = False,
) -> tuple[int, str]:
    token = token or new_token(kind)
    expires_at = None
    if expires_in_s is not None:
        expires_at = session.execute(select(utcnow() + timedelta(seconds=expires_in_s))).scalar_one()
    row = ApiToken(
        kind=kind,
        name=name,
        token_hash=hash_token(token),
        user_id=user_id,
        expires_at=expires_at,
        configured=configured,
    )
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
        if not token:
            continue
        # a rotated setting retires the value it replaces
        session.execute(
            delete(ApiToken).where(
                ApiToken.kind == kind, ApiToken.configured.is_(True), ApiToken.token_hash != hash_token(token)
            )
        )
        if session.execute(select(ApiToken.id).where(ApiToken.token_hash == hash_token(token))).first() is None:
            mint(session, kind, "admin" if kind == "user" else "agents", owner, token, configured=True)
    return generated
