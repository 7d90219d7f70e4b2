"""An attempt's whole life: started by a placement, its nodes launched and exited, ended by a
failure, a user, a lost agent or a drain, and then its job restarted within budget or failed.

An attempt is an `Allocation` with one `AllocationNode` per node and one `SlotLease` per slot it
holds. Every change to an attempt happens under `lock_attempt` (the job's row lock, taken before any
row of the attempt is written), so two reports never deadlock and every decision reads the nodes as
the previous holder committed them. States change only through `server.transitions`.

Functions take the caller's session, flush, never commit. Their effects after the commit are
noted in the session (`note_agent_work` for agents whose assignments changed, `note_schedule` when
slots were freed) and carried out by `wakeups.publish_after_commit`.

Policy is kept apart from action (`decide_restart` only decides; `end_attempt` acts).
"""

from __future__ import annotations

import secrets
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, insert, select, update
from sqlalchemy.orm import Session, selectinload

from phalanx.schemas import JobSpec, JobState, NodeState
from server import checkpoints
from server.errors import Conflict, NotFound, PhalanxError
from server.models import Agent, Allocation, AllocationNode, Job, SlotLease, TuningStudy, TuningTrial
from server.placement import Placement
from server.transitions import (
    complete_jobs,
    db_now,
    exit_nodes,
    schedule_jobs,
    start_nodes,
    start_running,
    transition,
    transition_node,
)
from server.wakeups import note_agent_work, note_schedule

RUNNING_STATES = (JobState.RUNNING.value, JobState.SCHEDULED.value)
# An attempt restarted without the nodes that never reported: charged to the infrastructure until
# one of them reports a failure of its own (then the job's) or its agent is declared lost (final).
VANISHED = "vanished"
PREEMPTED = "preempted: "  # how a preempted attempt's end reason starts (`server.sharing` reads it)


@dataclass(frozen=True, slots=True)
class Failure:
    """Why an attempt ends early. `budget` says whose fault: the job's ("job"), the
    infrastructure's ("infra"), or nobody's ("none": a preemption, which costs no restart);
    "fatal" ends the job, since a restart would fail the same way (its runtime environment cannot
    be built);
    `graceful` lets the workers checkpoint before they go."""

    budget: str
    reason: str
    graceful: bool = False


@dataclass(frozen=True, slots=True)
class Decision:
    restart: bool
    reason: str


def decide_restart(job: Job, failure: Failure) -> Decision:
    """Policy only: restart within the failure's budget, else fail. Pure: reads, never writes."""
    if failure.budget == "none":
        return Decision(True, f"queued again, costing no restart: {failure.reason}")
    if failure.budget == "fatal":
        return Decision(False, f"{failure.reason} (not restarted: every attempt would fail the same way)")
    spec = JobSpec.model_validate(job.spec)
    if failure.budget == "infra":
        used, limit, name = job.infra_restarts_used, spec.max_infra_restarts, "max_infra_restarts"
    else:
        used, limit, name = job.restarts_used, spec.max_restarts, "max_restarts"
    if used < limit:
        return Decision(True, f"restart {used + 1} of {limit} ({name}) after: {failure.reason}")
    return Decision(False, f"{failure.reason} (no restarts left: {name} is {limit})")


# --- reading and locking ---------------------------------------------------------------------------


def lock_job(session: Session, job_id: int) -> Job:
    """The job, re-read under its row lock (whatever this session had loaded before)."""
    job = session.scalars(
        select(Job).where(Job.id == job_id).with_for_update().execution_options(populate_existing=True)
    ).one_or_none()
    if job is None:
        raise NotFound(f"job {job_id} does not exist; `phalanx jobs list` shows the jobs you can see")
    return job


def lock_attempt(session: Session, allocation: Allocation) -> Job:
    """Lock the allocation's job row, then re-read the allocation and its nodes."""
    job = lock_job(session, allocation.job_id)
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


def find_node(session: Session, agent_id: int, allocation_id: int, node_rank: int) -> tuple[Allocation, AllocationNode]:
    """The node an agent reports on; 404 for an unknown one, 409 for another agent's."""
    allocation = session.scalars(
        select(Allocation)
        .where(Allocation.id == allocation_id)
        .options(selectinload(Allocation.nodes))
        # as they are now, whatever this session loaded before (reports of one call move nodes by
        # statement)
        .execution_options(populate_existing=True)
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


@dataclass(frozen=True, slots=True)
class ReportedNode:
    """What a node's own report needs of its attempt, read as columns (no ORM objects)."""

    job_id: int
    job_state: str
    node_id: int
    node_state: str
    attempt_open: bool  # active, and no failure, stop or preemption has begun ending it


NodeKey = tuple[int, int]  # (allocation id, node rank)


def reported_nodes(
    session: Session, agent_id: int, keys: Collection[NodeKey], *, lock_jobs: bool = False
) -> dict[NodeKey, ReportedNode | PhalanxError]:
    """`find_node` for many nodes in one statement, for the reports every node's start makes
    (rendezvous, started): each node, or why its agent may not report on it (NotFound, Conflict).
    `lock_jobs` takes the jobs' row locks, as `lock_attempt` does, in the same statement (a caller
    that locks several takes them in id order first: `node_reports`)."""
    query = (
        select(
            Allocation.id,
            Allocation.job_id,
            Job.state,
            AllocationNode.node_rank,
            AllocationNode.id,
            AllocationNode.agent_id,
            AllocationNode.state,
            Allocation.active & Allocation.end_reason.is_(None),
        )
        .select_from(Allocation)
        .join(Job, Job.id == Allocation.job_id)
        .outerjoin(AllocationNode, AllocationNode.allocation_id == Allocation.id)
        .where(Allocation.id.in_(sorted({allocation_id for allocation_id, _ in keys})))
    )
    if lock_jobs:
        query = query.with_for_update(of=Job)
    known: set[int] = set()
    nodes: dict[NodeKey, tuple[int, ReportedNode]] = {}
    for allocation_id, job_id, job_state, node_rank, node_id, owner, node_state, open_ in session.execute(query):
        known.add(allocation_id)
        if node_id is not None:
            nodes[(allocation_id, node_rank)] = (owner, ReportedNode(job_id, job_state, node_id, node_state, open_))
    found: dict[NodeKey, ReportedNode | PhalanxError] = {}
    for allocation_id, node_rank in keys:
        key = (allocation_id, node_rank)
        if allocation_id not in known:
            found[key] = NotFound(f"allocation {allocation_id} does not exist")
        elif key not in nodes:
            found[key] = NotFound(f"allocation {allocation_id} has no node rank {node_rank}")
        elif (owner := nodes[key][0]) != agent_id:
            found[key] = Conflict(
                f"node {node_rank} of allocation {allocation_id} belongs to agent {owner}, not to agent {agent_id}"
            )
        else:
            found[key] = nodes[key][1]
    return found


def reported_node(
    session: Session, agent_id: int, allocation_id: int, node_rank: int, *, lock_job: bool = False
) -> ReportedNode:
    """One node of `reported_nodes`; its refusal raised."""
    found = reported_nodes(session, agent_id, [(allocation_id, node_rank)], lock_jobs=lock_job)[
        (allocation_id, node_rank)
    ]
    if isinstance(found, PhalanxError):
        raise found
    return found


def set_rendezvous(session: Session, agent_id: int, allocation_id: int, master_port: int) -> None:
    """Node rank 0's agent tells where its gang meets; the agents of the other nodes are woken."""
    reported_node(session, agent_id, allocation_id, 0)
    result: Any = session.execute(
        update(Allocation)
        .where(Allocation.id == allocation_id, Allocation.active)
        .values(master_port=master_port)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:
        raise Conflict(f"allocation {allocation_id} has ended; its rendezvous cannot change")
    # Rank 0's agent chose the port and knows it: waking it too would make each node's start
    # re-read its agent's whole work (at a fill, the 8 nodes an agent starts cost 8 reads).
    others = select(AllocationNode.agent_id).where(
        AllocationNode.allocation_id == allocation_id, AllocationNode.node_rank != 0
    )
    note_agent_work(session, set(session.scalars(others)))


def report_nodes_started(
    session: Session, agent_id: int, keys: Collection[NodeKey]
) -> dict[NodeKey, PhalanxError | None]:
    """Nodes' torchruns started: under their jobs' row locks (two nodes of a gang reporting at once
    each see the other's move), the nodes move, and each job once no node of its attempt waits to
    launch. Set-based, read as columns without loading the attempts: every node of every attempt
    reports it, and an agent reports the nodes it starts together in one call. Each key's refusal,
    or None; a node already running (a report sent again) or exited is left as it is."""
    found = reported_nodes(session, agent_id, keys, lock_jobs=True)
    nodes = {key: node for key, node in found.items() if isinstance(node, ReportedNode)}
    moved = start_nodes(session, [node.node_id for node in nodes.values()])
    launching = {
        allocation_id: node.job_id
        for (allocation_id, _), node in nodes.items()
        if node.node_id in moved and node.job_state == JobState.SCHEDULED.value
    }
    if launching:
        still_waiting = set(
            session.scalars(
                select(AllocationNode.allocation_id)
                .where(
                    AllocationNode.allocation_id.in_(sorted(launching)),
                    AllocationNode.state == NodeState.ASSIGNED.value,
                )
                .distinct()
            )
        )
        ready = {job_id for allocation_id, job_id in launching.items() if allocation_id not in still_waiting}
        start_running(session, ready, "torchrun started on every node")
    return {key: None if isinstance(node, ReportedNode) else node for key, node in found.items()}


def report_node_started(session: Session, agent_id: int, allocation_id: int, node_rank: int) -> None:
    """One node of `report_nodes_started`; its refusal raised."""
    refused = report_nodes_started(session, agent_id, [(allocation_id, node_rank)])[(allocation_id, node_rank)]
    if refused is not None:
        raise refused


def report_nodes_exited(
    session: Session, agent_id: int, reasons: Mapping[NodeKey, str]
) -> tuple[dict[NodeKey, PhalanxError | None], set[NodeKey]]:
    """Nodes that exited with code 0 from attempts still open, set-based, as `record_node_exit`
    would one by one: the nodes exit and free their slots, and each attempt whose nodes all exited
    with 0 ends with its job COMPLETED. The common end of every attempt, and an agent reports the
    ends of the nodes it ran together. The caller holds the jobs' row locks.

    Returns each handled key's refusal or None (a node already exited is left as it is), and the
    keys left to `record_node_exit`: those of attempts already ending or ended, whose rules
    (failures, restarts, presumed-gone peers) need the attempt loaded."""
    found = reported_nodes(session, agent_id, reasons)
    outcomes: dict[NodeKey, PhalanxError | None] = {}
    left: set[NodeKey] = set()
    exiting: dict[NodeKey, ReportedNode] = {}
    for key, node in found.items():
        if isinstance(node, PhalanxError):
            outcomes[key] = node
        elif node.node_state == NodeState.EXITED.value:
            outcomes[key] = None
        elif not node.attempt_open or node.job_state not in RUNNING_STATES:
            left.add(key)
        else:
            exiting[key] = node
            outcomes[key] = None
    if not exiting:
        return outcomes, left
    now = db_now(session)
    moved = exit_nodes(session, {node.node_id: reasons[key] for key, node in exiting.items()}, now)
    session.execute(delete(SlotLease).where(SlotLease.node_id.in_(sorted(moved))))
    note_schedule(session)  # slots were freed
    jobs = {allocation_id: (node.job_id, node.job_state) for (allocation_id, _), node in exiting.items()}
    unfinished = set(
        session.scalars(
            select(AllocationNode.allocation_id)
            .where(
                AllocationNode.allocation_id.in_(sorted(jobs)),
                (AllocationNode.state != NodeState.EXITED.value) | AllocationNode.exit_code.is_distinct_from(0),
            )
            .distinct()
        )
    )
    finished = {allocation_id: job for allocation_id, job in jobs.items() if allocation_id not in unfinished}
    if finished:
        complete_jobs(session, dict(finished.values()), "every rank exited with code 0", now)
        session.execute(
            update(Allocation)
            .where(Allocation.id.in_(sorted(finished)))
            .values(active=False, fenced=True, ended_at=now)
            .execution_options(synchronize_session=False)
        )
    return outcomes, left


# --- start -----------------------------------------------------------------------------------------


def start_attempts(session: Session, placed: Sequence[tuple[Job, Placement]], agents: Mapping[int, Agent]) -> None:
    """Each placed QUEUED job (locked by the caller) gets its next attempt: the allocation, its nodes
    and their slot leases, resuming from the newest committed checkpoint; the job is SCHEDULED and
    its agents are woken to launch it.

    Written for the whole pass at once (one insert per table, `transitions.schedule_jobs`): at
    ~10 statements a job, filling a 1,000-agent cluster took minutes. Only a job placed before
    (a restart) costs statements of its own: its resume point, and marking the metrics its new
    attempt will report again."""
    if not placed:
        return
    resume: dict[int, int | None] = {}
    for job, _ in placed:
        if job.attempts > 0:
            latest = checkpoints.latest_checkpoint(session, job.id)
            resume[job.id] = latest.step if latest else None
    allocation_ids = list(
        session.scalars(
            insert(Allocation).returning(Allocation.id, sort_by_parameter_order=True),
            [
                {
                    "job_id": job.id,
                    "attempt": job.attempts + 1,
                    "master_addr": agents[placement.nodes[0].agent_id].address,
                    "active": True,
                    "resume_step": resume.get(job.id),
                    "credential": secrets.token_urlsafe(32),
                }
                for job, placement in placed
            ],
        )
    )
    for (job, _), allocation_id in zip(placed, allocation_ids, strict=True):
        if job.attempts > 0:  # a first attempt has no metrics to supersede
            checkpoints.supersede_redone_steps(session, job.id, allocation_id, resume.get(job.id))
    nodes = [
        (job, allocation_id, node)
        for (job, placement), allocation_id in zip(placed, allocation_ids, strict=True)
        for node in placement.nodes
    ]
    node_ids = list(
        session.scalars(
            insert(AllocationNode).returning(AllocationNode.id, sort_by_parameter_order=True),
            [
                {
                    "allocation_id": allocation_id,
                    "node_rank": node.node_rank,
                    "agent_id": node.agent_id,
                    "slot_type": job.slot_type,
                    "slot_indices": list(node.slot_indices),
                    "state": NodeState.ASSIGNED.value,
                    "desired": "run",
                }
                for job, allocation_id, node in nodes
            ],
        )
    )
    session.execute(
        insert(SlotLease),
        [
            {"agent_id": node.agent_id, "slot_type": job.slot_type, "slot_index": i, "node_id": node_id}
            for (job, _, node), node_id in zip(nodes, node_ids, strict=True)
            for i in node.slot_indices
        ],
    )
    note_agent_work(session, (node.agent_id for _, _, node in nodes))
    reasons = []
    for job, placement in placed:
        names = ", ".join(agents[n.agent_id].name for n in placement.nodes)
        step = resume.get(job.id)
        start = f", resuming from the checkpoint of step {step}" if step is not None else ""
        reasons.append((job, f"attempt {job.attempts + 1} placed on {names}{start}"))
    schedule_jobs(session, reasons)


# --- end -------------------------------------------------------------------------------------------


def _release(session: Session, node: AllocationNode, exit_code: int | None, reason: str) -> None:
    transition_node(session, node, NodeState.EXITED, exit_code=exit_code, reason=reason, ended_at=db_now(session))
    session.execute(delete(SlotLease).where(SlotLease.node_id == node.id))
    note_schedule(session)  # slots were freed


def _stop_nodes(session: Session, allocation: Allocation, how: str) -> None:
    """Ask every unexited node to stop ("stop": SIGTERM then SIGKILL; "kill": SIGKILL now)."""
    for node in allocation.nodes:
        if node.state != NodeState.EXITED.value and node.desired not in (how, "kill"):
            node.desired = how
            note_agent_work(session, [node.agent_id])


def _end_allocation(session: Session, job: Job, allocation: Allocation) -> None:
    """Once every node exited: close the allocation and settle what its failure costs."""
    if not allocation.active or any(n.state != NodeState.EXITED.value for n in allocation.nodes):
        return
    allocation.active = False
    allocation.fenced = True
    allocation.ended_at = db_now(session)
    if job.state == JobState.RESTARTING.value and allocation.end_reason is not None:
        failure = Failure(allocation.end_budget or "job", allocation.end_reason)
        decision = decide_restart(job, failure)
        if not decision.restart:
            transition(session, job, JobState.FAILED, decision.reason)
            return
        if failure.budget == "infra":
            job.infra_restarts_used += 1
        elif failure.budget == "job":
            job.restarts_used += 1
        transition(session, job, JobState.QUEUED, decision.reason)
        note_schedule(session)


def end_attempt(session: Session, job: Job, allocation: Allocation, failure: Failure) -> None:
    """Act on a failure: stop the gang now; the job restarts or fails once every node is gone.

    The budget is charged only then, because the first exit is often collateral: when an agent
    dies, the ranks of the other nodes fail on a reset connection seconds before the reaper can
    declare that agent lost. A lost agent found while the attempt winds down makes the whole
    attempt the infrastructure's failure."""
    if JobState(job.state).is_terminal:
        return
    if allocation.end_reason is not None:
        if failure.budget == "infra" and allocation.end_budget != "infra":
            allocation.end_reason, allocation.end_budget = failure.reason, "infra"
        return
    allocation.end_reason, allocation.end_budget = failure.reason, failure.budget
    if not failure.graceful:
        allocation.fenced = True  # a zombie of this attempt may no longer write metrics or checkpoints
    _stop_nodes(session, allocation, "stop" if failure.graceful else "kill")
    if job.state in RUNNING_STATES:
        transition(session, job, JobState.RESTARTING, f"attempt {allocation.attempt} is ending: {failure.reason}")
    _end_allocation(session, job, allocation)


# What a rank prints when a collective or the rendezvous store broke under it because a peer died:
# gloo, NCCL and c10d's own words. Such a failure is collateral; the peer's explains the attempt.
_PEER_FAILURE_MARKERS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Check the logs of the remote worker",
    "remote process exited",
    "NCCL communicator was aborted",
    "ncclRemoteError",
    "DistNetworkError",
)


def _collateral(reason: str) -> bool:
    return any(marker in reason for marker in _PEER_FAILURE_MARKERS)


def _prefer_own_failure(job: Job, allocation: Allocation, failure: Failure) -> None:
    """A node failing after the attempt began ending may still be its cause.

    The first failure reported ends the attempt, but a rank's death breaks its peers' collectives
    within milliseconds, and which node reports first is a race. So a later failure whose ranks did
    not die of a broken connection replaces a first one whose did. A node presumed gone with its
    agent (`_restart_without_unreported`) that reports such a failure was alive: the restart it
    cost moves from the infrastructure's budget to the job's."""
    current = allocation.end_reason or ""
    if _collateral(failure.reason):
        return
    if allocation.end_budget == "job" and _collateral(current):
        allocation.end_reason = failure.reason
    elif allocation.end_budget == VANISHED:
        allocation.end_reason, allocation.end_budget = failure.reason, "job"
        job.infra_restarts_used = max(job.infra_restarts_used - 1, 0)
        job.restarts_used += 1


def _node_failure(node: AllocationNode, cause: str) -> Failure:
    if cause == "environment":
        return Failure("fatal", f"the runtime environment failed on agent {node.agent.name}: {node.reason}")
    code = "unknown" if node.exit_code is None else str(node.exit_code)
    detail = f": {node.reason}" if node.reason else ""
    return Failure("job", f"node {node.node_rank} on agent {node.agent.name} exited with code {code}{detail}")


def record_environment_lock(session: Session, allocation: Allocation, lock: str) -> str:
    """Keep the first lock reported for the job (and for its study's later trials); the job's lock.

    Under the job's row lock, so two nodes reporting at once both get the one that was kept, and
    every node of every attempt installs it."""
    job = lock_attempt(session, allocation)
    if not allocation.active:
        raise Conflict(f"allocation {allocation.id} has ended; its environment is no longer needed")
    if job.env_lock is None:
        job.env_lock = lock
        trial_study = select(TuningTrial.study_id).where(TuningTrial.job_id == job.id).scalar_subquery()
        session.execute(
            update(TuningStudy)
            .where(TuningStudy.id == trial_study, TuningStudy.env_lock.is_(None))
            .values(env_lock=lock)
        )
        note_agent_work(session, (n.agent_id for n in allocation.nodes))
    session.flush()
    return job.env_lock


def record_node_exit(
    session: Session,
    allocation: Allocation,
    node: AllocationNode,
    exit_code: int | None,
    reason: str,
    cause: str = "run",
    job: Job | None = None,
) -> None:
    """`job`: the allocation's job when the caller locked it (`lock_job`) before this transaction
    read the allocation and its nodes; otherwise it is locked here, and they are read again."""
    if job is None:
        job = lock_attempt(session, allocation)
    if node.state == NodeState.EXITED.value:
        return  # idempotent: an agent retrying a report it already made
    _release(session, node, exit_code, reason)
    # An attempt that is already ending (failed, stopped by a user, or its job left the running
    # states) expects its nodes to exit, with any code.
    ending = allocation.end_reason is not None or job.state not in RUNNING_STATES
    if not ending and exit_code != 0:
        end_attempt(session, job, allocation, _node_failure(node, cause))
    elif ending and exit_code != 0 and cause == "run":
        _prefer_own_failure(job, allocation, _node_failure(node, cause))
    elif not ending and all(n.state == NodeState.EXITED.value and n.exit_code == 0 for n in allocation.nodes):
        transition(session, job, JobState.COMPLETED, "every rank exited with code 0")
    _end_allocation(session, job, allocation)
    _restart_without_unreported(session, job, allocation)
    session.flush()


def _restart_without_unreported(session: Session, job: Job, allocation: Allocation) -> None:
    """Restart a gang at once when every node that reported failed because a peer vanished, and
    the peers that have not reported are presumed gone with their agents.

    Waiting for them would wait for their agents' heartbeat timeout (~10 s): the survivors' ranks
    fail on a reset connection within a second or two of an agent's death. The unreported nodes
    keep their slot leases, so their agents get no new work (`schedule_pass` also skips an agent
    holding such a node) until they report their exit or are declared lost; the attempt is fenced,
    so nothing of it can write any more. Charged to the infrastructure ("vanished", a charge still
    open): a node that then reports a failure of its own moves the charge to the job's budget
    (`_prefer_own_failure`), and its agent declared lost makes it final. So it is done only while
    both budgets allow a restart."""
    if not allocation.active or job.state != JobState.RESTARTING.value or allocation.end_budget != "job":
        return
    if not _collateral(allocation.end_reason or ""):
        return
    unreported = [n for n in allocation.nodes if n.state != NodeState.EXITED.value]
    if not unreported or len(unreported) == len(allocation.nodes):
        return
    if job.restarts_used >= JobSpec.model_validate(job.spec).max_restarts:
        return  # the charge may yet move to the job's budget: both must allow the restart
    missing = ", ".join(f"node {n.node_rank} on agent {n.agent.name}" for n in unreported)
    failure = Failure("infra", f"{allocation.end_reason}; {missing} did not report: presumed gone with its agent")
    decision = decide_restart(job, failure)
    if not decision.restart:
        return  # no infrastructure restarts left: wait for the peers' own outcome, as before
    allocation.end_reason, allocation.end_budget = failure.reason, VANISHED
    allocation.active = False
    allocation.fenced = True
    allocation.ended_at = db_now(session)
    job.infra_restarts_used += 1
    transition(session, job, JobState.QUEUED, f"{decision.reason} (without waiting for {missing})")
    note_schedule(session)


def stop_for_user(session: Session, job: Job, target: JobState, reason: str, *, fence: bool) -> None:
    """A user (or a study's pruner) ends or pauses the job: `target` at once; its workers get
    SIGTERM. `fence=False` keeps accepting the checkpoint they write on the way out."""
    transition(session, job, target, reason)
    allocation = active_allocation(session, job.id)
    if allocation is None:
        return
    if allocation.end_reason is None:
        allocation.end_reason = reason
    allocation.fenced = allocation.fenced or fence
    _stop_nodes(session, allocation, "stop")


def preempt_attempt(session: Session, job: Job, allocation: Allocation, reason: str, grace_s: float) -> None:
    """Stop the (locked) job's running attempt for another team's guarantee: its workers get
    SIGTERM and `grace_s` to checkpoint; the job queues again and resumes, costing no restart."""
    allocation.stop_grace = grace_s
    end_attempt(session, job, allocation, Failure("none", f"{PREEMPTED}{reason}", graceful=True))


def end_attempts_on_agent(session: Session, agent: Agent, failure: Failure) -> None:
    """The attempts with a node on `agent` end (a drain: gracefully; they restart elsewhere)."""
    allocations = session.scalars(
        select(Allocation)
        .join(AllocationNode)
        .where(AllocationNode.agent_id == agent.id, Allocation.active.is_(True))
        .options(selectinload(Allocation.nodes))
        .distinct()
    ).all()
    for allocation in allocations:
        job = lock_attempt(session, allocation)
        end_attempt(session, job, allocation, failure)


def fail_nodes_on_agent(session: Session, agent: Agent, reason: str) -> None:
    """An agent is gone (lost, or restarted and re-registered): its unexited nodes exited unknown,
    and their attempts restart elsewhere on the infrastructure budget."""
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
        end_attempt(session, job, allocation, Failure("infra", reason))
        _release(session, node, None, reason)
        _end_allocation(session, job, allocation)
    session.flush()
