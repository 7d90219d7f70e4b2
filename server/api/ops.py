"""Operational routes: health (unauthenticated, up or down and nothing more), Prometheus metrics
(any user's token: job counts are the cluster's business), the dashboard's index page."""

from __future__ import annotations

import logging
from collections.abc import Iterator

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session, sessionmaker

from server.api.deps import UserDep, get_services, get_sessions
from server.holds import HeldRequests
from server.models import Agent, Job

router = APIRouter(include_in_schema=False)
log = logging.getLogger(__name__)


class StateCollector(Collector):
    """Job and agent counts by state, read from the database at scrape time."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self._sessions = sessions

    def collect(self) -> Iterator[GaugeMetricFamily]:
        jobs = GaugeMetricFamily("phalanx_jobs", "Jobs by state", labels=["state"])
        agents = GaugeMetricFamily("phalanx_agents", "Agents by state", labels=["state"])
        with self._sessions() as session:
            for state, count in session.execute(select(Job.state, func.count()).group_by(Job.state)):
                jobs.add_metric([state], count)
            for state, count in session.execute(select(Agent.state, func.count()).group_by(Agent.state)):
                agents.add_metric([state], count)
        yield jobs
        yield agents


class HeldCollector(Collector):
    """Requests this server process holds open (long-polls, SSE streams) by kind of holder: each
    replica reports its own."""

    def __init__(self, holds: HeldRequests) -> None:
        self._holds = holds

    def collect(self) -> Iterator[GaugeMetricFamily]:
        held = GaugeMetricFamily(
            "phalanx_held_requests", "Requests this server process holds open, by kind of holder", labels=["kind"]
        )
        for kind, count in sorted(self._holds.by_kind().items()):
            held.add_metric([kind], count)
        yield held


@router.get("/healthz")
def healthz(request: Request) -> JSONResponse:
    try:
        with get_sessions(request)() as session:
            session.execute(text("SELECT 1"))
    except Exception as exc:  # the health check reports, never raises; the why goes to the log only
        log.warning("health check: the database does not answer: %s", exc)
        return JSONResponse({"status": "unhealthy"}, 503)
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
def prometheus(request: Request, _: UserDep) -> Response:
    registry = get_services(request).prometheus
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/", response_class=HTMLResponse)
def index(request: Request) -> HTMLResponse:
    return get_services(request).templates.TemplateResponse(request, "index.html", {"title": "Phalanx"})
