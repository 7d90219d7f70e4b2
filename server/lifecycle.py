"""What happens to jobs and allocations when users, agents and the reaper report events.

Every function takes the caller's session, flushes, never commits, and returns the set of agent
ids whose work changed (the caller wakes them after its commit). Job states change only through
`server.transitions`.

Policy (decide) is kept apart from action: `decide_restart` says whether a failed attempt's job
restarts within its budget or fails; `end_attempt` and `_end_allocation` act on that.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import delete, select
from sqlalchemy.orm import Session, selectinload

from phalanx.schemas import AgentState, JobSpec, JobState, NodeState
from scheduler.placement import AgentSlots, never_fits
from server.errors import Conflict, NotFound, Unprocessable
from server.models import Agent, Allocation, AllocationNode, Job, SlotLease, utcnow
from server.transitions import transition
from server.wakeups import note_job_change


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


def check_fits(session: Session, spec: JobSpec, what: str) -> None:
    """Refuse (422) a job that no set of the registered agents could ever host."""
    res = spec.resources
    reason = never_fits(
        res.nodes, res.slots_per_node, res.slot_type.value, agent_slot_views(session, live_agents(session))
    )
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
    note_job_change(session, job.id)  # published on commit: the dashboard's tables show it at once
    return job


def get_job(session: Session, job_id: int, *, lock: bool = False) -> Job:
    query = select(Job).where(Job.id == job_id)
    if lock:
        query = query.with_for_update()
    job = session.scalars(query).one_or_none()
    if job is None:
        raise NotFound(f"job {job_id} does not exist; `phalanx jobs list` shows the jobs you can see")
    return job


def lock_attempt(session: Session, allocation: Allocation) -> Job:
    """Lock the allocation's job row, then re-read the allocation and its nodes.

    Every change to an attempt happens under this lock, taken before any row of the attempt is
    written (so two reports never deadlock), and decisions read the nodes as committed by
    whoever held it before: two nodes that exit at the same moment each see the other's exit."""
    job = get_job(session, allocation.job_id, lock=True)
    session.execute(
        select(Allocation).where(Allocation.id == allocation.id).execution_options(populate_existing=True)
    ).one()
    session.execute(
        select(AllocationNode)
        .where(AllocationNode.allocation_id == allocation.id)
        .execution_options(populate_existing=True)
    ).all()
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


def _stop_nodes(allocation: Allocation, how: str) -> set[int]:
    """Ask every unexited node to stop ("stop": SIGTERM then SIGKILL; "kill": SIGKILL now)."""
    woken = set()
    for node in allocation.nodes:
        if node.state != NodeState.EXITED.value and node.desired not in (how, "kill"):
            node.desired = how
            woken.add(node.agent_id)
    return woken


def _end_allocation(session: Session, job: Job, allocation: Allocation) -> None:
    """Once every node exited: close the allocation and settle what its failure costs."""
    if not allocation.active or any(n.state != NodeState.EXITED.value for n in allocation.nodes):
        return
    allocation.active = False
    allocation.fenced = True
    allocation.ended_at = session.execute(select(utcnow())).scalar_one()
    if job.state == JobState.RESTARTING.value and allocation.end_reason is not None:
        failure = Failure(allocation.end_budget or "job", allocation.end_reason)
        decision = decide_restart(job, failure)
        if not decision.restart:
            transition(session, job, JobState.FAILED, decision.reason)
            return
        if failure.budget == "infra":
            job.infra_restarts_used += 1
        else:
            job.restarts_used += 1
        transition(session, job, JobState.QUEUED, decision.reason)
        job.wait_reason = "waiting for the scheduler's next pass"


@dataclass(frozen=True, slots=True)
class Failure:
    """Why an attempt ends early. `budget` says whose fault: the job's ("job") or the
    infrastructure's ("infra"); `graceful` lets the workers checkpoint before they go."""

    budget: str
    reason: str
    graceful: bool = False


@dataclass(frozen=True, slots=True)
class Decision:
    restart: bool
    reason: str


def decide_restart(job: Job, failure: Failure) -> Decision:
    """Policy only: restart within the failure's budget, else fail. Pure: reads, never writes."""
    spec = JobSpec.model_validate(job.spec)
    if failure.budget == "infra":
        used, limit, name = job.infra_restarts_used, spec.max_infra_restarts, "max_infra_restarts"
    else:
        used, limit, name = job.restarts_used, spec.max_restarts, "max_restarts"
    if used < limit:
        return Decision(True, f"restart {used + 1} of {limit} ({name}) after: {failure.reason}")
    return Decision(False, f"{failure.reason} (no restarts left: {name} is {limit})")


def end_attempt(session: Session, job: Job, allocation: Allocation, failure: Failure) -> set[int]:
    """Act on a failure: stop the gang now; the job restarts or fails once every node is gone.

    The budget is charged only then, because the first exit is often collateral: when an agent
    dies, the ranks of the other nodes fail on a reset connection seconds before the reaper can
    declare that agent lost. A lost agent found while the attempt winds down makes the whole
    attempt the infrastructure's failure."""
    if JobState(job.state).is_terminal:
        return set()
    if allocation.end_reason is not None:
        if failure.budget == "infra" and allocation.end_budget != "infra":
            allocation.end_reason, allocation.end_budget = failure.reason, "infra"
        return set()
    allocation.end_reason, allocation.end_budget = failure.reason, failure.budget
    if not failure.graceful:
        allocation.fenced = True  # a zombie of this attempt may no longer write metrics or checkpoints
    woken = _stop_nodes(allocation, "stop" if failure.graceful else "kill")
    if job.state in (JobState.RUNNING.value, JobState.SCHEDULED.value):
        transition(session, job, JobState.RESTARTING, f"attempt {allocation.attempt} is ending: {failure.reason}")
    _end_allocation(session, job, allocation)
    return woken


def _node_failure(node: AllocationNode) -> Failure:
    code = "unknown" if node.exit_code is None else str(node.exit_code)
    detail = f": {node.reason}" if node.reason else ""
    return Failure("job", f"node {node.node_rank} on agent {node.agent.name} exited with code {code}{detail}")


def record_node_exit(
    session: Session, allocation: Allocation, node: AllocationNode, exit_code: int | None, reason: str
) -> set[int]:
    job = lock_attempt(session, allocation)
    if node.state == NodeState.EXITED.value:
        return set()  # idempotent: an agent retrying a report it already made
    _release(session, node, exit_code, reason)
    woken: set[int] = set()
    # An attempt that is already ending (failed, stopped by a user, or its job left the running
    # states) expects its nodes to exit, with any code.
    running = job.state in (JobState.RUNNING.value, JobState.SCHEDULED.value)
    ending = allocation.end_reason is not None or not running
    if not ending and exit_code != 0:
        woken = end_attempt(session, job, allocation, _node_failure(node))
    elif not ending and all(n.state == NodeState.EXITED.value and n.exit_code == 0 for n in allocation.nodes):
        transition(session, job, JobState.COMPLETED, "every rank exited with code 0")
    _end_allocation(session, job, allocation)
    session.flush()
    return woken


def record_node_started(session: Session, allocation: Allocation, node: AllocationNode) -> None:
    job = lock_attempt(session, allocation)
    if node.state != NodeState.ASSIGNED.value:
        return
    node.state = NodeState.RUNNING.value
    node.started_at = session.execute(select(utcnow())).scalar_one()
    if job.state == JobState.SCHEDULED.value and all(n.state != NodeState.ASSIGNED.value for n in allocation.nodes):
        transition(session, job, JobState.RUNNING, "torchrun started on every node")
    session.flush()


def _stop_for_user(session: Session, job: Job, target: JobState, reason: str, fence: bool) -> set[int]:
    transition(session, job, target, reason)
    allocation = active_allocation(session, job.id)
    if allocation is None:
        return set()
    if allocation.end_reason is None:
        allocation.end_reason = reason
    allocation.fenced = allocation.fenced or fence
    return _stop_nodes(allocation, "stop")


def kill_job(session: Session, job: Job, reason: str = "cancelled by user") -> set[int]:
    if JobState(job.state).is_terminal:
        raise Conflict(f"job {job.id} already ended as {job.state}; nothing to kill")
    return _stop_for_user(session, job, JobState.CANCELLED, reason, fence=True)


def prune_job(session: Session, job: Job, reason: str) -> set[int]:
    """Optuna's pruner stopped the trial: PRUNED at once; SIGTERM lets the script checkpoint."""
    return _stop_for_user(session, job, JobState.PRUNED, reason, fence=False)


def pause_job(session: Session, job: Job) -> set[int]:
    """SIGTERM the workers (should_stop() turns true; they checkpoint and leave); `resume` requeues."""
    if job.state not in (JobState.QUEUED.value, JobState.SCHEDULED.value, JobState.RUNNING.value, "RESTARTING"):
        raise Conflict(f"job {job.id} is {job.state}; only a queued or running job can be paused")
    # not fenced: the checkpoint the workers write on their way out must still be accepted
    return _stop_for_user(session, job, JobState.PAUSED, "paused by user", fence=False)


def resume_job(session: Session, job: Job) -> None:
    if job.state != JobState.PAUSED.value:
        raise Conflict(f"job {job.id} is {job.state}, not PAUSED; there is nothing to resume")
    transition(session, job, JobState.QUEUED, "resumed by user")
    job.wait_reason = "waiting for the scheduler's next pass"


def drain_agent(session: Session, agent: Agent) -> set[int]:
    """No new work for the agent; the attempts it hosts checkpoint, stop, and restart elsewhere."""
    agent.state = AgentState.DRAINING.value
    woken: set[int] = set()
    allocations = session.scalars(
        select(Allocation)
        .join(AllocationNode)
        .where(AllocationNode.agent_id == agent.id, Allocation.active.is_(True))
        .options(selectinload(Allocation.nodes))
        .distinct()
    ).all()
    for allocation in allocations:
        job = lock_attempt(session, allocation)
        failure = Failure("infra", f"preempted: agent {agent.name} is draining", graceful=True)
        woken |= end_attempt(session, job, allocation, failure)
    return woken


def fail_agent_nodes(session: Session, agent: Agent, reason: str) -> set[int]:
    """An agent is gone (lost, or restarted and re-registered): its unexited nodes exited unknown,
    and their attempts restart elsewhere on the infrastructure budget."""
    woken: set[int] = set()
    nodes = session.scalars(
        select(AllocationNode)
        .where(AllocationNode.agent_id == agent.id, AllocationNode.state != NodeState.EXITED.value)
        .options(selectinload(AllocationNode.allocation).selectinload(Allocation.nodes))
    ).all()
    for node in nodes:
        allocation = node.allocation
        job = lock_attempt(session, allocation)
        if node.state == NodeState.EXITED.value:  # it reported its exit while we waited for the lock
            continue
        woken |= end_attempt(session, job, allocation, Failure("infra", reason))
        _release(session, node, None, reason)
        _end_allocation(session, job, allocation)
    woken.discard(agent.id)
    session.flush()
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
