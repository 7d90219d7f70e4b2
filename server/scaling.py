"""Scaling runs (`phalanx jobs scaling`, `POST /api/v1/scaling`): one job spec at several sizes
in turn, smallest first. The arithmetic is `phalanx.scaling`'s; this module drives the run.

Each size is a job of the run's owner and team, submitted when the previous size was measured.
`advance` is one step of the driver, run by the scheduler's periodic pass under the run's row lock
(so two scheduler processes never advance one run twice): it starts the next size's job, or, once
rank 0 of the current one has reported `warmup + steps` steps, waits a few seconds for the ranks'
communication figures (a gang reports them 2 s in, then every 5 s), kills the job and records its
point. A size whose job fails, reports too few steps, or does not get there within
`SIZE_TIMEOUT_S` fails the run, saying why; a cancel kills the size being measured.
"""

from __future__ import annotations

import dataclasses
import hashlib
from datetime import UTC

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from phalanx import schemas
from phalanx.scaling import Measured, ScalingError, points, rate_of, sized_spec
from phalanx.schemas import JobState, ScalingState
from server import jobs, views
from server.attempts import lock_job
from server.models import Allocation, Metric, ScalingRun, Team
from server.transitions import db_now, transition_scaling
from server.wakeups import note_scaling_change

SIZE_TIMEOUT_S = 900.0
FIGURES_WAIT_S = 8.0


def create_run(
    session: Session,
    spec: schemas.JobSpec,
    request: schemas.ScalingRequest,
    owner_id: int,
    team_id: int | None,
    bundle_sha256: str | None,
    bundle_size: int,
) -> ScalingRun:
    """A RUNNING run whose smallest size's job is queued (422 when some size could never fit)."""
    for size in request.nodes:
        jobs.check_fits(session, sized_spec(spec, size), f"the scaling run at {size} node(s)")
    run = ScalingRun(
        name=spec.name,
        owner_id=owner_id,
        team_id=team_id,
        state=ScalingState.RUNNING.value,
        spec=spec.model_dump(mode="json"),
        bundle_sha256=bundle_sha256,
        bundle_size=bundle_size,
        nodes=list(request.nodes),
        steps=request.steps,
        warmup=request.warmup,
        job_ids=[],
        measured=[],
    )
    session.add(run)
    session.flush()
    _start_next_size(session, run)
    return run


def _spec(run: ScalingRun) -> schemas.JobSpec:
    return schemas.JobSpec.model_validate(run.spec)


def _start_next_size(session: Session, run: ScalingRun) -> None:
    size = run.nodes[len(run.job_ids)]
    job = jobs.create_job(
        session, sized_spec(_spec(run), size), run.owner_id, run.bundle_sha256, run.bundle_size, team_id=run.team_id
    )
    run.job_ids = [*run.job_ids, job.id]
    run.size_started_at = db_now(session)
    run.reached_at = None
    note_scaling_change(session, run.id)


def advance(session: Session, run: ScalingRun) -> None:
    """One step of the driver for `run` (locked by the caller)."""
    if run.state != ScalingState.RUNNING.value:
        return
    index = len(run.measured)
    if len(run.job_ids) <= index:
        _start_next_size(session, run)
        return
    size, job = run.nodes[index], lock_job(session, run.job_ids[index])
    now = db_now(session)
    state = JobState(job.state)
    target = run.warmup + run.steps
    latest = session.scalar(select(func.max(Allocation.latest_step)).where(Allocation.job_id == job.id))
    reached = latest is not None and latest >= target
    if not reached and state is not JobState.COMPLETED:  # a completed job is measured on what it has
        if state.is_terminal:
            why = job.failure_reason or "see its logs"
            _fail(session, run, f"{size} node(s): job {job.id} ended {state.value}: {why}")
        elif run.size_started_at is not None and (now - run.size_started_at).total_seconds() > SIZE_TIMEOUT_S:
            jobs.kill_job(session, job, f"scaling run {run.id}: step {target} not reached in time")
            _fail(session, run, f"{size} node(s): job {job.id} did not reach step {target} in {SIZE_TIMEOUT_S:.0f} s")
        return
    world = size * _spec(run).resources.slots_per_node
    communication = views.communication(session, job)
    if not state.is_terminal and world > 1 and communication is None:
        if run.reached_at is None:
            run.reached_at = now
            return
        if (now - run.reached_at).total_seconds() < FIGURES_WAIT_S:
            return
    if not state.is_terminal:
        jobs.kill_job(session, job, f"scaling run {run.id}: step {target} reached and measured")
    try:
        rate = rate_of(job.id, _rank0_step_times(session, job.id, run.warmup, target), run.warmup, run.steps)
    except ScalingError as exc:
        _fail(session, run, f"{size} node(s): {exc}")
        return
    measured = Measured(
        nodes=size,
        world_size=world,
        job_id=job.id,
        steps_per_second=rate,
        comm_fraction=None if communication is None else communication.comm_fraction,
        bytes_per_step=None if communication is None else communication.bytes_per_step,
    )
    run.measured = [*run.measured, dataclasses.asdict(measured)]
    note_scaling_change(session, run.id)
    if len(run.measured) == len(run.nodes):
        transition_scaling(session, run, ScalingState.COMPLETED, f"{len(run.nodes)} sizes measured")
    else:
        _start_next_size(session, run)


def _rank0_step_times(session: Session, job_id: int, first: int, last: int) -> dict[int, float]:
    """When rank 0 first reported each step in `first..last` (its own clock, unix seconds)."""
    rows = session.execute(
        select(Metric.step, func.min(Metric.time))
        .where(Metric.job_id == job_id, Metric.rank == 0, Metric.step >= first, Metric.step <= last)
        .group_by(Metric.step)
    )
    return {step: when.replace(tzinfo=UTC).timestamp() for step, when in rows}


def _fail(session: Session, run: ScalingRun, reason: str) -> None:
    transition_scaling(session, run, ScalingState.FAILED, reason)


def cancel_run(session: Session, run: ScalingRun) -> None:
    """CANCELLED, and the size being measured is killed (409 once the run ended)."""
    transition_scaling(session, run, ScalingState.CANCELLED, "cancelled by user")
    if len(run.job_ids) > len(run.measured):
        job = lock_job(session, run.job_ids[-1])
        if not JobState(job.state).is_terminal:
            jobs.kill_job(session, job, f"scaling run {run.id} cancelled")


def running_run_ids(session: Session) -> list[int]:
    return list(session.scalars(select(ScalingRun.id).where(ScalingRun.state == ScalingState.RUNNING.value)))


def lock_running(session: Session, run_id: int) -> ScalingRun | None:
    """The run, locked, unless another pass holds it (SKIP LOCKED) or it ended."""
    return session.scalars(
        select(ScalingRun)
        .where(ScalingRun.id == run_id, ScalingRun.state == ScalingState.RUNNING.value)
        .with_for_update(skip_locked=True)
    ).first()


def view(session: Session, run: ScalingRun) -> schemas.ScalingRunView:
    measured = [Measured(**m) for m in run.measured]
    team = session.get(Team, run.team_id) if run.team_id is not None else None
    measuring = (
        run.nodes[len(run.measured)]
        if run.state == ScalingState.RUNNING.value and len(run.measured) < len(run.nodes)
        else None
    )
    version = hashlib.blake2b(
        f"{run.state}|{run.reason}|{run.job_ids}|{len(run.measured)}".encode(), digest_size=8
    ).hexdigest()
    return schemas.ScalingRunView(
        id=run.id,
        name=run.name,
        owner=run.owner.name,
        team=team.name if team else None,
        state=ScalingState(run.state),
        reason=run.reason,
        nodes=run.nodes,
        steps=run.steps,
        warmup=run.warmup,
        measuring=measuring,
        job_ids=run.job_ids,
        points=points(measured),
        created_at=run.created_at,
        ended_at=run.ended_at,
        version=version,
    )
