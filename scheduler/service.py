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

from phalanx.schemas import AgentState, JobState, NodeState
from scheduler.placement import PendingJob, place
from server.lifecycle import agent_slot_views, fail_agent_nodes
from server.models import Agent, Allocation, AllocationNode, Job, SlotLease, utcnow
from server.transitions import transition

SCHEDULER_LOCK_KEY = 0x7068_616C  # "phal"


def _serialise(session: Session) -> None:
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": SCHEDULER_LOCK_KEY})


def schedule_pass(session: Session) -> set[int]:
    """Place queued gangs on free slots. Returns the agents that got work."""
    _serialise(session)
    queued = list(session.scalars(select(Job).where(Job.state == JobState.QUEUED.value).order_by(Job.id)))
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
        allocation = Allocation(job_id=job.id, attempt=job.attempts, master_addr=rank0.address, active=True)
        session.add(allocation)
        session.flush()
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
        transition(session, job, JobState.SCHEDULED, f"attempt {job.attempts} placed on {names}")
    for job_id, reason in result.waiting.items():
        if jobs[job_id].wait_reason != reason:
            jobs[job_id].wait_reason = reason
    session.flush()
    return woken


def reap_pass(session: Session, heartbeat_timeout: float) -> set[int]:
    """Declare agents lost whose last heartbeat is older than the timeout, by the database clock."""
    cutoff = session.execute(select(utcnow())).scalar_one() - timedelta(seconds=heartbeat_timeout)
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
        woken |= fail_agent_nodes(
            session, agent, f"agent {agent.name} lost: no heartbeat for over {heartbeat_timeout:g} s"
        )
    session.flush()
    return woken
