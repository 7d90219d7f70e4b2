"""A job's own rules: create one (refusing what no agent could ever host), and the user's
kill, pause and resume. The attempt a job runs is `server/attempts.py`'s.

Functions take the caller's session, flush, never commit; states change only through
`server.transitions`; effects after commit are noted in the session (`server/wakeups.py`).
"""

from __future__ import annotations

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from phalanx.schemas import AgentState, JobSpec, JobState
from server.attempts import lock_job, stop_for_user
from server.errors import Conflict, NotFound, Unprocessable
from server.models import Agent, Job
from server.placement import never_fits_counted
from server.transitions import WAITING_FOR_PASS, transition
from server.wakeups import note_job_change, note_schedule

PAUSABLE = (JobState.QUEUED.value, JobState.SCHEDULED.value, JobState.RUNNING.value, JobState.RESTARTING.value)


def check_fits(session: Session, spec: JobSpec, what: str) -> None:
    """Refuse (422) a job that no set of the registered agents could ever host."""
    res = spec.resources
    capacity = Agent.gpu_slots if res.slot_type.value == "gpu" else Agent.cpu_slots
    # Counted by the database: every submit asks, and a thousand agents' rows per submit were most
    # of its time.
    of_type, big_enough = session.execute(
        select(func.count(), func.coalesce(func.sum(case((capacity >= res.slots_per_node, 1), else_=0)), 0)).where(
            Agent.state != AgentState.LOST.value, capacity > 0
        )
    ).one()
    reason = never_fits_counted(res.nodes, res.slots_per_node, res.slot_type.value, of_type, big_enough)
    if reason is not None:
        raise Unprocessable(
            f"{what} can never be placed: {reason}. Lower resources.nodes or "
            "resources.slots_per_node, or register agents with more slots first."
        )


def create_job(
    session: Session,
    spec: JobSpec,
    owner_id: int,
    bundle_sha256: str | None,
    bundle_size: int,
    *,
    team_id: int | None = None,
    refuse_misfit: bool = True,
) -> Job:
    """A QUEUED job. `refuse_misfit=False` for trials: their study was checked when it was created,
    and a trial waits (saying why) rather than fail while agents are gone."""
    if refuse_misfit:
        check_fits(session, spec, f"job {spec.name!r}")
    res = spec.resources
    job = Job(
        name=spec.name,
        owner_id=owner_id,
        team_id=team_id,
        state=JobState.QUEUED.value,
        spec=spec.model_dump(mode="json"),
        priority=spec.priority,
        nodes=res.nodes,
        slots_per_node=res.slots_per_node,
        slot_type=res.slot_type.value,
        bundle_sha256=bundle_sha256,
        bundle_size=bundle_size,
        attempts=0,
        wait_reason=WAITING_FOR_PASS,
    )
    session.add(job)
    session.flush()
    note_job_change(session, job.id)  # the dashboard's tables show it at once
    note_schedule(session)
    return job


def get_job(session: Session, job_id: int, *, lock: bool = False) -> Job:
    if lock:
        return lock_job(session, job_id)
    job = session.get(Job, job_id)
    if job is None:
        raise NotFound(f"job {job_id} does not exist; `phalanx jobs list` shows the jobs you can see")
    return job


def kill_job(session: Session, job: Job, reason: str = "cancelled by user") -> None:
    """CANCELLED at once; its workers get SIGTERM and may no longer write (fenced)."""
    if JobState(job.state).is_terminal:
        raise Conflict(f"job {job.id} already ended as {job.state}; nothing to kill")
    stop_for_user(session, job, JobState.CANCELLED, reason, fence=True)


def prune_job(session: Session, job: Job, reason: str) -> None:
    """Optuna's pruner stopped the trial: PRUNED at once; SIGTERM lets the script checkpoint."""
    stop_for_user(session, job, JobState.PRUNED, reason, fence=False)


def pause_job(session: Session, job: Job) -> None:
    """SIGTERM the workers (should_stop() turns true; they checkpoint and leave); `resume` requeues."""
    if job.state not in PAUSABLE:
        raise Conflict(f"job {job.id} is {job.state}; only a queued or running job can be paused")
    # not fenced: the checkpoint the workers write on their way out must still be accepted
    stop_for_user(session, job, JobState.PAUSED, "paused by user", fence=False)


def resume_job(session: Session, job: Job) -> None:
    if job.state != JobState.PAUSED.value:
        raise Conflict(f"job {job.id} is {job.state}, not PAUSED; there is nothing to resume")
    transition(session, job, JobState.QUEUED, "resumed by user")
    note_schedule(session)


def set_held(session: Session, job: Job, held: bool) -> None:
    """Hold (or release) the (locked) job: while held it is never placed; a running job goes on and
    waits only when it queues again. 409 for a job that ended."""
    if JobState(job.state).is_terminal:
        raise Conflict(f"job {job.id} is {job.state}: only a job that has not ended can be held or released")
    job.held = held
    session.flush()
    note_job_change(session, job.id)
    note_schedule(session)
