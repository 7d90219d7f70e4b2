"""Jobs: submit, list, show, kill, logs, metrics, and the code bundle agents fetch."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File, Form, Query, Request, UploadFile
from fastapi.responses import FileResponse, StreamingResponse
from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload
from starlette.concurrency import run_in_threadpool

from phalanx import schemas
from server import checkpoints, lifecycle, views
from server.api.deps import AgentDep, PublisherDep, SessionDep, SessionsDep, SettingsDep, UserDep, WaiterDep
from server.api.uploads import parse_spec, refuse_oversized, store_bundle
from server.auth import Principal
from server.errors import NotFound
from server.models import Checkpoint, Job, LogLine, Metric
from server.settings import Settings
from server.wakeups import agent_channel, job_channel

router = APIRouter(prefix="/jobs", tags=["jobs"])


@router.post("", status_code=201, response_model=schemas.JobView)
def submit_job(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    user: UserDep,
    spec: Annotated[str, Form(description="The JobSpec as JSON")],
    bundle: Annotated[UploadFile | None, File(description="The workdir as .tar.gz")] = None,
) -> schemas.JobView:
    refuse_oversized(request, settings)
    return accept_job(request, session, settings, user, parse_spec(schemas.JobSpec, spec, "job spec"), bundle)


def accept_job(
    request: Request,
    session: Session,
    settings: Settings,
    user: Principal,
    spec: schemas.JobSpec,
    bundle: UploadFile | None,
) -> schemas.JobView:
    """Store the code bundle, queue the job (422 when no agents could ever host it, nothing
    created) and wake the scheduler: a submission from the API or the dashboard."""
    sha, size = store_bundle(settings, bundle) if bundle is not None else (None, 0)
    assert user.user_id is not None
    with session.begin():
        job = lifecycle.create_job(session, spec, user.user_id, sha, size)
        result = views.job(session, job, latest=False)
    request.app.state.kick_scheduler()
    return result


@router.get("", response_model=list[schemas.JobView])
def list_jobs(
    session: SessionDep,
    _: UserDep,
    state: schemas.JobState | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> list[schemas.JobView]:
    query = select(Job).options(selectinload(Job.owner)).order_by(Job.id.desc()).limit(limit).offset(offset)
    if state is not None:
        query = query.where(Job.state == state.value)
    with session.begin():
        return [views.job(session, row) for row in session.scalars(query)]


def _load_job_detail(session: Session, job_id: int) -> schemas.JobDetail:
    with session.begin():
        job = session.scalars(select(Job).where(Job.id == job_id).options(*views.JOB_DETAIL_LOADS)).one_or_none()
        if job is None:
            raise NotFound(f"job {job_id} does not exist; `phalanx jobs list` shows the jobs you can see")
        return views.job_detail(session, job)


@router.get("/{job_id}", response_model=schemas.JobDetail)
async def show_job(
    job_id: int,
    sessions: SessionsDep,
    settings: SettingsDep,
    waiter: WaiterDep,
    _: UserDep,
    state: Annotated[
        schemas.JobState | None, Query(description="With `wait`: answer once the job is no longer in this state")
    ] = None,
    wait: Annotated[float, Query(ge=0, le=300, description="Seconds to hold the request (long-poll)")] = 0.0,
) -> schemas.JobDetail:
    """The job with its attempts and latest metrics; with `state` and `wait`, hangs until its state
    differs from `state` (or `wait` passes), so watchers need not poll."""

    def load() -> schemas.JobDetail:
        with sessions() as session:
            return _load_job_detail(session, job_id)

    if state is None or wait <= 0:
        return await run_in_threadpool(load)
    return await waiter.until_changed(
        job_channel(job_id), load, lambda detail: detail.state is not state, min(wait, settings.work_poll_seconds)
    )


@router.post("/{job_id}/kill", response_model=schemas.JobView)
def kill_job(job_id: int, session: SessionDep, publisher: PublisherDep, _: UserDep) -> schemas.JobView:
    with session.begin():
        job = lifecycle.get_job(session, job_id, lock=True)
        woken = lifecycle.kill_job(session, job)
        result = views.job(session, job)
    publisher.publish(agent_channel(a) for a in woken)
    return result


@router.get("/{job_id}/logs", response_model=list[schemas.LogRecord])
def job_logs(
    job_id: int,
    session: SessionDep,
    _: UserDep,
    rank: int | None = None,
    after: Annotated[int, Query(ge=0, description="Only lines with an id above this")] = 0,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> list[schemas.LogRecord]:
    with session.begin():
        lifecycle.get_job(session, job_id)
        query = select(LogLine).where(LogLine.job_id == job_id, LogLine.id > after).order_by(LogLine.id).limit(limit)
        if rank is not None:
            query = query.where(LogLine.rank == rank)
        return [views.log_record(row) for row in session.scalars(query)]


@router.get("/{job_id}/metrics", response_model=list[schemas.MetricPoint])
def job_metrics(
    job_id: int,
    session: SessionDep,
    _: UserDep,
    name: str | None = None,
    limit: Annotated[int, Query(ge=1, le=1_000_000)] = 100_000,
    all_attempts: Annotated[
        bool, Query(description="Include the points of failed attempts that a resumed attempt re-did")
    ] = False,
) -> list[schemas.MetricPoint]:
    with session.begin():
        lifecycle.get_job(session, job_id)
        query = select(Metric).where(Metric.job_id == job_id).order_by(Metric.id).limit(limit)
        if not all_attempts:
            query = query.where(Metric.superseded.is_(False))
        if name is not None:
            query = query.where(Metric.name == name)
        return [
            schemas.MetricPoint(
                allocation_id=m.allocation_id,
                rank=m.rank,
                step=m.step,
                name=m.name,
                value=m.value,
                time=m.time,
            )
            for m in session.scalars(query)
        ]


@router.get("/{job_id}/bundle", response_class=FileResponse)
def job_bundle(job_id: int, session: SessionDep, settings: SettingsDep, _: AgentDep) -> FileResponse:
    with session.begin():
        job = lifecycle.get_job(session, job_id)
        sha = job.bundle_sha256
    if sha is None:
        raise NotFound(f"job {job_id} was submitted without a code bundle")
    path = settings.bundle_dir / f"{sha}.tar.gz"
    if not path.exists():
        raise NotFound(f"the code bundle of job {job_id} is missing from {settings.bundle_dir}")
    return FileResponse(path, media_type="application/gzip")


@router.post("/{job_id}/pause", response_model=schemas.JobView)
def pause_job(job_id: int, session: SessionDep, publisher: PublisherDep, _: UserDep) -> schemas.JobView:
    """SIGTERM the workers: `should_stop()` turns true, they checkpoint and exit. `resume` requeues."""
    with session.begin():
        job = lifecycle.get_job(session, job_id, lock=True)
        woken = lifecycle.pause_job(session, job)
        result = views.job(session, job)
    publisher.publish(agent_channel(a) for a in woken)
    return result


@router.post("/{job_id}/resume", response_model=schemas.JobView)
def resume_job(job_id: int, request: Request, session: SessionDep, _: UserDep) -> schemas.JobView:
    """Queue a paused job again; it starts from its newest checkpoint."""
    with session.begin():
        job = lifecycle.get_job(session, job_id, lock=True)
        lifecycle.resume_job(session, job)
        result = views.job(session, job)
    request.app.state.kick_scheduler()
    return result


@router.get("/{job_id}/checkpoints", response_model=list[schemas.CheckpointView])
def list_checkpoints(job_id: int, session: SessionDep, _: UserDep) -> list[schemas.CheckpointView]:
    with session.begin():
        lifecycle.get_job(session, job_id)
        return [views.checkpoint(row) for row in checkpoints.committed(session, job_id)]


@router.get("/{job_id}/checkpoints/{step}/archive", response_class=StreamingResponse)
def download_checkpoint(job_id: int, step: int, session: SessionDep, _: UserDep) -> StreamingResponse:
    """The checkpoint's files as a .tar.gz, read through fsspec from wherever they are stored."""
    with session.begin():
        lifecycle.get_job(session, job_id)
        row = session.scalars(
            select(Checkpoint).where(
                Checkpoint.job_id == job_id, Checkpoint.step == step, Checkpoint.state == checkpoints.COMMITTED
            )
        ).first()
        if row is None:
            raise NotFound(f"job {job_id} has no checkpoint at step {step}; `phalanx checkpoints list {job_id}`")
        path = row.path
    return StreamingResponse(checkpoints.archive(path), media_type="application/gzip")
