"""The FastAPI application: wiring only. Routes live in `server.api`, rules in `server.lifecycle`."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from prometheus_client import CollectorRegistry

from server import auth, dashboard
from server.api import agents, allocations, jobs, ops, studies, tokens
from server.api.deps import get_principal
from server.dashboard import render as dashboard_render
from server.db import check_schema, mark_server_start, session_factory, session_scope
from server.errors import install_handlers
from server.settings import Settings
from server.wakeups import Publisher, Waiter, wake_job_watchers_after_commit

WEB_DIR = Path(__file__).resolve().parent.parent / "web"
log = logging.getLogger("phalanx.server")


def _enqueuer(settings: Settings) -> Callable[..., None]:
    """Enqueue a task after a commit (IDs only). Every task is also run by a periodic pass, so a
    broker outage delays the work, never loses it."""
    from scheduler.celery_app import make_celery

    celery = make_celery(settings)

    def enqueue(task: str, *args: int) -> None:
        try:
            celery.send_task(task, args=list(args), expires=60, retry=False)
        except Exception as exc:
            log.warning("could not enqueue %s: %s", task, exc)

    return enqueue


def create_app(settings: Settings, *, enqueue: Callable[..., None] | None = None) -> FastAPI:
    """Build the app on a migrated database. Raises `SchemaOutOfDate` naming the fix otherwise."""
    check_schema(settings.database_url)
    with session_scope(settings.database_url) as session:
        generated = auth.bootstrap(session, settings.admin_token, settings.agent_token)
        mark_server_start(session)
    if generated:
        print(f"Phalanx admin token (shown once): {generated}", flush=True)

    waiter = Waiter(settings.redis_url, settings.wake_dir)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await waiter.start()
        yield
        await waiter.stop()

    app = FastAPI(
        title="Phalanx",
        version="0.1.0",
        description="Distributed PyTorch training: jobs, hyperparameter studies, agents, metrics and logs.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.sessions = session_factory(settings.database_url)
    app.state.token_cache = auth.TokenCache()
    app.state.publisher = Publisher(settings.redis_url, settings.wake_dir)
    app.state.waiter = waiter
    app.state.enqueue = enqueue or _enqueuer(settings)
    app.state.kick_scheduler = lambda: app.state.enqueue("phalanx.schedule")
    app.state.drive_study = lambda study_id: app.state.enqueue("phalanx.advance_study", study_id)
    app.state.study_objectives = {}  # study id -> the metrics it optimises (specs never change)
    wake_job_watchers_after_commit(app.state.sessions, app.state.publisher, drive_study=app.state.drive_study)
    app.state.templates = Jinja2Templates(directory=str(WEB_DIR / "templates"))
    app.state.templates.env.filters["age"] = dashboard_render.age
    registry = CollectorRegistry()
    registry.register(ops.StateCollector(app.state.sessions))
    app.state.prometheus = registry
    install_handlers(app)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse({"error": f"internal error ({type(exc).__name__}); see the server log"}, 500)

    # Authenticated by default: every /api/v1 route needs a bearer token.
    api = APIRouter(prefix="/api/v1", dependencies=[Depends(get_principal)])
    for module in (jobs, studies, agents, allocations, tokens):
        api.include_router(module.router)
    app.include_router(api)
    app.include_router(ops.router)
    app.mount("/static", StaticFiles(directory=WEB_DIR / "static"), name="static")
    for router in dashboard.ROUTERS:
        app.include_router(router)
    dashboard_render.install(app)
    return app
