"""The agent protocol: register, heartbeat, long-poll for work, and report each node's life."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Query, Request, Response
from pydantic import ValidationError
from sqlalchemy import Text, bindparam, cast, func, select
from sqlalchemy.orm import Session

from phalanx import schemas
from server import access, agents, attempts, auth, checkpoints, commands, views
from server import node_reports as node_reports_of
from server.api.deps import (
    MAX_ROW_ID,
    AgentDep,
    RowId,
    Services,
    ServicesDep,
    SessionDep,
    UserDep,
    in_agent_thread,
)
from server.api.uploads import invalid_batch
from server.errors import Forbidden, NotFound
from server.ingest import batch_identity
from server.models import Agent, Allocation, AllocationNode, Checkpoint, Job, utcnow
from server.settings import Settings
from server.task_names import REAP_TASK
from server.wakeups import agent_channel

router = APIRouter(prefix="/agents", tags=["agents"])
# A hung peer is seen at the process-group timeout; torch's default (30 min for NCCL) is far too long.
PG_TIMEOUT = 120.0
# The reaper pass a hung-up long-poll schedules runs this long after the heartbeat timeout expires
# (database and server clocks read in the same query, so only scheduling jitter needs covering).
REAP_MARGIN_S = 0.05
T = TypeVar("T")


@router.get("", response_model=list[schemas.AgentView])
def list_agents(
    session: SessionDep,
    _: UserDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 1000,
    offset: Annotated[int, Query(ge=0, le=MAX_ROW_ID)] = 0,
) -> list[schemas.AgentView]:
    with session.begin():
        query = select(*views.AGENT_VIEW_COLUMNS).order_by(Agent.id).limit(limit).offset(offset)
        return views.agents(session, session.execute(query).all())


@router.post("/register", response_model=schemas.AgentRegistered)
def register(
    registration: schemas.AgentRegistration, session: SessionDep, services: ServicesDep, principal: AgentDep
) -> schemas.AgentRegistered:
    """Register, or re-register after a restart: the agent's old processes are gone, so are its
    nodes. The answer carries the agent's new token, which every later call must use."""
    with session.begin():
        proven = principal.agent_id or auth.agent_id_of(session, registration.agent_token)
        if principal.agent_id is not None:
            named = session.scalars(select(Agent.id).where(Agent.name == registration.name)).first()
            if named != principal.agent_id:
                raise Forbidden(f"this token belongs to agent {principal.agent_id}; it re-registers that agent only")
        agent, token = agents.register_agent(session, registration, proven)
        answer = schemas.AgentRegistered(
            id=agent.id, name=agent.name, state=schemas.AgentState(agent.state), agent_token=token
        )
    services.token_cache.forget(auth.agent_token_id(agent.id))  # its previous token stops at once here
    # Known at once: a cluster of agents that registers together must not then look each new
    # token up on its first heartbeat and long-poll.
    services.token_cache.put(auth.hash_token(token), auth.agent_principal(agent.id))
    return answer


@router.post("/{agent_id}/heartbeat", status_code=204)
async def heartbeat(agent_id: RowId, services: ServicesDep, principal: AgentDep) -> Response:
    """Stamped with the database clock, together with the heartbeats other agents sent meanwhile
    (`server/heartbeats.py`); 409 once the agent was declared lost (register again)."""
    access.agent_acts_as(principal, agent_id)
    await services.heartbeats.beat(agent_id)
    return Response(status_code=204)


# One statement of columns, no ORM objects, built once: a thousand agents' long-polls re-read
# this every 20 s, all at once after a server restart, and each agent's again whenever its work
# changes; building the statement cost a third of each read.
_WORK = (
    select(
        Agent.id,
        AllocationNode.node_rank,
        AllocationNode.slot_type,
        AllocationNode.slot_indices,
        AllocationNode.desired,
        Allocation.id,
        Allocation.attempt,
        Allocation.master_addr,
        Allocation.master_port,
        Allocation.stop_grace,
        Allocation.credential,
        select(func.count())
        .where(AllocationNode.allocation_id == Allocation.id)
        .correlate(Allocation)
        .scalar_subquery(),
        Job.id,
        Job.slots_per_node,
        # as text: the key of the kept answers below, and a spec validated once per process
        cast(Job.spec, Text),
        Job.env_lock,
        Checkpoint.step,
        Checkpoint.path,
    )
    .select_from(Agent)
    .outerjoin(
        AllocationNode,
        (AllocationNode.agent_id == Agent.id) & (AllocationNode.state != schemas.NodeState.EXITED.value),
    )
    .outerjoin(Allocation, AllocationNode.allocation_id == Allocation.id)
    .outerjoin(Job, Allocation.job_id == Job.id)
    # Gone only when retention dropped it after this attempt wrote newer ones: it has started by then.
    .outerjoin(Checkpoint, (Checkpoint.job_id == Job.id) & (Checkpoint.step == Allocation.resume_step))
    .where(Agent.id == bindparam("agent_id"))
    .order_by(AllocationNode.id, Checkpoint.id)
)


@dataclass(frozen=True, slots=True)
class WorkAnswer:
    """An agent's assignments as the route answers them: their digest and the JSON of `AgentWork`."""

    version: str
    body: bytes


# Assignments kept as JSON (`_kept_assignment_json`) have specs up to this long: 8,192 of them
# then take at most ~50 MB.
MAX_KEPT_ASSIGNMENT_SPEC_CHARS = 2048


def _assignment_json(row: tuple[Any, ...], checkpoint_uri: str) -> str:
    """A node's assignment as JSON, from the row that `_WORK` reads for it (its slots as a tuple)."""
    (node_rank, slot_type, slot_indices, desired, allocation_id, attempt, master_addr, master_port) = row[:8]
    (stop_grace, credential, node_count, job_id, slots_per_node, spec_json, env_lock, step, path) = row[8:]
    spec = views.stored_spec(spec_json)
    return schemas.Assignment(
        allocation_id=allocation_id,
        job_id=job_id,
        attempt=attempt,
        node_rank=node_rank,
        nnodes=node_count,
        nproc_per_node=slots_per_node,
        slot_type=schemas.SlotType(slot_type),
        slot_indices=list(slot_indices),
        master_addr=master_addr,
        master_port=master_port,
        desired=desired if desired in ("stop", "kill") else "run",
        stop_grace=stop_grace,
        entrypoint=spec.entrypoint,
        launcher=spec.launcher,
        env=spec.env,
        hyperparameters=spec.hyperparameters,
        precision=spec.precision,
        ddp=spec.ddp,
        checkpoint_root=checkpoints.storage_for(spec, job_id, checkpoint_uri),
        resume=None if step is None else schemas.ResumePoint(step=step, path=path),
        pg_timeout=min(spec.hang_timeout or PG_TIMEOUT, PG_TIMEOUT),
        credential=auth.rank_token(allocation_id, credential or ""),
        runtime_env=spec.runtime_env,
        env_lock=env_lock if spec.runtime_env is not None else None,
    ).model_dump_json()


# By everything an assignment is made of: an agent's work is read again whenever any of its nodes
# changes and at every long-poll's end, and its other nodes' assignments have not changed;
# building and serializing each one again cost most of a read. 8,192 hold 1,000 agents x 8 nodes.
_kept_assignment_json = lru_cache(maxsize=8192)(_assignment_json)


def _load_work(session: Session, agent_id: int, settings: Settings) -> WorkAnswer:
    with session.begin():
        rows = session.execute(_WORK, {"agent_id": agent_id}).all()
    if not rows:
        raise NotFound(f"agent {agent_id} is not registered; register it first")
    assignments: dict[tuple[int, int], str] = {}
    for row in rows:
        node_rank, allocation_id = row[1], row[5]
        if node_rank is None or (allocation_id, node_rank) in assignments:
            continue
        key = (node_rank, row[2], tuple(row[3]), *row[4:])  # hashable: the node's slots as a tuple
        spec_json = row[14]
        build = _kept_assignment_json if len(spec_json) <= MAX_KEPT_ASSIGNMENT_SPEC_CHARS else _assignment_json
        assignments[(allocation_id, node_rank)] = build(key, settings.checkpoint_uri)
    listed = "[" + ",".join(assignments.values()) + "]"
    version = hashlib.sha1(listed.encode()).hexdigest()
    return WorkAnswer(version, f'{{"version":"{version}","assignments":{listed}}}'.encode())


@router.post("/{agent_id}/drain", response_model=schemas.AgentView)
def drain(agent_id: RowId, session: SessionDep, user: UserDep) -> schemas.AgentView:
    """Stop placing work on the agent; its attempts checkpoint, stop, and restart elsewhere."""
    return commands.drain_agent(session, user, agent_id)


@router.post("/{agent_id}/undrain", response_model=schemas.AgentView)
def undrain(agent_id: RowId, session: SessionDep, user: UserDep) -> schemas.AgentView:
    """Place work on a drained agent again (cluster admins)."""
    return commands.undrain_agent(session, user, agent_id)


@router.get("/{agent_id}/work", response_model=schemas.AgentWork)
async def agent_work(
    agent_id: RowId,
    request: Request,
    services: ServicesDep,
    principal: AgentDep,
    version: Annotated[str, Query(max_length=64)] = "",
    wait: Annotated[float, Query(ge=0, le=300)] = 0.0,
) -> Response:
    """The agent's assignments; with `version` and `wait`, hangs until they differ from that version.

    A long-poll whose agent hangs up is a hint that the agent died (a live agent polls again at
    once): the reaper is then run the moment that agent's heartbeat timeout expires, instead of at
    its next periodic pass. Whether the agent is lost is still decided by its heartbeats alone."""
    access.agent_acts_as(principal, agent_id)
    settings = services.settings

    def load() -> WorkAnswer:
        with services.sessions() as session:
            return _load_work(session, agent_id, settings)

    if wait <= 0:
        return _answer(await in_agent_thread(services, load))
    gone = asyncio.Event()

    async def watch_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone.set()

    with services.holds.hold(f"agent {agent_id}", "the work long-poll"):
        watcher = asyncio.create_task(watch_disconnect())
        try:
            work = await services.waiter.until_changed(
                agent_channel(agent_id),
                load,
                lambda work: work.version != version,
                min(wait, settings.work_poll_seconds),
                interrupt=gone,
                reread_at_timeout=False,  # the agent polls again at once: its next first read compares
                threads=services.agent_threads,
            )
        finally:
            watcher.cancel()
    if gone.is_set():
        await in_agent_thread(services, partial(_reap_at_expiry, services, agent_id))
    return _answer(work)  # (nobody reads it when the agent hung up)


def _answer(work: WorkAnswer) -> Response:
    """The JSON built with the read, as it is: through the route's `response_model` it was parsed
    and serialized again on the event loop, at every long-poll's end."""
    return Response(work.body, media_type="application/json")


def _reap_at_expiry(services: Services, agent_id: int) -> None:
    """Enqueue a reaper pass, due the moment `agent_id`'s heartbeat timeout expires."""
    with services.sessions() as session:
        row = session.execute(select(Agent.last_heartbeat, utcnow()).where(Agent.id == agent_id)).one_or_none()
    if row is None:
        return
    last_heartbeat, now = row
    delay = max((last_heartbeat - now).total_seconds() + services.settings.heartbeat_timeout, 0.0) + REAP_MARGIN_S
    services.enqueue(REAP_TASK, countdown=delay)


# The node reports below come by the thousand when a cluster fills or drains. Each is an async
# route that runs its transaction in one of the agents' threads: a sync route with a session dependency
# costs three thread hand-offs (open, call, close), and at a fill the event loop spent more on
# those than the routes spent on their queries (`bench/bench_scale.py`). The agent sends them
# many in one call (`reports`, `logs`); the one-node routes are the same reports one at a time.


async def _in_transaction(services: Services, work: Callable[[Session], T]) -> T:
    """`work` in one transaction, run in one of the agents' threads."""

    def run() -> T:
        with services.sessions() as session, session.begin():
            return work(session)

    return await in_agent_thread(services, run)


@router.post("/{agent_id}/reports", response_model=schemas.ReportOutcomes)
async def node_reports(
    agent_id: RowId, body: schemas.NodeReports, services: ServicesDep, principal: AgentDep
) -> schemas.ReportOutcomes:
    """Reports of the agent's nodes (started, exit, rendezvous), applied in order, each on its own:
    one outcome per report, 204 or the status and error its own call would have answered."""
    access.agent_acts_as(principal, agent_id)
    outcomes = await _in_transaction(services, lambda s: node_reports_of.apply_reports(s, agent_id, body.reports))
    return schemas.ReportOutcomes(results=outcomes)


@router.post("/{agent_id}/allocations/{allocation_id}/rendezvous", status_code=204)
async def rendezvous(
    agent_id: RowId, allocation_id: RowId, body: schemas.Rendezvous, services: ServicesDep, principal: AgentDep
) -> Response:
    """Node rank 0's agent tells where the gang meets; the other agents are woken to launch."""
    access.agent_acts_as(principal, agent_id)
    report = schemas.RendezvousReport(kind="rendezvous", allocation_id=allocation_id, master_port=body.master_port)
    await _in_transaction(services, lambda s: node_reports_of.apply_report(s, agent_id, report))
    return Response(status_code=204)


@router.post("/{agent_id}/allocations/{allocation_id}/started", status_code=204)
async def node_started(
    agent_id: RowId, allocation_id: RowId, body: schemas.NodeStarted, services: ServicesDep, principal: AgentDep
) -> Response:
    access.agent_acts_as(principal, agent_id)
    report = schemas.StartedReport(kind="started", allocation_id=allocation_id, node_rank=body.node_rank)
    await _in_transaction(services, lambda s: node_reports_of.apply_report(s, agent_id, report))
    return Response(status_code=204)


@router.post("/{agent_id}/allocations/{allocation_id}/exit", status_code=204)
async def node_exit(
    agent_id: RowId, allocation_id: RowId, body: schemas.NodeExit, services: ServicesDep, principal: AgentDep
) -> Response:
    access.agent_acts_as(principal, agent_id)
    report = schemas.ExitReport(kind="exit", allocation_id=allocation_id, **body.model_dump())
    await _in_transaction(services, lambda s: node_reports_of.apply_report(s, agent_id, report))
    return Response(status_code=204)


@router.post("/{agent_id}/allocations/{allocation_id}/environment", response_model=schemas.EnvironmentLocked)
def environment_lock(
    agent_id: RowId, allocation_id: RowId, body: schemas.EnvironmentLock, session: SessionDep, principal: AgentDep
) -> schemas.EnvironmentLocked:
    """Node rank 0's agent reports what the job's runtime environment resolved to; the answer is
    the job's lock, which is this one unless another node or attempt reported first."""
    access.agent_acts_as(principal, agent_id)
    with session.begin():
        allocation, _node = attempts.find_node(session, agent_id, allocation_id, 0)
        lock = attempts.record_environment_lock(session, allocation, body.lock)
    return schemas.EnvironmentLocked(lock=lock)


@router.post("/{agent_id}/logs", response_model=schemas.ReportOutcomes)
async def ship_agent_logs(
    agent_id: RowId, body: schemas.AgentLogBatches, services: ServicesDep, principal: AgentDep
) -> schemas.ReportOutcomes:
    """Batches of lines of several allocations of the agent, each stored (once, by its `batch_id`)
    or refused on its own: one outcome per batch, in the order sent."""
    access.agent_acts_as(principal, agent_id)
    outcomes = await _in_transaction(services, lambda s: node_reports_of.store_log_batches(s, agent_id, body.batches))
    return schemas.ReportOutcomes(results=outcomes)


@router.post("/{agent_id}/allocations/{allocation_id}/logs", status_code=204)
async def ship_logs(
    agent_id: RowId, allocation_id: RowId, request: Request, services: ServicesDep, principal: AgentDep
) -> Response:
    """Store a batch of output lines; a batch sent again (same `batch_id`, or the same bytes) is
    answered 204 and stored once."""
    access.agent_acts_as(principal, agent_id)
    raw = await request.body()  # capped while it streamed (server/body_caps.py)
    try:
        batch = schemas.LogBatch.model_validate_json(raw)
    except ValidationError as exc:
        raise invalid_batch("log batch", exc) from exc
    identity = batch_identity(batch.batch_id, raw)
    batches = [node_reports_of.LinesOf(allocation_id, identity, batch.lines)]
    (refusal,) = await _in_transaction(services, lambda s: node_reports_of.store_logs(s, agent_id, batches))
    if refusal is not None:
        raise refusal
    return Response(status_code=204)
