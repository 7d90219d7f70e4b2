"""Scaling runs: start one (a job spec at several sizes in turn), list, show (long-poll), cancel."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File, Form, Query, UploadFile
from starlette.concurrency import run_in_threadpool

from phalanx import schemas
from server import access, commands, scaling
from server.api.deps import (
    MAX_ROW_ID,
    HoldsDep,
    RowId,
    SessionDep,
    SessionsDep,
    SettingsDep,
    UserDep,
    WaiterDep,
    holder,
)
from server.api.uploads import parse_spec
from server.models import ScalingRun
from server.wakeups import scaling_channel

router = APIRouter(prefix="/scaling", tags=["scaling"])


@router.post("", status_code=201, response_model=schemas.ScalingRunView)
def start_scaling(
    session: SessionDep,
    settings: SettingsDep,
    user: UserDep,
    spec: Annotated[str, Form(description="The JobSpec as JSON; its script reports a metric every step")],
    request: Annotated[str, Form(description="The ScalingRequest as JSON: nodes, steps, warmup")],
    bundle: Annotated[UploadFile | None, File(description="The workdir as .tar.gz")] = None,
) -> schemas.ScalingRunView:
    """Run the job at each size in `nodes` in turn, smallest first, each until rank 0 has reported
    `warmup + steps` steps; each size's throughput, efficiency and communication share follow."""
    job_spec = parse_spec(schemas.JobSpec, spec, "job spec")
    scaling_request = parse_spec(schemas.ScalingRequest, request, "scaling request")
    return commands.start_scaling(
        session, settings, user, job_spec, scaling_request, bundle.file if bundle is not None else None
    )


@router.get("", response_model=list[schemas.ScalingRunView])
def list_scaling(
    session: SessionDep,
    user: UserDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=MAX_ROW_ID)] = 0,
) -> list[schemas.ScalingRunView]:
    query = access.visible_scaling_runs(user).order_by(ScalingRun.id.desc()).limit(limit).offset(offset)
    with session.begin():
        return [scaling.view(session, run) for run in session.scalars(query)]


@router.get("/{run_id}", response_model=schemas.ScalingRunView)
async def show_scaling(
    run_id: RowId,
    sessions: SessionsDep,
    settings: SettingsDep,
    waiter: WaiterDep,
    holds: HoldsDep,
    user: UserDep,
    version: Annotated[
        str | None, Query(max_length=64, description="With `wait`: answer once the run's `version` differs")
    ] = None,
    wait: Annotated[float, Query(ge=0, le=300, description="Seconds to hold the request (long-poll)")] = 0.0,
) -> schemas.ScalingRunView:
    def load() -> schemas.ScalingRunView:
        with sessions() as session, session.begin():
            return scaling.view(session, access.scaling_run_for(session, user, run_id))

    if version is None or wait <= 0:
        return await run_in_threadpool(load)
    with holds.hold(holder(user), f"the long-poll on scaling run {run_id}"):
        return await waiter.until_changed(
            scaling_channel(run_id), load, lambda view: view.version != version, min(wait, settings.work_poll_seconds)
        )


@router.post("/{run_id}/cancel", response_model=schemas.ScalingRunView)
def cancel_scaling(run_id: RowId, session: SessionDep, user: UserDep) -> schemas.ScalingRunView:
    return commands.cancel_scaling(session, user, run_id)
