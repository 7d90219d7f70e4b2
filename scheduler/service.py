"""Scheduling and reaping passes: read the database, let the pure policies decide, then act.

Each pass runs in one transaction owned by the caller and returns the agents to wake after commit.
Concurrency: on PostgreSQL a transaction-scoped advisory lock serialises passes, so two scheduler
processes never place against the same view of free slots; SQLite's `BEGIN IMMEDIATE` does the same
there. The `slot_leases` primary key would reject a double-booking even if that ever failed.
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from phalanx.schemas import AgentState, JobSpec, JobState, NodeState
from scheduler.placement import PendingJob, place
from server.checkpoints import latest_checkpoint, supersede_redone_steps
from server.db import SERVER_STARTED
from server.lifecycle import Failure, agent_slot_views, end_attempt, fail_agent_nodes, lock_attempt
from server.models import Agent, Allocation, AllocationNode, ControlPlane, Job, SlotLease, utcnow
from server.transitions import transition

SCHEDULER_LOCK_KEY = 0x7068_616C  # "phal"


def _serialise(session: Session) -> None:
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": SCHEDULER_LOCK_KEY})


def schedule_pass(session: Session) -> set[int]:
    """Place queued gangs on free slots. Returns the agents that got work."""
    _serialise(session)
    # A job whose previous attempt still has workers waits for them: never two attempts at once.
    still_running = select(Allocation.job_id).where(Allocation.active.is_(True))
    queued = list(
        session.scalars(
            select(Job).where(Job.state == JobState.QUEUED.value, Job.id.not_in(still_running)).order_by(Job.id)
        )
    )
    if not queued:
        return set()
    agents = list(session.scalars(select(Agent).where(Agent.state == AgentState.ACTIVE.value).order_by(Agent.id)))
    by_id = {a.id: a for a in agents}
    pending = [
        PendingJob(
            job_id=j.id,
            priority=j.priority,
            seq=j.id,
            nodes=j.nodes,
            slots_per_node=j.slots_per_node,
            slot_type=j.slot_type,
        )
        for j in queued
    ]
    result = place(pending, agent_slot_views(session, agents))
    jobs = {j.id: j for j in queued}
    woken: set[int] = set()
    for placement in result.placements:
        job = jobs[placement.job_id]
        job.attempts += 1
        rank0 = by_id[placement.nodes[0].agent_id]
        resume = latest_checkpoint(session, job.id)
        allocation = Allocation(
            job_id=job.id,
            attempt=job.attempts,
            master_addr=rank0.address,
            active=True,
            resume_step=resume.step if resume else None,
        )
        session.add(allocation)
        session.flush()
        supersede_redone_steps(session, job.id, allocation.id, resume.step if resume else None)
        for node in placement.nodes:
            row = AllocationNode(
                allocation_id=allocation.id,
                node_rank=node.node_rank,
                agent_id=node.agent_id,
                slot_type=job.slot_type,
                slot_indices=list(node.slot_indices),
                state=NodeState.ASSIGNED.value,
                desired="run",
            )
            session.add(row)
            session.flush()
            session.add_all(
                SlotLease(agent_id=node.agent_id, slot_type=job.slot_type, slot_index=i, node_id=row.id)
                for i in node.slot_indices
            )
            woken.add(node.agent_id)
        names = ", ".join(by_id[n.agent_id].name for n in placement.nodes)
        start = f", resuming from the checkpoint of step {resume.step}" if resume else ""
        transition(session, job, JobState.SCHEDULED, f"attempt {job.attempts} placed on {names}{start}")
    for job_id, reason in result.waiting.items():
        if jobs[job_id].wait_reason != reason:
            jobs[job_id].wait_reason = reason
    session.flush()
    return woken


def reap_pass(session: Session, heartbeat_timeout: float) -> set[int]:
    """Declare agents lost whose last heartbeat is older than the timeout, by the database clock.

    No agent can heartbeat while no server runs, so for one timeout after a server (re)start
    nobody is declared lost: a control-plane restart must not restart every job."""
    now = session.execute(select(utcnow())).scalar_one()
    cutoff = now - timedelta(seconds=heartbeat_timeout)
    started = session.get(ControlPlane, SERVER_STARTED)
    if started is not None and started.time > cutoff:
        return set()
    lost = list(
        session.scalars(
            select(Agent)
            .where(Agent.state != AgentState.LOST.value, Agent.last_heartbeat < cutoff)
            .with_for_update(skip_locked=True)
        )
    )
    woken: set[int] = set()
    for agent in lost:
        agent.state = AgentState.LOST.value
        # Its own channel too: an agent that is alive after all learns at once that it was
        # declared lost, and a non-empty result makes the caller run a scheduling pass now.
        woken.add(agent.id)
        woken |= fail_agent_nodes(
            session, agent, f"agent {agent.name} lost: no heartbeat for over {heartbeat_timeout:g} s"
        )
    session.flush()
    return woken


def hang_pass(session: Session) -> set[int]:
    """Restart attempts whose ranks reported no step for their job's `hang_timeout`."""
    now = session.execute(select(utcnow())).scalar_one()
    rows = session.execute(
        select(Allocation, Job)
        .join(Job, Allocation.job_id == Job.id)
        .where(Allocation.active.is_(True), Allocation.end_reason.is_(None), Job.state == JobState.RUNNING.value)
    ).all()
    woken: set[int] = set()
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
        failure = Failure("job", f"hang: no rank reported a step for over {timeout:g} s")
        woken |= end_attempt(session, job, allocation, failure)
    session.flush()
    return woken
