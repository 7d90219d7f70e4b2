"""Scheduling, reaping and hang passes: read the database, let the pure policies decide, then act
through `server.attempts` and `server.agents`.

Each pass runs in one transaction owned by the caller (the reaper in one per lost agent, opened
through the caller's `sessions`); what must follow its commit (waking agents, another scheduling
pass) is noted in the session, and each returns the agents it woke.
Concurrency: on PostgreSQL a transaction-scoped advisory lock serialises passes, so two scheduler
processes never place against the same view of free slots; SQLite's `BEGIN IMMEDIATE` does the same
there. The pass reads the queue without locks (10,000 row locks a pass are 10,000 tuple writes in
PostgreSQL), then locks the jobs it places, still QUEUED, `FOR UPDATE SKIP LOCKED`: a job that a
kill or a pause holds or moved meanwhile is left for the next pass instead of being placed from a
stale read. The `slot_leases` primary key would reject a double-booking even if all that ever
failed.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

from sqlalchemy import select, text
from sqlalchemy.orm import Session, selectinload

from phalanx.schemas import AgentState, JobState, NodeState
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
    start_attempts,
)
from server.models import Agent, Allocation, AllocationNode, Job
from server.placement import Preemption, place
from server.settings import Settings, get_settings
from server.transitions import db_now, record_event, set_wait_reasons
from server.wakeups import note_schedule, noted_agents

SCHEDULER_LOCK_KEY = 0x7068_616C  # "phal"


def _serialise(session: Session) -> None:
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": SCHEDULER_LOCK_KEY})


def schedule_pass(session: Session, settings: Settings | None = None) -> set[int]:
    """Place queued gangs on free slots by fair share, and preempt borrowed slots for the jobs a
    team's guarantee entitles. Returns the agents that got work."""
    _serialise(session)
    queued = sharing.queued_jobs(session)
    if not queued:
        return set()
    # An agent still holding a node of an attempt that restarted without it is presumed dead
    # (`attempts._restart_without_unreported`): none of its slots are offered until it reports
    # that node's exit or is declared lost.
    presumed_gone = (
        select(AllocationNode.id)
        .join(Allocation, Allocation.id == AllocationNode.allocation_id)
        .where(
            AllocationNode.agent_id == Agent.id,
            AllocationNode.state != NodeState.EXITED.value,
            Allocation.active.is_(False),
        )
        .exists()
    )
    agents = list(
        session.scalars(select(Agent).where(Agent.state == AgentState.ACTIVE.value, ~presumed_gone).order_by(Agent.id))
    )
    by_id = {a.id: a for a in agents}
    settings = settings or get_settings()
    now = db_now(session)
    policy = sharing.load_sharing(session, now, settings)
    result = place([q.pending for q in queued], agent_rules.agent_slot_views(session, agents), policy)
    chosen = [p.job_id for p in result.placements]
    locked = _lock_still_queued(session, chosen)
    placed = [(locked[p.job_id], p) for p in result.placements if p.job_id in locked]
    if len(placed) < len(chosen):
        note_schedule(session)  # a job killed or paused since the read left its slots to the next pass
    start_attempts(session, placed, by_id)
    for preemption in result.preemptions:
        for_job = _lock_still_queued(session, [preemption.for_job_id]).get(preemption.for_job_id)
        if for_job is not None:
            _preempt(session, preemption, for_job, settings.preemption_grace)
    shown = {q.pending.job_id: q.wait_reason for q in queued}
    set_wait_reasons(session, {job_id: r for job_id, r in result.waiting.items() if shown.get(job_id) != r})
    session.flush()
    return noted_agents(session)


def _lock_still_queued(session: Session, job_ids: list[int]) -> dict[int, Job]:
    """The jobs among `job_ids` that are still QUEUED, locked. A job that a kill or a pause holds or
    has moved since the pass read the queue is left out (`SKIP LOCKED`), never placed from a stale
    read."""
    if not job_ids:
        return {}
    rows = session.scalars(
        select(Job)
        .where(Job.id.in_(job_ids), Job.state == JobState.QUEUED.value)
        .with_for_update(skip_locked=True, of=Job)
        .execution_options(populate_existing=True)
    )
    return {job.id: job for job in rows}


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


def reap_pass(sessions: Callable[[], AbstractContextManager[Session]], heartbeat_timeout: float) -> set[int]:
    """Declare agents lost whose last heartbeat is older than the timeout, each in a transaction
    of its own (`agents.declare_lost`); `sessions()` opens one. The agents to wake."""
    with sessions() as session:
        silent = agent_rules.silent_agents(session, heartbeat_timeout)
    woken: set[int] = set()
    for agent_id in silent:
        with sessions() as session:
            agent_rules.declare_lost(session, agent_id, heartbeat_timeout)
            woken |= noted_agents(session)
    return woken


def hang_pass(session: Session) -> set[int]:
    """Restart attempts whose ranks reported no step for their job's `hang_timeout`."""
    now = db_now(session)
    # Read from the spec by the database: this runs every 2 s, and parsing every running job's spec
    # (thousands in a large cluster) to find the few with a timeout cost the scheduler most of a core.
    hang_timeout = Job.spec["hang_timeout"].as_float()
    rows = session.execute(
        select(Allocation, Job, hang_timeout)
        .join(Job, Allocation.job_id == Job.id)
        .where(
            Allocation.active.is_(True),
            Allocation.end_reason.is_(None),
            Job.state == JobState.RUNNING.value,
            hang_timeout.is_not(None),
        )
        .options(selectinload(Allocation.nodes))
    ).all()
    for allocation, job, timeout in rows:
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
