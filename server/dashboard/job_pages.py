"""The jobs table, a job's page (its kill button), its logs, its checkpoints' downloads.
Users see their own jobs; admins see all."""

from __future__ import annotations

from typing import Annotated, Any

import yaml
from fastapi import APIRouter, Query, Request
from fastapi.responses import RedirectResponse, Response, StreamingResponse
from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from phalanx import schemas
from server import checkpoints, lifecycle, views
from server.api.deps import SessionDep
from server.auth import Principal
from server.dashboard.render import CsrfChecked, PageNotFound, SignedIn, render
from server.errors import Conflict
from server.models import Checkpoint, Job, LogLine
from server.wakeups import agent_channel

router = APIRouter(include_in_schema=False)
PAGE_SIZE = 50


def visible_jobs(user: Principal) -> Any:
    query = select(Job).options(selectinload(Job.owner))
    return query if user.is_admin else query.where(Job.owner_id == user.user_id)


def visible_job(session: Session, user: Principal, job_id: int) -> Job:
    job: Job | None = session.scalars(visible_jobs(user).where(Job.id == job_id)).one_or_none()
    if job is None:
        raise PageNotFound(f"There is no job {job_id} that you can see.")
    return job


@router.get("/jobs", response_model=None)
def jobs_page(
    request: Request,
    session: SessionDep,
    user: SignedIn,
    state: Annotated[str, Query()] = "",
    q: Annotated[str, Query(max_length=64)] = "",
    page: Annotated[int, Query(ge=1)] = 1,
) -> Response:
    chosen = state if state in schemas.JobState.__members__ else ""
    query = visible_jobs(user).order_by(Job.id.desc()).limit(PAGE_SIZE + 1).offset((page - 1) * PAGE_SIZE)
    if chosen:
        query = query.where(Job.state == chosen)
    if q:
        query = query.where(Job.name.contains(q, autoescape=True))
    with session.begin():
        rows = [views.job(session, row) for row in session.scalars(query)]
    return render(
        request,
        "jobs.html",
        jobs=rows[:PAGE_SIZE],
        states=list(schemas.JobState),
        state=chosen,
        q=q,
        page=page,
        more=len(rows) > PAGE_SIZE,
    )


@router.get("/jobs/{job_id}", response_model=None)
def job_page(job_id: int, request: Request, session: SessionDep, user: SignedIn) -> Response:
    with session.begin():
        row = session.scalars(visible_jobs(user).where(Job.id == job_id).options(*views.JOB_DETAIL_LOADS)).one_or_none()
        if row is None:
            raise PageNotFound(f"There is no job {job_id} that you can see.")
        job = views.job_detail(session, row)
        saved = [views.checkpoint(c) for c in checkpoints.committed(session, job_id)]
    spec = job.spec.model_dump(mode="json")
    return render(
        request,
        "job.html",
        job=job,
        checkpoints=saved,
        hyperparameters=yaml.safe_dump(spec["hyperparameters"], sort_keys=False) if spec["hyperparameters"] else "",
        job_file=yaml.safe_dump(spec, sort_keys=False),
    )


@router.post("/jobs/{job_id}/kill", response_model=None)
def kill_job(job_id: int, request: Request, session: SessionDep, user: SignedIn, _: CsrfChecked) -> Response:
    woken: set[int] = set()
    try:
        with session.begin():
            visible_job(session, user, job_id)
            woken = lifecycle.kill_job(session, lifecycle.get_job(session, job_id, lock=True))
    except Conflict:
        pass  # it ended meanwhile: its page says how
    request.app.state.publisher.publish(agent_channel(a) for a in woken)
    return RedirectResponse(f"/jobs/{job_id}", status_code=303)


@router.get("/jobs/{job_id}/logs", response_model=None)
def logs_page(
    job_id: int,
    request: Request,
    session: SessionDep,
    user: SignedIn,
    rank: Annotated[str, Query()] = "",
    limit: Annotated[int, Query(ge=1, le=10_000)] = 2000,
) -> Response:
    """The newest `limit` lines, every rank interleaved or one rank's."""
    chosen = int(rank) if rank.isdigit() else None
    with session.begin():
        job = visible_job(session, user, job_id)
        query = select(LogLine).where(LogLine.job_id == job_id).order_by(LogLine.id.desc()).limit(limit)
        if chosen is not None:
            query = query.where(LogLine.rank == chosen)
        lines = [views.log_record(row) for row in reversed(list(session.scalars(query)))]
        ranks, name = list(range(job.nodes * job.slots_per_node)), job.name
    return render(request, "logs.html", job_id=job_id, name=name, lines=lines, ranks=ranks, rank=chosen)


@router.get("/jobs/{job_id}/checkpoints/{step}/archive", response_model=None)
def checkpoint_archive(job_id: int, step: int, session: SessionDep, user: SignedIn) -> Response:
    """A checkpoint's files as .tar.gz, for the download links of a job's page."""
    with session.begin():
        visible_job(session, user, job_id)
        row = session.scalars(
            select(Checkpoint).where(
                Checkpoint.job_id == job_id, Checkpoint.step == step, Checkpoint.state == checkpoints.COMMITTED
            )
        ).first()
        if row is None:
            raise PageNotFound(f"Job {job_id} has no checkpoint of step {step} that you can see.")
        path = row.path
    headers = {"Content-Disposition": f'attachment; filename="job-{job_id}-step-{step}.tar.gz"'}
    return StreamingResponse(checkpoints.archive(path), media_type="application/gzip", headers=headers)
