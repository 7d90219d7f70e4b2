"""The overview (slots, queue, running jobs, recent failures) and the agents with their drain buttons."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import RedirectResponse, Response
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from phalanx import schemas
from server import access, commands, views
from server.api.deps import MAX_ROW_ID, RowId, SessionDep
from server.auth import Principal
from server.dashboard.job_pages import jobs_version
from server.dashboard.render import CsrfChecked, SignedIn, render
from server.models import Agent, Allocation, AllocationNode, Job, SlotLease, utcnow

router = APIRouter(include_in_schema=False)
RECENT_FAILURES = 5
AGENTS_PAGE = 100


@dataclass(frozen=True)
class AgentTotals:
    """The agents by state and the cluster's slots: free (on ACTIVE agents), used (held on agents
    not LOST), lost (every slot of a LOST agent)."""

    agents: dict[str, int]
    free: int
    used: int
    lost: int


def agent_totals(session: Session) -> AgentTotals:
    """One aggregate query, whatever the number of agents (no agent row is loaded)."""
    held = select(SlotLease.agent_id, func.count().label("held")).group_by(SlotLease.agent_id).subquery()
    query = (
        select(
            Agent.state,
            func.count(),
            func.coalesce(func.sum(Agent.cpu_slots + Agent.gpu_slots), 0),
            func.coalesce(func.sum(held.c.held), 0),
        )
        .outerjoin(held, held.c.agent_id == Agent.id)
        .group_by(Agent.state)
    )
    agents, free, used, lost = {}, 0, 0, 0
    for state, count, slots, taken in session.execute(query):
        agents[state] = count
        if state == schemas.AgentState.LOST.value:
            lost += slots
            continue
        used += taken
        free += slots - taken if state == schemas.AgentState.ACTIVE.value else 0
    return AgentTotals(agents=agents, free=free, used=used, lost=lost)


@router.get("/overview", response_model=None)
def overview_page(request: Request, session: SessionDep, user: SignedIn) -> Response:
    with session.begin():
        totals = agent_totals(session)
        teams = access.member_teams(session, user)
        counts = {state: n for state, n in session.execute(count_by_state(user, teams))}
        running = views.jobs(
            session,
            session.execute(
                access.visible_jobs(user, teams).where(Job.state == "RUNNING").order_by(Job.id.desc()).limit(20)
            ).all(),
        )
        failures = views.jobs(
            session,
            session.execute(
                access.visible_jobs(user, teams)
                .where(Job.state == "FAILED")
                .order_by(Job.ended_at.desc())
                .limit(RECENT_FAILURES)
            ).all(),
            latest=False,
        )
        version = jobs_version(session)
    return render(
        request,
        "overview.html",
        totals=totals,
        agent_states=list(schemas.AgentState),
        counts=counts,
        running=running,
        failures=failures,
        version=version,
    )


def count_by_state(user: Principal, teams: Collection[int] | None = None) -> Any:
    return select(Job.state, func.count()).where(access.job_readable(user, teams)).group_by(Job.state)


@router.get("/agents", response_model=None)
def agents_page(
    request: Request,
    session: SessionDep,
    user: SignedIn,
    after: Annotated[int, Query(ge=0, le=MAX_ROW_ID, description="The page after the agent with this id")] = 0,
) -> Response:
    """AGENTS_PAGE agents by id (after agent `after`) with the count of every agent by state: each
    one's slots, which job and rank holds each (named only if the user may read that job), its
    heartbeat's age, and for cluster admins a drain button."""
    with session.begin():
        totals = agent_totals(session)
        found = list(session.scalars(select(Agent).where(Agent.id > after).order_by(Agent.id).limit(AGENTS_PAGE + 1)))
        agents = found[:AGENTS_PAGE]
        now = session.execute(select(utcnow())).scalar_one()
        holders = slot_holders(session, user, [a.id for a in agents])
        rows = [
            {
                "agent": view,
                "heartbeat_age": (now - view.last_heartbeat).total_seconds(),
                "slots": [
                    (slot_type, index, (view.id, slot_type, index) in holders, holders.get((view.id, slot_type, index)))
                    for slot_type, count in (("cpu", view.cpu_slots), ("gpu", view.gpu_slots))
                    for index in range(count)
                ],
            }
            for view in views.agents(session, agents)
        ]
    return render(
        request,
        "agents.html",
        rows=rows,
        totals=totals,
        agent_states=list(schemas.AgentState),
        paged=after > 0,
        more=len(found) > AGENTS_PAGE,
    )


def slot_holders(
    session: Session, user: Principal, agent_ids: Collection[int]
) -> dict[tuple[int, str, int], tuple[int, str, int] | None]:
    """(agent, slot type, slot index) → (job id, job name, global rank) for every held slot of the
    agents `agent_ids`; None for the slots of jobs `user` may not read (that a slot is taken is all
    they learn)."""
    if not agent_ids:
        return {}
    # columns, not rows: a page's 800 slots loaded their jobs whole, specs and all
    held = session.execute(
        select(
            SlotLease.agent_id,
            SlotLease.slot_type,
            SlotLease.slot_index,
            AllocationNode.slot_indices,
            AllocationNode.node_rank,
            Job.id,
            Job.name,
            Job.slots_per_node,
            access.job_readable(user),
        )
        .join(AllocationNode, AllocationNode.id == SlotLease.node_id)
        .join(Allocation, Allocation.id == AllocationNode.allocation_id)
        .join(Job, Job.id == Allocation.job_id)
        .where(SlotLease.agent_id.in_(agent_ids))
    )
    holders: dict[tuple[int, str, int], tuple[int, str, int] | None] = {}
    for agent_id, slot_type, slot_index, slot_indices, node_rank, job_id, name, slots_per_node, readable in held:
        local_rank = list(slot_indices).index(slot_index)
        holders[(agent_id, slot_type, slot_index)] = (
            (job_id, name, node_rank * slots_per_node + local_rank) if readable else None
        )
    return holders


@router.post("/agents/{agent_id}/drain", response_model=None)
def drain_agent(agent_id: RowId, session: SessionDep, user: SignedIn, _: CsrfChecked) -> Response:
    commands.drain_agent(session, user, agent_id)
    return RedirectResponse("/agents", status_code=303)


@router.post("/agents/{agent_id}/undrain", response_model=None)
def undrain_agent(agent_id: RowId, session: SessionDep, user: SignedIn, _: CsrfChecked) -> Response:
    commands.undrain_agent(session, user, agent_id)
    return RedirectResponse("/agents", status_code=303)
