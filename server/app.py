"""The FastAPI application: wiring only. Routes live in `server.api`, pages in `server.dashboard`,
the use cases they share in `server.commands`."""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path

import anyio.to_thread
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from prometheus_client import CollectorRegistry

from server import auth, dashboard, task_queue
from server.api import agents, allocations, docs, jobs, ops, queue, scaling, studies, teams, tokens, usage
from server.api.admission import AgentBacklog, NodeCallAdmission
from server.api.deps import Services, get_principal, install_services
from server.api.heartbeat_path import HeartbeatFastPath
from server.auth import TokenCache
from server.body_caps import BodyCapMiddleware, caps_for
from server.dashboard import render as dashboard_render
from server.db import check_schema, mark_server_start, session_factory, session_scope
from server.errors import install_handlers
from server.heartbeats import HeartbeatBatcher
from server.holds import HeldRequests
from server.metric_batches import MetricWriter
from server.queue_status import SnapshotProcess
from server.security_headers import SecurityHeadersMiddleware
from server.settings import Settings
from server.token_lookups import TokenLookups
from server.wakeups import Enqueue, Publisher, Waiter, publish_after_commit

WEB_DIR = Path(__file__).resolve().parent.parent / "web"
log = logging.getLogger("phalanx.server")


def freeze_startup_heap() -> None:
    """Take what the imports and the app's setup built out of the garbage collector's sight: call
    once the app is built, in the process that serves it.

    A full collection scans every object the process holds and stops the whole server meanwhile:
    ~160,000 objects after the imports alone, 130-200 ms a collection with the app's caches on
    this machine, and those pauses were the p99 of the list pages (`bench/bench_lists.py`). These
    objects live as long as the process, so no collection could free them anyway (`gc.freeze`)."""
    gc.collect()
    gc.freeze()


def create_app(settings: Settings, *, enqueue: Enqueue | None = None) -> FastAPI:
    """Build the app on a migrated database. Raises `SchemaOutOfDate` naming the fix otherwise.
    `enqueue`: where tasks go (tests pass their own); the scheduler's queue by default."""
    check_schema(settings.database_url)
    with session_scope(settings.database_url) as session:
        generated = auth.bootstrap(session, settings.admin_token, settings.agent_token)
        mark_server_start(session)
    if generated:
        print(f"Phalanx admin token (shown once): {generated}", flush=True)

    waiter = Waiter(settings.redis_url, settings.wake_dir)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        anyio.to_thread.current_default_thread_limiter().total_tokens = settings.worker_threads
        await waiter.start()
        SnapshotProcess.warm(settings)
        yield
        SnapshotProcess.stop()
        await waiter.stop()
        services.auth_thread.shutdown(wait=False)
        services.agent_threads.shutdown(wait=False)

    app = FastAPI(
        title="Phalanx",
        version="0.1.0",
        description="Distributed PyTorch training: jobs, hyperparameter studies, agents, metrics and logs.",
        lifespan=lifespan,
        # /docs and /redoc are server.api.docs's: vendored files, no inline script
        docs_url=None,
        redoc_url=None,
    )
    sessions = session_factory(settings.database_url)
    enqueue = enqueue or task_queue.enqueuer(
        task_queue.make_celery(settings), task_queue.PendingPasses.for_settings(settings)
    )
    publish_after_commit(sessions, Publisher(settings.redis_url, settings.wake_dir), enqueue)
    templates = Jinja2Templates(directory=str(WEB_DIR / "templates"))
    templates.env.filters["age"] = dashboard_render.age
    registry = CollectorRegistry()
    registry.register(ops.StateCollector(sessions))
    holds = HeldRequests(settings.max_held_requests_per_holder, settings.max_held_requests)
    registry.register(ops.HeldCollector(holds))
    token_cache = TokenCache()
    auth_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="auth")
    agent_threads = ThreadPoolExecutor(max_workers=settings.agent_threads, thread_name_prefix="agents")
    agent_backlog = AgentBacklog()
    services = Services(
        settings=settings,
        sessions=sessions,
        waiter=waiter,
        enqueue=enqueue,
        templates=templates,
        prometheus=registry,
        holds=holds,
        heartbeats=HeartbeatBatcher(settings.database_url),
        token_cache=token_cache,
        token_lookups=TokenLookups(sessions, token_cache, auth_thread),
        auth_thread=auth_thread,
        agent_threads=agent_threads,
        agent_backlog=agent_backlog,
        metric_writer=MetricWriter(sessions, agent_threads, agent_backlog),
    )
    install_services(app, services)
    install_handlers(app, pages=dashboard_render.error_page)
    # a body is capped before anything reads it, authentication included (the heartbeat path,
    # outside it, reads none)
    app.add_middleware(BodyCapMiddleware, cap=caps_for(settings))
    app.add_middleware(SecurityHeadersMiddleware)
    # before any of the app's work: a refused call must cost next to nothing (see its module)
    app.add_middleware(NodeCallAdmission, limit=settings.max_node_calls_in_flight, backlog=services.agent_backlog)
    app.add_middleware(HeartbeatFastPath, services=services)  # outermost: see its module

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse({"error": f"internal error ({type(exc).__name__}); see the server log"}, 500)

    # Authenticated by default: every /api/v1 route needs a bearer token.
    api = APIRouter(prefix="/api/v1", dependencies=[Depends(get_principal)])
    # Routes are matched in order, and matching costs a fifth of a heartbeat: the agents' and the
    # ranks' routes, called hundreds of times a second in a large cluster, come first.
    for module in (agents, allocations, jobs, studies, scaling, teams, tokens, queue, usage):
        api.include_router(module.router)
    app.include_router(api)
    app.include_router(ops.router)
    app.include_router(docs.router)
    app.mount("/static", StaticFiles(directory=WEB_DIR / "static"), name="static")
    for router in dashboard.ROUTERS:
        app.include_router(router)
    dashboard_render.install(app)
    return app
