"""The overview (slots, queue, running jobs, recent failures) and the agents with their drain buttons."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from phalanx import schemas
from server import access, commands, views
from server.api.deps import RowId, SessionDep
from server.auth import Principal
from server.dashboard.job_pages import jobs_version
from server.dashboard.render import CsrfChecked, SignedIn, render
from server.models import Agent, Allocation, AllocationNode, Job, SlotLease, utcnow

router = APIRouter(include_in_schema=False)
RECENT_FAILURES = 5


@router.get("/overview", response_model=None)
def overview_page(request: Request, session: SessionDep, user: SignedIn) -> Response:
    with session.begin():
        agents = views.agents(session, list(session.scalars(select(Agent).order_by(Agent.id))))
        slots = {"free": 0, "used": 0, "lost": 0}
        for agent in agents:
            total = agent.cpu_slots + agent.gpu_slots
            used = agent.used_cpu_slots + agent.used_gpu_slots
            if agent.state is schemas.AgentState.LOST:
                slots["lost"] += total
            else:
                slots["used"] += used
                slots["free"] += total - used if agent.state is schemas.AgentState.ACTIVE else 0
        counts = {state: n for state, n in session.execute(count_by_state(user))}
        running = views.jobs(
            session,
            list(
                session.scalars(
                    access.visible_jobs(user).where(Job.state == "RUNNING").order_by(Job.id.desc()).limit(20)
                )
            ),
        )
        failures = views.jobs(
            session,
            list(
                session.scalars(
                    access.visible_jobs(user)
                    .where(Job.state == "FAILED")
                    .order_by(Job.ended_at.desc())
                    .limit(RECENT_FAILURES)
                )
            ),
            latest=False,
        )
        version = jobs_version(session)
    return render(
        request,
        "overview.html",
        agents=agents,
        slots=slots,
        counts=counts,
        running=running,
        failures=failures,
        version=version,
    )


def count_by_state(user: Principal) -> Any:
    return select(Job.state, func.count()).where(access.job_readable(user)).group_by(Job.state)


@router.get("/agents", response_model=None)
def agents_page(request: Request, session: SessionDep, user: SignedIn) -> Response:
    """Every agent's slots, which job and rank holds each (named only if the user may read that
    job), its heartbeat's age, and for cluster admins a drain button."""
    with session.begin():
        agents = list(session.scalars(select(Agent).order_by(Agent.id)))
        now = session.execute(select(utcnow())).scalar_one()
        holders = slot_holders(session, user)
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
    return render(request, "agents.html", rows=rows)


def slot_holders(session: Session, user: Principal) -> dict[tuple[int, str, int], tuple[int, str, int] | None]:
    """(agent, slot type, slot index) → (job id, job name, global rank) for every held slot; None
    for the slots of jobs `user` may not read (that a slot is taken is all they learn)."""
    held = session.execute(
        select(SlotLease, AllocationNode, Job, access.job_readable(user))
        .join(AllocationNode, AllocationNode.id == SlotLease.node_id)
        .join(Allocation, Allocation.id == AllocationNode.allocation_id)
        .join(Job, Job.id == Allocation.job_id)
    )
    holders: dict[tuple[int, str, int], tuple[int, str, int] | None] = {}
    for lease, node, job, readable in held:
        local_rank = list(node.slot_indices).index(lease.slot_index)
        key = (lease.agent_id, lease.slot_type, lease.slot_index)
        holders[key] = (job.id, job.name, node.node_rank * job.slots_per_node + local_rank) if readable else None
    return holders


@router.post("/agents/{agent_id}/drain", response_model=None)
def drain_agent(agent_id: RowId, session: SessionDep, user: SignedIn, _: CsrfChecked) -> Response:
    commands.drain_agent(session, user, agent_id)
    return RedirectResponse("/agents", status_code=303)


@router.post("/agents/{agent_id}/undrain", response_model=None)
def undrain_agent(agent_id: RowId, session: SessionDep, user: SignedIn, _: CsrfChecked) -> Response:
    commands.undrain_agent(session, user, agent_id)
    return RedirectResponse("/agents", status_code=303)
