"""The app's services, typed, and the dependency aliases every router and page uses: settings,
sessions, the waiter, the task queue, and who is calling."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated, TypeVar

from fastapi import Depends, FastAPI, Path, Query, Request
from fastapi.templating import Jinja2Templates
from prometheus_client import CollectorRegistry
from sqlalchemy.orm import Session, sessionmaker

from phalanx.schemas import NUL_FREE
from server.api.admission import AgentBacklog
from server.auth import Principal, TokenCache, hash_token, lookup
from server.errors import Forbidden, Unauthorized
from server.heartbeats import HeartbeatBatcher
from server.holds import HeldRequests
from server.metric_batches import MetricWriter
from server.settings import Settings
from server.token_lookups import TokenLookups
from server.wakeups import Enqueue, Waiter

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Services:
    """Everything a request may need besides its own input, built once by `create_app`. Sessions
    from `sessions` carry out the wake-ups and tasks they noted after each commit."""

    settings: Settings
    sessions: sessionmaker[Session]
    waiter: Waiter
    enqueue: Enqueue
    templates: Jinja2Templates
    prometheus: CollectorRegistry
    holds: HeldRequests  # streams and long-polls held open, capped
    heartbeats: HeartbeatBatcher  # agents' heartbeats, written in batches
    token_cache: TokenCache
    # Token lookups, in groups, on a thread of their own (`auth_thread`): behind the routes' worker
    # threads, all of them waiting on row locks while attempts end by the hundred, a heartbeat
    # whose token had just left the cache waited past the agent's timeout, and the agent was
    # declared lost.
    token_lookups: TokenLookups
    auth_thread: ThreadPoolExecutor
    # The agents' and ranks' calls run on threads of their own (`in_agent_thread`), never ahead of
    # a person's request on the worker threads.
    agent_threads: ThreadPoolExecutor
    # what waits for or runs on them: past a limit, the door refuses more (`server/api/admission.py`)
    agent_backlog: AgentBacklog
    # the ranks' metric batches, written in groups on those threads and counted in that backlog
    metric_writer: MetricWriter


async def in_agent_thread(services: Services, work: Callable[[], T]) -> T:
    """`work` on the agents' threads (`Services.agent_threads`): a call of an agent or a rank."""
    services.agent_backlog.calls += 1
    try:
        return await asyncio.get_running_loop().run_in_executor(services.agent_threads, work)
    finally:
        services.agent_backlog.calls -= 1


def install_services(app: FastAPI, services: Services) -> None:
    app.state.services = services


def get_services(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


def get_settings(request: Request) -> Settings:
    return get_services(request).settings


def get_sessions(request: Request) -> sessionmaker[Session]:
    return get_services(request).sessions


def get_session(request: Request) -> Iterator[Session]:
    """A session with no transaction begun: the command or route owns `with session.begin():`."""
    with get_sessions(request)() as session:
        yield session


def get_waiter(request: Request) -> Waiter:
    return get_services(request).waiter


def get_holds(request: Request) -> HeldRequests:
    return get_services(request).holds


def holder(principal: Principal) -> str:
    """Who holds a stream or a user's long-poll, as the cap counts (and names) them."""
    return f"user {principal.name}" if principal.kind == "user" else f"{principal.kind} token {principal.token_id}"


async def get_principal(request: Request) -> Principal:
    """Who calls. A token seen in the last few seconds costs no thread and no query: with 1,000
    agents, their heartbeats and long-polls must not queue for the worker threads the routes use."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("missing bearer token: set PHALANX_TOKEN (or pass Authorization: Bearer <token>)")
    services = get_services(request)
    principal = cached_principal(services, token)
    if principal is None:
        principal = await services.token_lookups.principal(token)
    if principal is None:
        raise Unauthorized("the bearer token is not valid: check PHALANX_TOKEN, or ask an admin for a new one")
    return principal


def cached_principal(services: Services, token: str) -> Principal | None:
    """Who `token` belongs to, if this process has it cached; None: look it up
    (`Services.token_lookups`). A token in use is looked up again before it leaves the cache, and
    no request waits for that (`TokenCache.get_refreshing`)."""
    principal, due = services.token_cache.get_refreshing(hash_token(token))
    if due:
        services.token_lookups.refresh(token)
    return principal


def authenticate(request: Request, token: str) -> Principal | None:
    """Who `token` belongs to (cached for a few seconds), or None for an unknown token."""
    cache = get_services(request).token_cache
    token_hash = hash_token(token)
    principal = cache.get(token_hash)
    if principal is None:
        with get_sessions(request)() as session:
            principal = lookup(session, token)
        if principal is not None:
            cache.put(token_hash, principal)
    return principal


async def require_user(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
    if principal.kind != "user":
        raise Forbidden("this route needs a user token; an agent token was given")
    return principal


async def require_admin(principal: Annotated[Principal, Depends(require_user)]) -> Principal:
    if not principal.is_admin:
        raise Forbidden("this route needs an admin token")
    return principal


async def require_reporter(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
    """An agent, or a rank with its allocation's own token (which allocation: `access.may_report_for`)."""
    if principal.kind not in ("agent", "rank"):
        raise Forbidden("this route is for agents and the ranks they start; a user token was given")
    return principal


async def require_agent(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
    if principal.kind != "agent":
        raise Forbidden("this route is for agents and their workers; use an agent token (PHALANX_AGENT_TOKEN)")
    return principal


# Ids as the database stores them: a path naming one outside these ranges names no row (404, see
# `errors.py`), instead of reaching PostgreSQL as "integer out of range".
MAX_ROW_ID = 2**31 - 1
MAX_BIG_ID = 2**63 - 1
RowId = Annotated[int, Path(ge=1, le=MAX_ROW_ID)]
Step = Annotated[int, Path(ge=0, le=MAX_BIG_ID)]
RankNumber = Annotated[int, Path(ge=0, le=1_000_000, description="A rank of the job (0 to its world size - 1)")]
# A metric's name to filter by: what a stored one can be (`schemas.MetricRecord`), or 422
MetricNameQuery = Annotated[str | None, Query(min_length=1, max_length=128, pattern=NUL_FREE)]


# FastAPI runs a plain `def` dependency on a worker thread: two thread hops a request for a lookup
# in a dict. These are the same lookups as coroutines (and `require_*` above are coroutines too).
async def _services(request: Request) -> Services:
    return get_services(request)


async def _settings(request: Request) -> Settings:
    return get_settings(request)


async def _sessions(request: Request) -> sessionmaker[Session]:
    return get_sessions(request)


async def _waiter(request: Request) -> Waiter:
    return get_waiter(request)


async def _holds(request: Request) -> HeldRequests:
    return get_holds(request)


ServicesDep = Annotated[Services, Depends(_services)]
SettingsDep = Annotated[Settings, Depends(_settings)]
SessionDep = Annotated[Session, Depends(get_session)]  # a thread: closing a session may roll back
SessionsDep = Annotated[sessionmaker[Session], Depends(_sessions)]
WaiterDep = Annotated[Waiter, Depends(_waiter)]
HoldsDep = Annotated[HeldRequests, Depends(_holds)]
UserDep = Annotated[Principal, Depends(require_user)]
AdminDep = Annotated[Principal, Depends(require_admin)]
AgentDep = Annotated[Principal, Depends(require_agent)]
ReporterDep = Annotated[Principal, Depends(require_reporter)]
