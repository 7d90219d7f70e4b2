"""What fair sharing reads from the database: the queue as `PendingJob`s, each team's quota, the
jobs holding slots, and each team's decayed usage. `server.placement` decides from these; this
module only reads.

Usage is derived from allocation rows alone (placement time, node end time, slot count), so it
survives a restart of every component and needs no counter of its own. A slot counts from its
attempt's placement until its node exited: queued-for-launch and stopping time is charged, since
nobody else could use the slot then either.

Decayed usage, like Slurm's: a slot-second ``a`` seconds ago counts ``2 ** (-a / half_life)``.
Divided by ``half_life / ln 2`` it is in *slots*: a team that held ``s`` slots for long enough has a
decayed usage of ``s``, so it adds to what the team holds now on the same scale.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import TypeVarTuple

from sqlalchemy import DateTime, Select, case, func, literal, or_, select
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement

from phalanx.schemas import JobState
from server.attempts import PREEMPTED
from server.models import Allocation, AllocationNode, Job, SlotLease, Team, User, seconds_between
from server.placement import PendingJob, RunningJob, Sharing, TeamQuota
from server.settings import Settings

Row = TypeVarTuple("Row")  # a query's columns, kept through `_held_between`

# Older slot-seconds count less than 2**-10 of new ones: past this many half-lives they are skipped.
HALF_LIVES_READ = 10
# PostgreSQL's exp() raises on underflow rather than returning 0: a node running for a thousand
# half-lives would fail every pass. exp(-700) is ~1e-304, as good as 0 beside any other term.
MIN_EXPONENT = -700.0


@dataclass(frozen=True, slots=True)
class SlotInterval:
    """Slots one node of one attempt held, from its placement to its exit (None: still held)."""

    user: str
    team: str  # "" : no team
    slot_type: str
    slots: int
    job_id: int
    start: datetime
    end: datetime | None


def decayed_slots(interval_start: datetime, interval_end: datetime, now: datetime, half_life_s: float) -> float:
    """The decayed slot-seconds of one slot held over the interval, in slots (see the module doc)."""
    age_end = max(0.0, (now - interval_end).total_seconds())
    age_start = max(age_end, (now - interval_start).total_seconds())
    # The integral of 2**(-a/h) da from age_end to age_start, times ln2/h.
    return float(2.0 ** (-age_end / half_life_s) - 2.0 ** (-age_start / half_life_s))


def decayed_usage(intervals: Iterable[SlotInterval], now: datetime, half_life_s: float) -> dict[tuple[str, str], float]:
    """(team, slot type) -> decayed usage in slots. Pure."""
    usage: dict[tuple[str, str], float] = {}
    for interval in intervals:
        held = decayed_slots(interval.start, interval.end or now, now, half_life_s) * interval.slots
        key = (interval.team, interval.slot_type)
        usage[key] = usage.get(key, 0.0) + held
    return usage


def _held_between(query: Select[*Row], since: datetime, until: datetime | ColumnElement[datetime]) -> Select[*Row]:
    """`query` over the nodes that held slots at some time in [since, until), each joined to its
    attempt, its job and the job's team (if any)."""
    return (
        query.select_from(AllocationNode)
        .join(Allocation, AllocationNode.allocation_id == Allocation.id)
        .join(Job, Allocation.job_id == Job.id)
        .outerjoin(Team, Job.team_id == Team.id)
        .where(
            Allocation.created_at < until,
            or_(AllocationNode.ended_at.is_(None), AllocationNode.ended_at >= since),
        )
    )


def decayed_usage_in_database(session: Session, now: datetime, half_life_s: float) -> dict[tuple[str, str], float]:
    """`decayed_usage` of every node that held slots in the last `HALF_LIVES_READ` half-lives, summed
    by the database: one row per team and slot type, however many nodes ran.

    Every scheduling pass and queue snapshot reads it. Read as one row per node and decayed in
    Python, it grew with the history: a cluster of 1,000 agents whose jobs take ten minutes ends
    ~48,000 nodes an hour, ~480,000 in the ten half-lives of the default hour
    (`bench/bench_sharing_history.py`)."""
    at: ColumnElement[datetime] = literal(now, DateTime())
    since = now - timedelta(seconds=half_life_s * HALF_LIVES_READ)
    rate = -math.log(2.0) / half_life_s

    def at_least(value: ColumnElement[float], floor: ColumnElement[float] | float) -> ColumnElement[float]:
        return case((value < floor, floor), else_=value)

    # as `decayed_slots`: the ages of the interval's end and start, never negative nor reversed
    age_end = at_least(seconds_between(func.coalesce(AllocationNode.ended_at, at), at), 0.0)
    age_start = at_least(seconds_between(Allocation.created_at, at), age_end)
    held = func.exp(at_least(age_end * rate, MIN_EXPONENT)) - func.exp(at_least(age_start * rate, MIN_EXPONENT))
    summed = select(
        Team.name, AllocationNode.slot_type, func.sum(func.json_array_length(AllocationNode.slot_indices) * held)
    )
    rows = session.execute(_held_between(summed, since, at).group_by(Team.name, AllocationNode.slot_type)).all()
    return {(team or "", slot_type): float(usage or 0.0) for team, slot_type, usage in rows}


def slot_intervals(session: Session, since: datetime, until: datetime) -> list[SlotInterval]:
    """Every node that held slots at some time in [since, until)."""
    intervals = select(
        User.name,
        Team.name,
        AllocationNode.slot_type,
        # counted by the database: decoding every node's JSON list was most of a pass's reads
        func.json_array_length(AllocationNode.slot_indices),
        Job.id,
        Allocation.created_at,
        AllocationNode.ended_at,
    )
    rows = session.execute(_held_between(intervals, since, until).join(User, Job.owner_id == User.id)).all()
    return [
        SlotInterval(user, team or "", slot_type, slots or 0, job_id, start, end)
        for user, team, slot_type, slots, job_id, start, end in rows
    ]


def team_quotas(session: Session) -> dict[str, TeamQuota]:
    return {
        team.name: TeamQuota(
            weight=team.weight,
            guarantee=dict(team.guarantee or {}),
            limit=dict(team.slot_limit or {}),
            user_limit=dict(team.user_limit or {}),
            held=team.queue_held,
        )
        for team in session.scalars(select(Team))
    }


def running_jobs(session: Session, now: datetime) -> list[RunningJob]:
    """Every job holding slots now, from the slot leases (the truth of what is held)."""
    rows = session.execute(
        select(
            Job.id,
            Team.name,
            User.name,
            Job.state,
            Job.priority,
            Job.preempted_by,
            Allocation.created_at,
            Allocation.end_reason,
            SlotLease.slot_type,
            SlotLease.agent_id,
            func.count(),
        )
        .select_from(SlotLease)
        .join(AllocationNode, SlotLease.node_id == AllocationNode.id)
        .join(Allocation, AllocationNode.allocation_id == Allocation.id)
        .join(Job, Allocation.job_id == Job.id)
        .join(User, Job.owner_id == User.id)
        .outerjoin(Team, Job.team_id == Team.id)
        .group_by(
            Job.id,
            Team.name,
            User.name,
            Job.state,
            Job.priority,
            Job.preempted_by,
            Allocation.id,
            SlotLease.slot_type,
            SlotLease.agent_id,
        )
        .order_by(Job.id, SlotLease.agent_id)
    ).all()
    slots: dict[tuple[int, str], list[tuple[int, int]]] = {}
    first: dict[tuple[int, str], RunningJob] = {}
    for job_id, team, user, state, priority, preempted_by, placed_at, end_reason, slot_type, agent_id, count in rows:
        key = (job_id, slot_type)
        slots.setdefault(key, []).append((agent_id, count))
        if key not in first:
            leaving = end_reason is not None or state not in (JobState.RUNNING.value, JobState.SCHEDULED.value)
            runtime = max(0.0, (now - placed_at).total_seconds())
            preempted = leaving and end_reason is not None and end_reason.startswith(PREEMPTED)
            first[key] = RunningJob(
                job_id, team or "", user, slot_type, priority, (), runtime, leaving, preempted_by if preempted else None
            )
    return [replace(run, slots=tuple(slots[key])) for key, run in first.items()]


def load_sharing(session: Session, now: datetime, settings: Settings) -> Sharing:
    return Sharing(
        teams=team_quotas(session),
        usage=decayed_usage_in_database(session, now, settings.fair_share_half_life),
        running=running_jobs(session, now),
        min_runtime_s=settings.preemption_min_runtime,
        history_weight=settings.fair_share_history_weight,
    )


@dataclass(frozen=True, slots=True)
class QueuedJob:
    """A QUEUED job as a scheduling pass reads it: what placement needs, and the reason it shows
    now (a pass writes only the reasons that change)."""

    pending: PendingJob
    wait_reason: str | None


def queued_jobs(session: Session, *, winding_down: bool = False) -> list[QueuedJob]:
    """Every QUEUED job whose previous attempt has no workers left (never two attempts at once), in
    one query of the columns placement reads: no ORM objects, no specs, no locks (the pass locks
    only the jobs it places). `winding_down`: those whose previous attempt's workers are still
    stopping too (the queue's view shows them in line)."""
    query = (
        select(
            Job.id,
            Job.priority,
            Job.nodes,
            Job.slots_per_node,
            Job.slot_type,
            Team.name,
            User.name,
            Job.held,
            Job.preempted_by,
            Job.wait_reason,
        )
        .join(User, Job.owner_id == User.id)
        .outerjoin(Team, Job.team_id == Team.id)
        .where(Job.state == JobState.QUEUED.value)
        .order_by(Job.id)
    )
    if not winding_down:
        query = query.where(Job.id.not_in(select(Allocation.job_id).where(Allocation.active.is_(True))))
    rows = session.execute(query)
    return [
        QueuedJob(
            PendingJob(
                job_id=job_id,
                priority=priority,
                seq=job_id,
                nodes=nodes,
                slots_per_node=slots_per_node,
                slot_type=slot_type,
                team=team or "",
                user=user,
                held=held,
                preempted_by=preempted_by,
            ),
            wait_reason,
        )
        for job_id, priority, nodes, slots_per_node, slot_type, team, user, held, preempted_by, wait_reason in rows
    ]


def slot_hours(interval: SlotInterval, since: datetime, until: datetime) -> float:
    """The slot-hours of one interval that fall within [since, until)."""
    start = max(interval.start, since)
    end = min(interval.end or until, until)
    return max(0.0, (end - start).total_seconds()) * interval.slots / 3600.0
