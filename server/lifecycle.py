"""What happens to jobs and allocations when users, agents and the reaper report events.

Every function takes the caller's session, flushes, never commits, and returns the set of agent
ids whose work changed (the caller wakes them after its commit). Job states change only through
`server.transitions`.

Policy (decide) is kept apart from action: `outcome_after_exit` looks at an allocation and says
what the job should become; `record_node_exit` applies it.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import delete, select
from sqlalchemy.orm import Session, selectinload

from phalanx.schemas import JobSpec, JobState, NodeState
from scheduler.placement import AgentSlots, never_fits
from server.errors import Conflict, NotFound, Unprocessable
from server.models import Agent, Allocation, AllocationNode, Job, SlotLease, utcnow
from server.transitions import transition


def agent_slot_views(session: Session, agents: list[Agent]) -> list[AgentSlots]:
    """Each agent's slots per type with the indices free now (not held by a lease)."""
    held: dict[tuple[int, str], set[int]] = {}
    for agent_id, slot_type, index in session.execute(
        select(SlotLease.agent_id, SlotLease.slot_type, SlotLease.slot_index)
    ):
        held.setdefault((agent_id, slot_type), set()).add(index)
    views = []
    for agent in agents:
        for slot_type, capacity in (("cpu", agent.cpu_slots), ("gpu", agent.gpu_slots)):
            if capacity:
                busy = held.get((agent.id, slot_type), set())
                free = tuple(i for i in range(capacity) if i not in busy)
                views.append(AgentSlots(agent.id, agent.name, slot_type, capacity, free))
    return views


def live_agents(session: Session) -> list[Agent]:
    return list(session.scalars(select(Agent).where(Agent.state != "LOST").order_by(Agent.id)))


def create_job(session: Session, spec: JobSpec, owner_id: int, bundle_sha256: str | None, bundle_size: int) -> Job:
    res = spec.resources
    reason = never_fits(
        res.nodes, res.slots_per_node, res.slot_type.value, agent_slot_views(session, live_agents(session))
    )
    if reason is not None:
        raise Unprocessable(
            f"job {spec.name!r} can never be placed: {reason}. Lower resources.nodes or "
            "resources.slots_per_node, or register agents with more slots first."
        )
    job = Job(
        name=spec.name,
        owner_id=owner_id,
        state=JobState.QUEUED.value,
        spec=spec.model_dump(mode="json"),
        priority=spec.priority,
        nodes=res.nodes,
        slots_per_node=res.slots_per_node,
        slot_type=res.slot_type.value,
        bundle_sha256=bundle_sha256,
        bundle_size=bundle_size,
        attempts=0,
        wait_reason="waiting for the scheduler's next pass",
    )
    session.add(job)
    session.flush()
    return job


def get_job(session: Session, job_id: int, *, lock: bool = False) -> Job:
    query = select(Job).where(Job.id == job_id)
    if lock:
        query = query.with_for_update()
    job = session.scalars(query).one_or_none()
    if job is None:
        raise NotFound(f"job {job_id} does not exist; `phalanx jobs list` shows the jobs you can see")
    return job


def active_allocation(session: Session, job_id: int) -> Allocation | None:
    return session.scalars(
        select(Allocation)
        .where(Allocation.job_id == job_id, Allocation.active.is_(True))
        .options(selectinload(Allocation.nodes))
    ).one_or_none()


def _release(session: Session, node: AllocationNode, exit_code: int | None, reason: str) -> None:
    node.state = NodeState.EXITED.value
    node.exit_code = exit_code
    node.reason = reason
    node.ended_at = session.execute(select(utcnow())).scalar_one()
    session.execute(delete(SlotLease).where(SlotLease.node_id == node.id))


def _stop_others(allocation: Allocation) -> set[int]:
    woken = set()
    for node in allocation.nodes:
        if node.state != NodeState.EXITED.value and node.desired != "stop":
            node.desired = "stop"
            woken.add(node.agent_id)
    return woken


def _end_allocation(session: Session, allocation: Allocation) -> None:
    if all(n.state == NodeState.EXITED.value for n in allocation.nodes):
        allocation.active = False
        allocation.ended_at = session.execute(select(utcnow())).scalar_one()


@dataclass(frozen=True, slots=True)
class Outcome:
    target: JobState | None  # None: nothing to change yet
    reason: str


def outcome_after_exit(job_state: JobState, allocation: Allocation, node: AllocationNode) -> Outcome:
    """Decide what a node's exit means for its job. Pure: reads, never writes."""
    if job_state.is_terminal:
        return Outcome(None, "")
    if node.exit_code != 0:
        code = "unknown" if node.exit_code is None else str(node.exit_code)
        detail = f": {node.reason}" if node.reason else ""
        return Outcome(
            JobState.FAILED,
            f"node {node.node_rank} on agent {node.agent.name} exited with code {code}{detail}",
        )
    if all(n.state == NodeState.EXITED.value and n.exit_code == 0 for n in allocation.nodes):
        return Outcome(JobState.COMPLETED, "every rank exited with code 0")
    return Outcome(None, "")


def record_node_exit(
    session: Session, allocation: Allocation, node: AllocationNode, exit_code: int | None, reason: str
) -> set[int]:
    if node.state == NodeState.EXITED.value:
        return set()  # idempotent: an agent retrying a report it already made
    _release(session, node, exit_code, reason)
    job = get_job(session, allocation.job_id, lock=True)
    outcome = outcome_after_exit(JobState(job.state), allocation, node)
    woken: set[int] = set()
    if outcome.target is JobState.FAILED:
        woken = _stop_others(allocation)
        transition(session, job, JobState.FAILED, outcome.reason)
    elif outcome.target is JobState.COMPLETED:
        transition(session, job, JobState.COMPLETED, outcome.reason)
    _end_allocation(session, allocation)
    session.flush()
    return woken


def record_node_started(session: Session, allocation: Allocation, node: AllocationNode) -> None:
    if node.state != NodeState.ASSIGNED.value:
        return
    node.state = NodeState.RUNNING.value
    node.started_at = session.execute(select(utcnow())).scalar_one()
    job = get_job(session, allocation.job_id, lock=True)
    if job.state == JobState.SCHEDULED.value and all(n.state != NodeState.ASSIGNED.value for n in allocation.nodes):
        transition(session, job, JobState.RUNNING, "torchrun started on every node")
    session.flush()


def kill_job(session: Session, job: Job, reason: str = "cancelled by user") -> set[int]:
    if JobState(job.state).is_terminal:
        raise Conflict(f"job {job.id} already ended as {job.state}; nothing to kill")
    transition(session, job, JobState.CANCELLED, reason)
    allocation = active_allocation(session, job.id)
    return _stop_others(allocation) if allocation else set()


def fail_agent_nodes(session: Session, agent: Agent, reason: str) -> set[int]:
    """An agent is gone (lost, or restarted and re-registered): its unexited nodes exited unknown."""
    woken: set[int] = set()
    nodes = session.scalars(
        select(AllocationNode)
        .where(AllocationNode.agent_id == agent.id, AllocationNode.state != NodeState.EXITED.value)
        .options(selectinload(AllocationNode.allocation).selectinload(Allocation.nodes))
    ).all()
    for node in nodes:
        woken |= record_node_exit(session, node.allocation, node, None, reason)
    woken.discard(agent.id)
    return woken


def find_node(session: Session, agent_id: int, allocation_id: int, node_rank: int) -> tuple[Allocation, AllocationNode]:
    allocation = session.scalars(
        select(Allocation).where(Allocation.id == allocation_id).options(selectinload(Allocation.nodes))
    ).one_or_none()
    if allocation is None:
        raise NotFound(f"allocation {allocation_id} does not exist")
    node = next((n for n in allocation.nodes if n.node_rank == node_rank), None)
    if node is None:
        raise NotFound(f"allocation {allocation_id} has no node rank {node_rank}")
    if node.agent_id != agent_id:
        raise Conflict(
            f"node {node_rank} of allocation {allocation_id} belongs to agent {node.agent_id}, not to agent {agent_id}"
        )
    return allocation, node
