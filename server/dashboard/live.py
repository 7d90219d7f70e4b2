"""Live updates: Server-Sent Event streams fed by the wake-up channels (Redis pub/sub, or the
data dir's inotify watch in the embedded mode). No page polls: a stream sleeps until its channel
is woken, then re-reads the database and sends what changed.

Streams (all need a signed-in session and see only what their user may see):
- `/jobs/{id}/events?metrics_after=C&logs_after=L`: `summary` when the job's state, events or
  checkpoints change (the page re-fetches its summary), `metrics` with the points stored after
  metric id C (JSON, `metric_series.NewPoints`), `logs` with the lines after log id L, and `end`
  once the job is terminal and everything is sent. A negative cursor leaves that kind out.
- `/events/jobs`: `changed` when any job changes state (the jobs table and the overview).
- `/studies/{id}/events`: `changed` when the study or one of its trials changes.

A wake-up starts a read at most every `MIN_INTERVAL` seconds: several batches that land together
cost one read and one event. Where neither Redis nor inotify is there, streams re-read every
`FALLBACK_INTERVAL` seconds instead. Each stream counts against its user's cap of held requests
(`server/holds.py`): past it, 429 with Retry-After (the page's EventSource tries again later).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Query, Request
from sqlalchemy import func, select
from sqlalchemy.orm import Session
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.concurrency import run_in_threadpool

from phalanx import schemas
from server import access, views
from server.api.deps import MAX_BIG_ID, RowId, get_holds, get_sessions, get_waiter, holder
from server.auth import Principal
from server.dashboard.job_pages import jobs_version
from server.dashboard.metric_series import points_after
from server.dashboard.render import SignedIn
from server.holds import HeldEventSource
from server.models import Checkpoint, Job, JobEvent, LogLine
from server.transitions import COMMITTED
from server.wakeups import JOBS_CHANNEL, Waiter, job_channel, job_data_channel, study_channel

router = APIRouter(include_in_schema=False)
MIN_INTERVAL = 0.3
FALLBACK_INTERVAL = 1.0
PING_SECONDS = 15
LOG_LINES_PER_EVENT = 2000


def _json(value: Any) -> str:
    return orjson.dumps(value).decode()


async def _woken(waiter: Waiter, event: asyncio.Event, last_read: float) -> None:
    """Until a channel behind `event` is woken, then no sooner than MIN_INTERVAL after the last read."""
    if waiter.polling:
        await asyncio.sleep(FALLBACK_INTERVAL)
    else:
        await event.wait()
    await asyncio.sleep(max(0.0, last_read + MIN_INTERVAL - time.monotonic()))


async def _changes(
    request: Request, channels: tuple[str, ...], version: Callable[[], str], since: str
) -> AsyncIterator[ServerSentEvent]:
    """`changed` whenever `version()` (read in a worker thread) differs from the last one seen,
    starting from `since`, the version the page was rendered at (so a change between the render
    and the stream's start is not missed)."""
    waiter = get_waiter(request)
    seen = since
    async with waiter.listen(*channels) as event:
        while True:
            event.clear()
            last_read = time.monotonic()
            now = await run_in_threadpool(version)
            if now != seen:
                seen = now
                yield ServerSentEvent(event="changed", data=_json(now))
            await _woken(waiter, event, last_read)


def _sessions(request: Request) -> Callable[[], Session]:
    return get_sessions(request)


def _stream(
    request: Request, user: Principal, what: str, generator: AsyncIterator[ServerSentEvent]
) -> EventSourceResponse:
    """The stream, holding one of the user's slots until it ends (429 now when none is free)."""
    holds, name = get_holds(request), holder(user)
    holds.acquire(name, what)
    try:
        # no-transform / X-Accel-Buffering: proxies must pass each event on at once
        headers = {"Cache-Control": "no-cache, no-transform", "X-Accel-Buffering": "no"}
        return HeldEventSource(generator, holds, name, ping=PING_SECONDS, headers=headers)
    except BaseException:
        holds.release(name)
        raise


@dataclass
class JobRead:
    summary: tuple[str, int, int]  # state, events, committed checkpoints: the page's summary changed
    terminal: bool
    metrics: dict[str, Any] | None
    logs: list[dict[str, Any]]
    more: bool  # a limit cut the points or the lines short: read again before sleeping or ending


def _read_job(sessions: Callable[[], Session], job_id: int, metrics_after: int, logs_after: int) -> JobRead:
    with sessions() as session, session.begin():
        state = session.execute(select(Job.state).where(Job.id == job_id)).scalar_one()
        events = session.execute(select(func.count()).where(JobEvent.job_id == job_id)).scalar_one()
        saved = session.execute(
            select(func.count()).where(Checkpoint.job_id == job_id, Checkpoint.state == COMMITTED)
        ).scalar_one()
        new = points_after(session, job_id, metrics_after) if metrics_after >= 0 else None
        logs = []
        if logs_after >= 0:
            rows = session.scalars(
                select(LogLine)
                .where(LogLine.job_id == job_id, LogLine.id > logs_after)
                .order_by(LogLine.id)
                .limit(LOG_LINES_PER_EVENT)
            )
            logs = [views.log_record(row).model_dump(mode="json") for row in rows]
    more = len(logs) == LOG_LINES_PER_EVENT or (new is not None and new.more)
    metrics = new.as_json() if new is not None else None
    return JobRead((state, events, saved), schemas.JobState(state).is_terminal, metrics, logs, more)


@router.get("/jobs/{job_id}/events", response_model=None)
async def job_events(
    job_id: RowId,
    request: Request,
    user: SignedIn,
    metrics_after: Annotated[int, Query(ge=-1, le=MAX_BIG_ID)] = -1,
    logs_after: Annotated[int, Query(ge=-1, le=MAX_BIG_ID)] = -1,
) -> EventSourceResponse:
    sessions = _sessions(request)
    await run_in_threadpool(_check_visible_job, sessions, user, job_id)
    waiter = get_waiter(request)

    async def stream() -> AsyncIterator[ServerSentEvent]:
        metrics_cursor, logs_cursor = metrics_after, logs_after
        summary: tuple[str, int, int] | None = None
        async with waiter.listen(job_channel(job_id), job_data_channel(job_id)) as event:
            while True:
                event.clear()  # before the read: a wake-up during it is not lost
                last_read = time.monotonic()
                read = await run_in_threadpool(_read_job, sessions, job_id, metrics_cursor, logs_cursor)
                if read.metrics is not None and read.metrics["points"]:
                    metrics_cursor = read.metrics["cursor"]
                    yield ServerSentEvent(event="metrics", data=_json(read.metrics))
                if read.logs:
                    logs_cursor = read.logs[-1]["id"]
                    yield ServerSentEvent(event="logs", data=_json(read.logs))
                if summary is not None and read.summary != summary:
                    yield ServerSentEvent(event="summary", data=_json({"state": read.summary[0]}))
                summary = read.summary
                if read.more:
                    continue
                if read.terminal:
                    # every point and line of a finished job is sent: the page closes the stream
                    yield ServerSentEvent(event="end", data=_json({"state": read.summary[0]}))
                    return
                await _woken(waiter, event, last_read)

    return _stream(request, user, f"the live stream of job {job_id}", stream())


def _check_visible_job(sessions: Callable[[], Session], user: Principal, job_id: int) -> None:
    with sessions() as session, session.begin():
        access.job_for(session, user, job_id)


@router.get("/events/jobs", response_model=None)
async def jobs_events(
    request: Request, user: SignedIn, since: Annotated[str, Query(max_length=40)] = ""
) -> EventSourceResponse:
    """`changed` when any job changes state; the pages re-fetch what their user may see.
    `since`: the `jobs_version` the page was rendered at."""
    sessions = _sessions(request)

    def version() -> str:
        with sessions() as session, session.begin():
            return jobs_version(session)

    return _stream(request, user, "the live stream of the jobs", _changes(request, (JOBS_CHANNEL,), version, since))


@router.get("/studies/{study_id}/events", response_model=None)
async def study_events(
    study_id: RowId, request: Request, user: SignedIn, since: Annotated[str, Query(max_length=80)] = ""
) -> EventSourceResponse:
    """`changed` when the study or a trial changes; `since`: the study's `version` on the page."""
    sessions = _sessions(request)

    def version() -> str:
        with sessions() as session, session.begin():
            return views.study_detail(session, access.study_for(session, user, study_id)).version

    await run_in_threadpool(version)  # 404 before the stream starts
    return _stream(
        request,
        user,
        f"the live stream of study {study_id}",
        _changes(request, (study_channel(study_id),), version, since),
    )
