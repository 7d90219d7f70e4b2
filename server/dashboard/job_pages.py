"""The jobs table, a job's page (its kill and profile buttons), its logs, its checkpoints' and
profile traces' downloads. Users see their own jobs; admins see all."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Annotated, Any

import orjson
import yaml
from fastapi import APIRouter, Form, Query, Request
from fastapi.responses import FileResponse, RedirectResponse, Response, StreamingResponse
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from phalanx import schemas
from server import access, checkpoints, commands, views
from server.api.deps import MAX_ROW_ID, RankNumber, RowId, SessionDep, SettingsDep, Step, get_settings
from server.auth import Principal
from server.dashboard import metric_series
from server.dashboard.render import CsrfChecked, PageNotFound, SignedIn, render
from server.errors import Conflict
from server.models import Job, JobEvent, LogLine

router = APIRouter(include_in_schema=False)
PAGE_SIZE = 50
LOG_TAIL = 200  # lines on a job's page; the logs page shows more


def jobs_version(session: Session) -> str:
    """Changes whenever a job is submitted or changes state (every transition records an event)."""
    newest_job = session.execute(select(func.max(Job.id))).scalar_one()
    newest_event = session.execute(select(func.max(JobEvent.id))).scalar_one()
    return f"{newest_job or 0}.{newest_event or 0}"


@router.get("/jobs", response_model=None)
def jobs_page(
    request: Request,
    session: SessionDep,
    user: SignedIn,
    state: Annotated[str, Query()] = "",
    q: Annotated[str, Query(max_length=64)] = "",
    before: Annotated[int | None, Query(ge=1, le=MAX_ROW_ID)] = None,
    after: Annotated[int | None, Query(ge=0, le=MAX_ROW_ID)] = None,
) -> Response:
    """A page of PAGE_SIZE jobs, newest first: the newest, or those just older than job `before`
    (the "older" link), or just newer than job `after` ("newer"). Keyset pages: each is one index
    range however deep, and a job submitted meanwhile shifts none of them."""
    chosen = state if state in schemas.JobState.__members__ else ""
    with session.begin():
        query = access.visible_jobs(user, access.member_teams(session, user))
        if chosen:
            query = query.where(Job.state == chosen)
        if q:
            query = query.where(Job.name.contains(q, autoescape=True))
        found: Sequence[views.JobRow] = []
        if after is not None:
            found = session.execute(query.where(Job.id > after).order_by(Job.id).limit(PAGE_SIZE + 1)).all()
            newer, older = len(found) > PAGE_SIZE, True
            found = found[:PAGE_SIZE][::-1]
        if len(found) < PAGE_SIZE:  # no cursor, `before`, or fewer than a page newer: the newest page
            newest = after is not None or before is None
            bounded = query if newest else query.where(Job.id < before)
            found = session.execute(bounded.order_by(Job.id.desc()).limit(PAGE_SIZE + 1)).all()
            newer, older = not newest, len(found) > PAGE_SIZE
            found = found[:PAGE_SIZE]
        rows = views.jobs(
            session, found, queue=views.queue_snapshot_for(session, found, get_settings(request), exact=False)
        )
        version = jobs_version(session)
    return render(
        request,
        "jobs.html",
        version=version,
        jobs=rows,
        states=list(schemas.JobState),
        state=chosen,
        q=q,
        newer=newer and bool(rows),
        older=older,
    )


@router.get("/jobs/{job_id}", response_model=None)
def job_page(job_id: RowId, request: Request, session: SessionDep, user: SignedIn) -> Response:
    return _job_page(job_id, request, session, user)


def _job_page(
    job_id: RowId, request: Request, session: Session, user: Principal, error: str | None = None, status: int = 200
) -> Response:
    with session.begin():
        row = access.job_for(session, user, job_id, loads=views.JOB_DETAIL_LOADS)
        may_change = access.may_change_job(session, user, row)
        may_hold = access.may_hold_job(session, user, row)
        job = views.job_detail(session, row, get_settings(request))
        saved = [views.checkpoint(c) for c in checkpoints.committed(session, job_id)]
        log_cursor = session.execute(select(func.max(LogLine.id)).where(LogLine.job_id == job_id)).scalar_one() or 0
        tail = [views.log_record(r) for r in reversed(list(session.scalars(_log_query(job_id, None, LOG_TAIL))))]
    spec = job.spec.model_dump(mode="json")
    return render(
        request,
        "job.html",
        status,
        job=job,
        may_change=may_change,
        may_hold=may_hold,
        checkpoints=saved,
        error=error,
        log_tail=tail,
        log_cursor=log_cursor,
        ranks=list(range(job.spec.resources.nodes * job.spec.resources.slots_per_node)),
        hyperparameters=yaml.safe_dump(spec["hyperparameters"], sort_keys=False) if spec["hyperparameters"] else "",
        job_file=yaml.safe_dump(spec, sort_keys=False),
    )


@router.get("/jobs/{job_id}/chart-data", response_model=None)
def chart_data(
    job_id: RowId,
    session: SessionDep,
    user: SignedIn,
    points: Annotated[int, Query(ge=10, le=100_000)] = metric_series.MAX_POINTS,
) -> Response:
    """Every metric of the job as one series (x = step), LTTB-downsampled to `points`; `cursor`
    is where the page's live stream (`/jobs/{id}/events?metrics_after=`) carries on."""
    started = time.perf_counter()
    with session.begin():
        access.job_for(session, user, job_id)
        series, cursor = metric_series.load_series(session, job_id, points)
    body = orjson.dumps({"cursor": cursor, "series": [s.as_json() for s in series]})
    # Server-Timing: the browser's devtools (and the benchmark) see the server's share of a load
    timing = f"chart;dur={(time.perf_counter() - started) * 1000:.1f}"
    headers = {"Cache-Control": "no-store", "Server-Timing": timing}
    return Response(body, media_type="application/json", headers=headers)


@router.post("/jobs/{job_id}/profile", response_model=None)
def profile_action(
    job_id: RowId,
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    user: SignedIn,
    _: CsrfChecked,
    steps: Annotated[int, Form(ge=1, le=schemas.MAX_PROFILE_STEPS)] = 20,
) -> Response:
    """The Profile button: ask the running attempt's ranks for traces of their next `steps` steps
    (a refusal, such as one still recording, is shown on the job's page)."""
    try:
        profile = commands.request_profile(session, settings, user, job_id, schemas.ProfileRequest(steps=steps))
    except Conflict as exc:
        return _job_page(job_id, request, session, user, error=exc.message, status=409)
    return RedirectResponse(f"/jobs/{job_id}#profile-{profile.id}", status_code=303)


@router.get("/jobs/{job_id}/profiles/{profile_id}/ranks/{rank}/trace", response_model=None)
def profile_trace(
    job_id: RowId, profile_id: RowId, rank: RankNumber, session: SessionDep, settings: SettingsDep, user: SignedIn
) -> Response:
    """One rank's gzipped Chrome trace, for the download links of a job's page."""
    path = commands.profile_trace_path(session, settings, user, job_id, profile_id, rank)
    name = f"job-{job_id}-profile-{profile_id}-rank-{rank}.json.gz"
    return FileResponse(path, media_type="application/gzip", filename=name)


JOB_ACTIONS = ("kill", "pause", "resume", "hold", "release")


@router.post("/jobs/{job_id}/{action}", response_model=None)
def job_action(
    job_id: RowId, action: str, request: Request, session: SessionDep, user: SignedIn, _: CsrfChecked
) -> Response:
    """The kill, pause, resume, hold and release buttons; a refusal (the job is not in a state for
    it) is shown on the job's page."""
    if action not in JOB_ACTIONS:
        raise PageNotFound(f"There is no job action {action!r}; the buttons are {', '.join(JOB_ACTIONS)}.")
    try:
        if action == "kill":
            commands.kill_job(session, user, job_id)
        elif action == "pause":
            commands.pause_job(session, user, job_id)
        elif action == "resume":
            commands.resume_job(session, user, job_id)
        else:
            commands.hold_job(session, user, job_id, action == "hold")
    except Conflict as exc:
        return _job_page(job_id, request, session, user, error=exc.message, status=409)
    return RedirectResponse(f"/jobs/{job_id}", status_code=303)


def _log_query(job_id: int, rank: int | None, limit: int) -> Any:
    """The newest `limit` lines (newest first), every rank interleaved or one rank's."""
    query = select(LogLine).where(LogLine.job_id == job_id).order_by(LogLine.id.desc()).limit(limit)
    return query if rank is None else query.where(LogLine.rank == rank)


@router.get("/jobs/{job_id}/logs", response_model=None)
def logs_page(
    job_id: RowId,
    request: Request,
    session: SessionDep,
    user: SignedIn,
    rank: Annotated[str, Query()] = "",
    limit: Annotated[int, Query(ge=1, le=10_000)] = 2000,
) -> Response:
    """The newest `limit` lines, every rank interleaved or one rank's."""
    chosen = int(rank) if rank.isdigit() and len(rank) < 10 else None  # no rank is that high
    with session.begin():
        job = access.job_for(session, user, job_id)
        lines = [views.log_record(row) for row in reversed(list(session.scalars(_log_query(job_id, chosen, limit))))]
        ranks, name = list(range(job.nodes * job.slots_per_node)), job.name
        terminal = schemas.JobState(job.state).is_terminal
    cursor = max((line.id for line in lines), default=0)
    return render(
        request,
        "logs.html",
        job_id=job_id,
        name=name,
        lines=lines,
        ranks=ranks,
        rank=chosen,
        cursor=cursor,
        live=not terminal,
    )


@router.get("/jobs/{job_id}/checkpoints/{step}/archive", response_model=None)
def checkpoint_archive(job_id: RowId, step: Step, session: SessionDep, user: SignedIn) -> Response:
    """A checkpoint's files as .tar.gz, for the download links of a job's page."""
    path = commands.committed_checkpoint_path(session, user, job_id, step)
    headers = {"Content-Disposition": f'attachment; filename="job-{job_id}-step-{step}.tar.gz"'}
    return StreamingResponse(checkpoints.archive(path), media_type="application/gzip", headers=headers)
