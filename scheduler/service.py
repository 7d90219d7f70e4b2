"""Scheduling, reaping and hang passes: read the database, let the pure policies decide, then act
through `server.attempts` and `server.agents`.

Each pass runs in one transaction owned by the caller; what must follow its commit (waking agents,
another scheduling pass) is noted in the session, and each returns the agents it woke.
Concurrency: on PostgreSQL a transaction-scoped advisory lock serialises passes, so two scheduler
processes never place against the same view of free slots; SQLite's `BEGIN IMMEDIATE` does the same
there. The pass locks the QUEUED jobs it reads (`FOR UPDATE SKIP LOCKED`): a job that a kill or a
pause holds is left for the next pass instead of being placed from a stale read. The
`slot_leases` primary key would reject a double-booking even if all that ever failed.
"""

from __future__ import annotations

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from phalanx.schemas import AgentState, JobSpec, JobState
from server import agents as agent_rules
from server import sharing
from server.attempts import (
    RUNNING_STATES,
    Failure,
    active_allocation,
    end_attempt,
    lock_attempt,
    lock_job,
    preempt_attempt,
    start_attempt,
)
from server.models import Agent, Allocation, Job
from server.placement import Preemption, place
from server.settings import Settings, get_settings
from server.transitions import db_now, record_event, set_wait_reason
from server.wakeups import noted_agents

SCHEDULER_LOCK_KEY = 0x7068_616C  # "phal"


def _serialise(session: Session) -> None:
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": SCHEDULER_LOCK_KEY})


def schedule_pass(session: Session, settings: Settings | None = None) -> set[int]:
    """Place queued gangs on free slots by fair share, and preempt borrowed slots for the jobs a
    team's guarantee entitles. Returns the agents that got work."""
    _serialise(session)
    # A job whose previous attempt still has workers waits for them: never two attempts at once.
    still_running = select(Allocation.job_id).where(Allocation.active.is_(True))
    queued = list(
        session.scalars(
            select(Job)
            .where(Job.state == JobState.QUEUED.value, Job.id.not_in(still_running))
            .order_by(Job.id)
            .with_for_update(skip_locked=True, of=Job)
            .execution_options(populate_existing=True)
        )
    )
    if not queued:
        return set()
    agents = list(session.scalars(select(Agent).where(Agent.state == AgentState.ACTIVE.value).order_by(Agent.id)))
    by_id = {a.id: a for a in agents}
    settings = settings or get_settings()
    now = db_now(session)
    policy = sharing.load_sharing(session, now, settings)
    result = place(sharing.pending_jobs(session, queued), agent_rules.agent_slot_views(session, agents), policy)
    jobs = {j.id: j for j in queued}
    for placement in result.placements:
        start_attempt(session, jobs[placement.job_id], placement, by_id)
    for preemption in result.preemptions:
        _preempt(session, preemption, jobs[preemption.for_job_id], settings.preemption_grace)
    for job_id, reason in result.waiting.items():
        set_wait_reason(session, jobs[job_id], reason)
    session.flush()
    return noted_agents(session)


def _preempt(session: Session, preemption: Preemption, for_job: Job, grace_s: float) -> None:
    """Stop the victim's attempt gracefully (it requeues, costing no restart) and record the
    preemption on both jobs. A victim that ended or was stopped meanwhile is left alone: the next
    pass decides again from what is then true."""
    victim = lock_job(session, preemption.job_id)
    allocation = active_allocation(session, victim.id)
    if allocation is None:
        return
    lock_attempt(session, allocation)  # re-reads the attempt under the job's lock
    if victim.state not in RUNNING_STATES or allocation.end_reason is not None:
        return
    victim.preempted_by = for_job.id
    preempt_attempt(session, victim, allocation, preemption.reason, grace_s)
    record_event(session, for_job, f"preempting job {victim.id}: {preemption.reason}")


def reap_pass(session: Session, heartbeat_timeout: float) -> set[int]:
    """Declare agents lost whose last heartbeat is older than the timeout (`agents.declare_lost`)."""
    agent_rules.declare_lost(session, heartbeat_timeout)
    return noted_agents(session)


def hang_pass(session: Session) -> set[int]:
    """Restart attempts whose ranks reported no step for their job's `hang_timeout`."""
    now = db_now(session)
    rows = session.execute(
        select(Allocation, Job)
        .join(Job, Allocation.job_id == Job.id)
        .where(Allocation.active.is_(True), Allocation.end_reason.is_(None), Job.state == JobState.RUNNING.value)
    ).all()
    for allocation, job in rows:
        timeout = JobSpec.model_validate(job.spec).hang_timeout
        if timeout is None:
            continue
        started = [n.started_at for n in allocation.nodes if n.started_at is not None]
        since = allocation.last_progress_at or (max(started) if started else None)
        if since is None or (now - since).total_seconds() < timeout:
            continue
        job = lock_attempt(session, allocation)
        if allocation.end_reason is not None or job.state != JobState.RUNNING.value:
            continue  # it ended while we waited for the lock
        end_attempt(session, job, allocation, Failure("job", f"hang: no rank reported a step for over {timeout:g} s"))
    session.flush()
    return noted_agents(session)
