"""Jobs: submit, list, show, kill, logs, metrics, and the code bundle agents fetch."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlencode

from fastapi import APIRouter, File, Form, Query, Response, UploadFile
from fastapi.responses import FileResponse, StreamingResponse
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from phalanx import schemas
from server import access, checkpoints, commands, jobs, profiles, views
from server.api.deps import (
    MAX_BIG_ID,
    MAX_ROW_ID,
    AgentDep,
    HoldsDep,
    MetricNameQuery,
    RankNumber,
    RowId,
    SessionDep,
    SessionsDep,
    SettingsDep,
    Step,
    UserDep,
    WaiterDep,
    holder,
)
from server.api.uploads import parse_spec
from server.auth import Principal
from server.errors import NotFound
from server.models import Job, LogLine, Metric
from server.settings import Settings
from server.wakeups import job_channel, job_data_channel

router = APIRouter(prefix="/jobs", tags=["jobs"])
MAX_METRIC_POINTS = 100_000  # a page: ~10 MB of JSON


@router.post("", status_code=201, response_model=schemas.JobView)
def submit_job(
    session: SessionDep,
    settings: SettingsDep,
    user: UserDep,
    spec: Annotated[str, Form(description="The JobSpec as JSON")],
    bundle: Annotated[UploadFile | None, File(description="The workdir as .tar.gz")] = None,
) -> schemas.JobView:
    job_spec = parse_spec(schemas.JobSpec, spec, "job spec")
    return commands.submit_job(session, settings, user, job_spec, bundle.file if bundle is not None else None)


@router.get("", response_model=list[schemas.JobView])
async def list_jobs(
    sessions: SessionsDep,
    settings: SettingsDep,
    user: UserDep,
    response: Response,
    state: schemas.JobState | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    before: Annotated[
        int | None,
        Query(ge=1, le=MAX_ROW_ID, description="Only jobs with a smaller id: the next page after the job with this id"),
    ] = None,
    offset: Annotated[
        int, Query(ge=0, le=MAX_ROW_ID, description="Rows to skip (slow deep down: prefer `before`)")
    ] = 0,
) -> list[schemas.JobView]:
    """Jobs newest first (by id). Page with `before`: when more jobs follow, the `X-Next-Before`
    header holds the value for the next page (the last id shown) and `Link` its URL; a job
    submitted between two pages never shifts the later ones, as it would with `offset`."""

    def read() -> tuple[int | None, list[schemas.JobView]]:  # one worker thread (see server/api/agents.py)
        with sessions() as session, session.begin():
            query = access.visible_jobs(user, access.member_teams(session, user)).order_by(Job.id.desc())
            if before is not None:
                query = query.where(Job.id < before)
            if state is not None:
                query = query.where(Job.state == state.value)
            rows = session.execute(query.limit(limit + 1).offset(offset)).all()
            shown = rows[:limit]
            next_before = shown[-1].id if len(rows) > limit else None  # more follow: the last id shown
            return next_before, views.jobs(
                session, shown, queue=views.queue_snapshot_for(session, shown, settings, exact=False)
            )

    next_before, listed = await run_in_threadpool(read)
    if next_before is not None:
        params = {"limit": limit, "before": next_before, **({"state": state.value} if state is not None else {})}
        response.headers["X-Next-Before"] = str(next_before)
        response.headers["Link"] = f'</api/v1/jobs?{urlencode(params)}>; rel="next"'
    return listed


def _load_job_detail(session: Session, user: Principal, job_id: int, settings: Settings) -> schemas.JobDetail:
    with session.begin():
        job = access.job_for(session, user, job_id, loads=views.JOB_DETAIL_LOADS)
        return views.job_detail(session, job, settings)


@router.get("/{job_id}", response_model=schemas.JobDetail)
async def show_job(
    job_id: RowId,
    sessions: SessionsDep,
    settings: SettingsDep,
    waiter: WaiterDep,
    holds: HoldsDep,
    user: UserDep,
    state: Annotated[
        schemas.JobState | None, Query(description="With `wait`: answer once the job is no longer in this state")
    ] = None,
    wait: Annotated[
        float,
        Query(ge=0, le=300, description="Seconds to hold the request (long-poll; the server caps it)"),
    ] = 0.0,
) -> schemas.JobDetail:
    """The job with its attempts and latest metrics; with `state` and `wait`, hangs until its state
    differs from `state` (or `wait` passes), so watchers need not poll. A user holds a few such
    requests at once (429 past the cap, `server/holds.py`)."""

    def load() -> schemas.JobDetail:
        with sessions() as session:
            return _load_job_detail(session, user, job_id, settings)

    if state is None or wait <= 0:
        return await run_in_threadpool(load)
    with holds.hold(holder(user), f"the long-poll on job {job_id}"):
        return await waiter.until_changed(
            job_channel(job_id), load, lambda detail: detail.state is not state, min(wait, settings.work_poll_seconds)
        )


@router.post("/{job_id}/kill", response_model=schemas.JobView)
def kill_job(job_id: RowId, session: SessionDep, user: UserDep) -> schemas.JobView:
    return commands.kill_job(session, user, job_id)


@router.post("/{job_id}/hold", response_model=schemas.JobView)
def hold_job(job_id: RowId, session: SessionDep, user: UserDep) -> schemas.JobView:
    """Keep the job from being placed until released (an admin of its team, a cluster admin)."""
    return commands.hold_job(session, user, job_id, True)


@router.post("/{job_id}/release", response_model=schemas.JobView)
def release_job(job_id: RowId, session: SessionDep, user: UserDep) -> schemas.JobView:
    return commands.hold_job(session, user, job_id, False)


@router.post("/{job_id}/profiles", status_code=201, response_model=schemas.ProfileView)
def request_profile(
    job_id: RowId, body: schemas.ProfileRequest, session: SessionDep, settings: SettingsDep, user: UserDep
) -> schemas.ProfileView:
    """Ask every rank of the running attempt to record torch.profiler traces of its next `steps`
    optimizer steps. The ranks pick the request up with their next metric batch (models prepared
    with `ctx.prepare_model` send one every few seconds) and send their traces when done."""
    return commands.request_profile(session, settings, user, job_id, body)


@router.get("/{job_id}/profiles", response_model=list[schemas.ProfileView])
def list_profiles(job_id: RowId, session: SessionDep, user: UserDep) -> list[schemas.ProfileView]:
    """The job's profiles, newest first (it keeps its newest few)."""
    with session.begin():
        access.job_for(session, user, job_id)
        return profiles.job_profiles(session, job_id)


@router.get("/{job_id}/profiles/{profile_id}", response_model=schemas.ProfileView)
async def show_profile(
    job_id: RowId,
    profile_id: RowId,
    sessions: SessionsDep,
    settings: SettingsDep,
    waiter: WaiterDep,
    holds: HoldsDep,
    user: UserDep,
    answered: Annotated[
        int | None,
        Query(ge=0, le=1_000_000, description="With `wait`: answer once more ranks than this have answered"),
    ] = None,
    wait: Annotated[float, Query(ge=0, le=300, description="Seconds to hold the request (long-poll)")] = 0.0,
) -> schemas.ProfileView:
    """The profile: its state, and each rank that answered with its summary (or why it has no
    trace); with `answered` and `wait`, hangs until another rank answers or it stops recording."""

    def load() -> schemas.ProfileView:
        with sessions() as session, session.begin():
            access.job_for(session, user, job_id)
            return profiles.view(session, profiles.get_profile(session, job_id, profile_id))

    if answered is None or wait <= 0:
        return await run_in_threadpool(load)
    with holds.hold(holder(user), f"the long-poll on profile {profile_id}"):
        return await waiter.until_changed(
            job_data_channel(job_id),
            load,
            lambda view: len(view.ranks) != answered or view.state != "recording",
            min(wait, settings.work_poll_seconds),
        )


@router.delete("/{job_id}/profiles/{profile_id}", status_code=204)
def delete_profile(
    job_id: RowId, profile_id: RowId, session: SessionDep, settings: SettingsDep, user: UserDep
) -> Response:
    commands.delete_profile(session, settings, user, job_id, profile_id)
    return Response(status_code=204)


@router.get(
    "/{job_id}/profiles/{profile_id}/ranks/{rank}/trace",
    response_class=FileResponse,
    responses={200: {"content": {"application/gzip": {}}, "description": "The rank's Chrome trace, gzipped"}},
)
def download_trace(
    job_id: RowId, profile_id: RowId, rank: RankNumber, session: SessionDep, settings: SettingsDep, user: UserDep
) -> FileResponse:
    """One rank's trace as `.json.gz`: Perfetto (ui.perfetto.dev) and chrome://tracing open it."""
    path = commands.profile_trace_path(session, settings, user, job_id, profile_id, rank)
    return FileResponse(
        path,
        media_type="application/gzip",
        filename=f"job-{job_id}-profile-{profile_id}-rank-{rank}.json.gz",
    )


@router.get("/{job_id}/logs", response_model=list[schemas.LogRecord])
def job_logs(
    job_id: RowId,
    session: SessionDep,
    user: UserDep,
    rank: Annotated[int | None, Query(ge=0, le=MAX_ROW_ID)] = None,
    after: Annotated[int, Query(ge=0, le=MAX_BIG_ID, description="Only lines with an id above this")] = 0,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> list[schemas.LogRecord]:
    with session.begin():
        access.job_for(session, user, job_id)
        query = select(LogLine).where(LogLine.job_id == job_id, LogLine.id > after).order_by(LogLine.id).limit(limit)
        if rank is not None:
            query = query.where(LogLine.rank == rank)
        return [views.log_record(row) for row in session.scalars(query)]


@router.get("/{job_id}/metrics", response_model=list[schemas.MetricPoint])
def job_metrics(
    job_id: RowId,
    session: SessionDep,
    user: UserDep,
    name: MetricNameQuery = None,
    after: Annotated[int, Query(ge=0, le=MAX_BIG_ID, description="Only points with an id above this")] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_METRIC_POINTS)] = MAX_METRIC_POINTS,
    all_attempts: Annotated[
        bool, Query(description="Include the points of failed attempts that a resumed attempt re-did")
    ] = False,
) -> list[schemas.MetricPoint]:
    """The job's points in the order they were stored, a page of `limit` at most: the next page
    starts `after` the last point's id."""
    with session.begin():
        access.job_for(session, user, job_id)
        query = select(Metric).where(Metric.job_id == job_id, Metric.id > after).order_by(Metric.id).limit(limit)
        if not all_attempts:
            query = query.where(Metric.superseded.is_(False))
        if name is not None:
            query = query.where(Metric.name == name)
        return [
            schemas.MetricPoint(
                id=m.id,
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
def job_bundle(job_id: RowId, session: SessionDep, settings: SettingsDep, agent: AgentDep) -> FileResponse:
    """The job's code, for an agent that hosts one of its current nodes (403 for any other)."""
    with session.begin():
        access.may_fetch_bundle(session, agent, job_id)
        sha = jobs.get_job(session, job_id).bundle_sha256
    if sha is None:
        raise NotFound(f"job {job_id} was submitted without a code bundle")
    path = settings.bundle_dir / f"{sha}.tar.gz"
    if not path.exists():
        raise NotFound(f"the code bundle of job {job_id} is missing from {settings.bundle_dir}")
    return FileResponse(path, media_type="application/gzip")


@router.post("/{job_id}/pause", response_model=schemas.JobView)
def pause_job(job_id: RowId, session: SessionDep, user: UserDep) -> schemas.JobView:
    """SIGTERM the workers: `should_stop()` turns true, they checkpoint and exit. `resume` requeues."""
    return commands.pause_job(session, user, job_id)


@router.post("/{job_id}/resume", response_model=schemas.JobView)
def resume_job(job_id: RowId, session: SessionDep, user: UserDep) -> schemas.JobView:
    """Queue a paused job again; it starts from its newest checkpoint."""
    return commands.resume_job(session, user, job_id)


@router.get("/{job_id}/checkpoints", response_model=list[schemas.CheckpointView])
def list_checkpoints(job_id: RowId, session: SessionDep, user: UserDep) -> list[schemas.CheckpointView]:
    with session.begin():
        access.job_for(session, user, job_id)
        return [views.checkpoint(row) for row in checkpoints.committed(session, job_id)]


@router.get("/{job_id}/checkpoints/{step}/archive", response_class=StreamingResponse)
def download_checkpoint(job_id: RowId, step: Step, session: SessionDep, user: UserDep) -> StreamingResponse:
    """The checkpoint's files as a .tar.gz, read through fsspec from wherever they are stored."""
    path = commands.committed_checkpoint_path(session, user, job_id, step)
    return StreamingResponse(checkpoints.archive(path), media_type="application/gzip")
