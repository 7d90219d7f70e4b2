"""Agents: registration, heartbeats, drains and loss, and the slots they offer.

An agent is ACTIVE, DRAINING (no new work; its attempts checkpoint and restart elsewhere) or LOST
(no heartbeat for the timeout, by the database clock). Each agent holds its own token, made at its
first registration; a name stays with that agent until it is LOST. States change only through
`server.transitions` (`AGENT_ALLOWED`): a restarted agent that re-registers stays DRAINING if it
was drained (a cluster admin undrains it), and a LOST one becomes ACTIVE when it registers again.
Functions flush, never commit, and note their effects in the session.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Literal

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from phalanx.schemas import AgentRegistration, AgentState
from server.attempts import Failure, end_attempts_on_agent, fail_nodes_on_agent
from server.auth import agent_token, new_agent_secret
from server.db import SERVER_STARTED
from server.errors import Conflict, NotFound
from server.models import Agent, ControlPlane, SlotLease, utcnow
from server.placement import AgentSlots
from server.transitions import db_now, transition_agent
from server.wakeups import note_agent_work, note_schedule


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


def get_agent(session: Session, agent_id: int, *, lock: bool = False) -> Agent:
    agent = session.get(Agent, agent_id, with_for_update=lock, populate_existing=lock)
    if agent is None:
        raise NotFound(f"agent {agent_id} is not registered; `phalanx agents list` shows them")
    return agent


def register_agent(session: Session, registration: AgentRegistration, proven_agent_id: int | None) -> tuple[Agent, str]:
    """Register, or re-register after a restart: the agent's old processes are gone, so are its
    nodes (their attempts restart elsewhere). A drained agent stays DRAINING.

    A name belongs to the agent that first registered it: `proven_agent_id` is the agent the
    caller's token proves it is (its own token, or the one it presents in the registration).
    Another caller may take the name over only once that agent is LOST (its machine was
    replaced); otherwise 409. Every registration makes the agent a new secret (the old token stops
    working): returns the agent and its new token."""
    agent = session.scalars(
        select(Agent).where(Agent.name == registration.name).with_for_update().execution_options(populate_existing=True)
    ).one_or_none()
    now = db_now(session)
    if agent is None:
        agent = Agent(name=registration.name, state=AgentState.ACTIVE.value)
        session.add(agent)
    elif agent.id != proven_agent_id and agent.credential_hash is not None and agent.state != AgentState.LOST.value:
        raise Conflict(
            f"agent name {registration.name!r} belongs to a running agent ({agent.state}); if this is that "
            "agent restarting, start it with the same work dir (it keeps its agent token there), otherwise "
            "choose another --name or wait until the old agent is declared lost"
        )
    else:
        fail_nodes_on_agent(session, agent, "the agent restarted while the node ran")
        if agent.state == AgentState.LOST.value:
            transition_agent(session, agent, AgentState.ACTIVE)
    secret, agent.credential_hash = new_agent_secret()
    agent.address = registration.address
    agent.cpu_slots = registration.cpu_slots
    agent.gpu_slots = registration.gpu_slots
    agent.last_heartbeat = now
    session.flush()
    note_agent_work(session, [agent.id])
    note_schedule(session)  # its slots are free
    return agent, agent_token(agent.id, secret)


# Why a heartbeat did not count (yet): the agent is not registered, it was declared LOST, or its
# row is locked by a transaction that may be declaring it lost ("busy": try again once it ends).
HeartbeatOutcome = Literal["unknown", "lost", "busy"]


def heartbeat_many(session: Session, agent_ids: Sequence[int]) -> dict[int, HeartbeatOutcome]:
    """Stamp the agents' heartbeats with the database clock in one statement; returns the ones that
    did not count and why (a LOST agent must register again). A row another transaction holds
    for update (the reaper failing that agent's nodes, its registration) is skipped, not waited for: one
    locked agent must not hold up the heartbeats of all the others, or they too would age past
    the timeout. Rows are locked in id order, so two servers' batches never deadlock."""
    if not agent_ids:
        return {}
    live = (
        select(Agent.id)
        .where(Agent.id.in_(agent_ids), Agent.state != AgentState.LOST.value)
        .order_by(Agent.id)
        # NO KEY UPDATE, the lock an UPDATE of a non-key column takes: plain FOR UPDATE also
        # conflicts with the KEY SHARE locks that inserting a node or a slot lease takes on its
        # agent, so every agent a scheduling pass had just placed work on looked locked.
        .with_for_update(skip_locked=True, key_share=True)
    )
    stamped = set(
        session.scalars(update(Agent).where(Agent.id.in_(live)).values(last_heartbeat=utcnow()).returning(Agent.id))
    )
    missing = [i for i in agent_ids if i not in stamped]
    if not missing:
        return {}
    states = dict(session.execute(select(Agent.id, Agent.state).where(Agent.id.in_(missing))).all())
    return {
        i: "unknown" if i not in states else "lost" if states[i] == AgentState.LOST.value else "busy" for i in missing
    }


def drain_agent(session: Session, agent: Agent) -> None:
    """No new work for the agent (locked by the caller); the attempts it hosts checkpoint, stop,
    and restart elsewhere. Draining a DRAINING agent changes nothing."""
    if agent.state != AgentState.DRAINING.value:
        transition_agent(session, agent, AgentState.DRAINING)
    note_agent_work(session, [agent.id])
    end_attempts_on_agent(session, agent, Failure("infra", f"preempted: agent {agent.name} is draining", graceful=True))


def undrain_agent(session: Session, agent: Agent) -> None:
    """The (locked) agent takes work again; undraining an ACTIVE agent changes nothing, a LOST one
    must register again first (409)."""
    if agent.state == AgentState.DRAINING.value:
        transition_agent(session, agent, AgentState.ACTIVE)
        note_agent_work(session, [agent.id])
        note_schedule(session)  # its slots are free for the queue
    elif agent.state == AgentState.LOST.value:
        raise Conflict(f"agent {agent.name} is lost; it takes work again once it registers")


def silent_agents(session: Session, heartbeat_timeout: float) -> list[int]:
    """Ids of the agents whose last heartbeat is older than the timeout, by the database clock.

    No agent can heartbeat while no server runs, so for one timeout after a server (re)start
    there are none: a control-plane restart must not restart every job."""
    cutoff = db_now(session) - timedelta(seconds=heartbeat_timeout)
    started = session.get(ControlPlane, SERVER_STARTED)
    if started is not None and started.time > cutoff:
        return []
    return list(
        session.scalars(
            select(Agent.id)
            .where(Agent.state != AgentState.LOST.value, Agent.last_heartbeat < cutoff)
            .order_by(Agent.id)
        )
    )


def declare_lost(session: Session, agent_id: int, heartbeat_timeout: float) -> bool:
    """The agent becomes LOST and its nodes' attempts restart elsewhere, if it is still silent
    when its row is locked (a heartbeat may have come since `silent_agents` read it). False when
    it was not: it heartbeated, or its row is locked by a heartbeat or another reaper (skipped;
    the next pass looks again).

    Each agent goes in a transaction of its own: ending its attempts locks their jobs' rows, and
    a transaction over hundreds of lost agents held those locks for tens of seconds while the
    server's route threads queued on them."""
    cutoff = db_now(session) - timedelta(seconds=heartbeat_timeout)
    agent = session.scalars(
        select(Agent)
        .where(Agent.id == agent_id, Agent.state != AgentState.LOST.value, Agent.last_heartbeat < cutoff)
        .with_for_update(skip_locked=True)
    ).one_or_none()
    if agent is None:
        return False
    transition_agent(session, agent, AgentState.LOST)
    # Its own channel too: an agent that is alive after all learns at once that it was declared lost.
    note_agent_work(session, [agent.id])
    fail_nodes_on_agent(session, agent, f"agent {agent.name} lost: no heartbeat for over {heartbeat_timeout:g} s")
    session.flush()
    return True
