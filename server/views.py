"""ORM rows → response schemas. The only place that knows both shapes."""

from __future__ import annotations

import hashlib
import json
import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any, Literal, TypeAlias

from sqlalchemy import Row, Select, Text, cast, func, select
from sqlalchemy.orm import Session, selectinload
from sqlalchemy.orm.attributes import instance_state

from phalanx import figures, schemas
from server import profiles
from server.auth import Principal
from server.models import (
    Agent,
    Allocation,
    AllocationNode,
    ApiToken,
    Checkpoint,
    Job,
    LogLine,
    Metric,
    SlotLease,
    Team,
    TuningStudy,
    TuningTrial,
    User,
)
from server.queue_status import SUBMITTED_SINCE, QueueSnapshot, queue_snapshot
from server.settings import Settings

# Loader options for a query whose rows `job_detail` converts: events, attempts, nodes and agents
# in four queries, whatever the number of attempts.
JOB_DETAIL_LOADS = (
    selectinload(Job.events),
    selectinload(Job.allocations).selectinload(Allocation.nodes).selectinload(AllocationNode.agent),
)


# The columns of a job's view, its owner's name and its trial joined: a page of jobs in one query,
# read as rows. As ORM objects, their owners loaded and each spec validated, a page of 100 cost
# ~11 ms of a loaded server's core, where it costs ~7 so (bench/RESULTS.md, "Eleventh session").
JOB_VIEW_COLUMNS = (
    Job.id,
    Job.name,
    Job.state,
    cast(Job.spec, Text).label("spec_json"),
    User.name.label("owner_name"),
    Job.priority,
    Job.wait_reason,
    Job.failure_reason,
    Job.submitted_at,
    Job.started_at,
    Job.ended_at,
    Job.attempts,
    Job.restarts_used,
    Job.infra_restarts_used,
    Job.held,
    TuningTrial.study_id,
    TuningTrial.number.label("trial_number"),
)
JobRow: TypeAlias = "Row[*tuple[Any, ...]]"  # a row of `job_rows`
LatestMetrics: TypeAlias = tuple[dict[str, float], int | None]  # a job's latest values, and their step
# Specs longer than this are validated at each read rather than kept (`stored_spec`).
MAX_KEPT_SPEC_CHARS = 16 * 1024


def job_rows() -> Select[*tuple[Any, ...]]:
    """Jobs as the rows `jobs` converts: filter, order and limit it as a `select(Job)`."""
    return (
        select(*JOB_VIEW_COLUMNS)
        .join(User, User.id == Job.owner_id)
        .outerjoin(TuningTrial, TuningTrial.job_id == Job.id)
    )


def job(session: Session, job_id: int, *, latest: bool = True) -> schemas.JobView:
    """Job `job_id`'s view as of this transaction (what the session holds is flushed first)."""
    return jobs(session, session.execute(job_rows().where(Job.id == job_id)).all(), latest=latest)[0]


def jobs(
    session: Session,
    rows: Sequence[JobRow],
    *,
    latest: bool | Mapping[int, LatestMetrics] = True,
    queue: QueueSnapshot | None = None,
) -> list[schemas.JobView]:
    """`job_rows` rows as views, in their order; their newest metrics (`latest`) in one more query
    whatever their number, or from `latest` when the caller has them. With `queue`, each QUEUED
    row says where it stands in line."""
    if not isinstance(latest, bool):
        metrics: Mapping[int, LatestMetrics] = latest
    else:
        metrics = latest_metrics_by_job(session, [row.id for row in rows]) if latest and rows else {}
    result = []
    for row in rows:
        values, step = metrics.get(row.id, ({}, None))
        spec = stored_spec(row.spec_json)
        result.append(
            schemas.JobView(
                id=row.id,
                name=row.name,
                state=schemas.JobState(row.state),
                spec=spec,
                owner=row.owner_name,
                team=spec.team,
                priority=row.priority,
                wait_reason=row.wait_reason,
                failure_reason=row.failure_reason,
                submitted_at=row.submitted_at,
                started_at=row.started_at,
                ended_at=row.ended_at,
                attempts=row.attempts,
                restarts_used=row.restarts_used,
                infra_restarts_used=row.infra_restarts_used,
                latest_metrics=values,
                latest_step=step,
                study_id=row.study_id,
                trial_number=row.trial_number,
                held=row.held,
                queue=queue_place(queue, row) if queue is not None else None,
            )
        )
    return result


def stored_spec(text: str) -> schemas.JobSpec:
    """A job's stored spec (JSON), validated. A spec never changes once stored, and the lists read
    the newest jobs' specs again and again: the last 2,048 read are kept, validated once per
    process. The views share them: never change a view's `spec` in place."""
    return _kept_spec(text) if len(text) <= MAX_KEPT_SPEC_CHARS else schemas.JobSpec.model_validate_json(text)


@lru_cache(maxsize=2048)
def _kept_spec(text: str) -> schemas.JobSpec:
    return schemas.JobSpec.model_validate_json(text)


def queue_snapshot_for(
    session: Session, rows: Sequence[Job | JobRow], settings: Settings, *, exact: bool = True
) -> QueueSnapshot | None:
    """The queue's state, when some of the rows wait in it (a kept snapshot, or one placement pass);
    a list's is not `exact` (`queue_status.queue_snapshot`)."""
    queued = [row.id for row in rows if row.state == schemas.JobState.QUEUED.value]
    if queued:
        return queue_snapshot(session, settings, showing=queued, exact=exact)
    return None


def newest_queued(session: Session) -> list[int]:
    """The newest QUEUED job's id (or none): a queue shown whole must be as new as it."""
    newest = session.scalars(
        select(Job.id).where(Job.state == schemas.JobState.QUEUED.value).order_by(Job.id.desc()).limit(1)
    ).first()
    return [] if newest is None else [newest]


def queue_view(session: Session, readable: Collection[int], queue: QueueSnapshot, limit: int) -> schemas.QueueView:
    """The queue in placement order, then the held jobs; jobs outside `readable` without their name,
    owner or id."""
    held = sorted(job_id for job_id in queue.queued if job_id not in queue.positions)
    shown_ids = [*queue.order, *held][:limit]
    # the snapshot may be seconds old: a job placed, cancelled or deleted since is no longer queued
    still_queued = select(Job).where(Job.id.in_(shown_ids), Job.state == schemas.JobState.QUEUED.value)
    loaded = {job.id: job for job in session.scalars(still_queued)}
    shown = [loaded[job_id] for job_id in shown_ids if job_id in loaded]
    owners = owner_names(session, shown)
    entries = []
    for row in shown:
        visible = row.id in readable
        entries.append(
            schemas.QueueEntry(
                position=queue.positions.get(row.id),
                team_position=queue.team_positions.get(row.id),
                job_id=row.id if visible else None,
                name=row.name if visible else None,
                owner=owners[row.owner_id] if visible else None,
                team=row.spec.get("team"),
                priority=row.priority,
                nodes=row.nodes,
                slots_per_node=row.slots_per_node,
                slot_type=schemas.SlotType(row.slot_type),
                held=row.held,
                reason=queue.reasons.get(row.id, ""),  # names other jobs by id and team only
                estimated_start=queue.estimates.get(row.id),
                submitted_at=row.submitted_at,
            )
        )
    queued_now = session.scalar(select(func.count()).select_from(Job).where(Job.state == schemas.JobState.QUEUED.value))
    return schemas.QueueView(entries=entries, queued=queued_now or 0, estimated_at=queue.now)


def queue_place(queue: QueueSnapshot, row: Job | JobRow) -> schemas.QueuePlace | None:
    if row.state != schemas.JobState.QUEUED.value:
        return None
    if not queue.knows(row.id):
        return schemas.QueuePlace(
            position=None,
            team_position=None,
            queued=len(queue.order),
            reason=row.wait_reason or SUBMITTED_SINCE,
            estimated_start=None,
            estimate=SUBMITTED_SINCE,
        )
    return schemas.QueuePlace(
        position=queue.positions.get(row.id),
        team_position=queue.team_positions.get(row.id),
        queued=len(queue.order),
        reason=queue.reasons.get(row.id) or row.wait_reason or "",
        estimated_start=queue.estimates.get(row.id),
        estimate=queue.estimate_note(row.id),
    )


def owner_names(session: Session, rows: Sequence[Job | TuningStudy]) -> dict[int, str]:
    """Owner id → name for the rows: from owners already loaded (`selectinload`), the rest in one query."""
    names = {row.owner_id: row.owner.name for row in rows if "owner" not in instance_state(row).unloaded}
    missing = {row.owner_id for row in rows} - names.keys()
    if missing:
        names.update(
            {user_id: name for user_id, name in session.execute(select(User.id, User.name).where(User.id.in_(missing)))}
        )
    return names


def job_detail(session: Session, row: Job, settings: Settings) -> schemas.JobDetail:
    listed = session.execute(job_rows().where(Job.id == row.id)).all()
    # its attempts are loaded (`JOB_DETAIL_LOADS`): their metrics need no query of their own
    attempts = [(a.job_id, a.latest_metrics, a.latest_step) for a in row.allocations if a.latest_metrics is not None]
    view = jobs(session, listed, latest=_merged_latest(attempts), queue=queue_snapshot_for(session, [row], settings))[0]
    return schemas.JobDetail(
        **dict(view),  # its fields as they are: validated once, in `jobs`
        events=[
            schemas.JobEventView(
                time=e.time,
                from_state=schemas.JobState(e.from_state) if e.from_state else None,
                to_state=schemas.JobState(e.to_state),
                reason=e.reason,
            )
            for e in row.events
        ],
        allocations=[allocation(a) for a in row.allocations],
        env_lock=row.env_lock,
        communication=communication(session, row),
        profiles=profiles.job_profiles(session, row.id),
    )


def communication(session: Session, row: Job) -> schemas.Communication | None:
    """The job's communication figures from each rank's latest report in its latest attempt that
    reported any (one query on the metrics index); None when no rank reported them."""
    if not row.allocations:
        return None
    newest = (
        func.row_number()
        .over(partition_by=(Metric.rank, Metric.name), order_by=(Metric.step.desc(), Metric.id.desc()))
        .label("newest")
    )
    latest = (
        select(Metric.rank, Metric.name, Metric.value, Metric.step, newest)
        .where(
            Metric.job_id == row.id,
            Metric.name.in_(figures.COMMUNICATION),
            Metric.allocation_id == row.allocations[-1].id,
        )
        .subquery()
    )
    by_rank: dict[int, dict[str, float]] = defaultdict(dict)
    steps: dict[int, int] = {}
    for rank, name, value, step in session.execute(
        select(latest.c.rank, latest.c.name, latest.c.value, latest.c.step).where(latest.c.newest == 1)
    ):
        by_rank[rank][name] = value
        steps[rank] = max(steps.get(rank, 0), step)
    ranks = [
        _rank_communication(rank, steps[rank], values)
        for rank, values in sorted(by_rank.items())
        if all(name in values and math.isfinite(values[name]) for name in figures.COMMUNICATION)
    ]
    if not ranks:
        return None
    step_time = statistics.median(r.step_time_s for r in ranks)
    own_work = {r.rank: r.step_time_s - r.comm_exposed_s for r in ranks}
    typical = statistics.median(own_work.values())
    slowest = max(own_work, key=lambda rank: (own_work[rank], -rank))
    return schemas.Communication(
        step_time_s=step_time,
        comm_fraction=min(statistics.median(r.comm_exposed_s for r in ranks) / step_time, 1.0)
        if step_time > 0
        else 0.0,
        bytes_per_step=max(r.bytes_per_step for r in ranks),
        straggler_ratio=own_work[slowest] / typical if typical > 0 else 1.0,
        slowest_rank=slowest,
        ranks=ranks,
    )


def _rank_communication(rank: int, step: int, values: dict[str, float]) -> schemas.RankCommunication:
    step_time = values[figures.STEP_TIME]
    data, compute = values[figures.DATA_TIME], values[figures.COMPUTE_TIME]
    exposed = values[figures.COMM_EXPOSED]
    return schemas.RankCommunication(
        rank=rank,
        step=step,
        step_time_s=step_time,
        data_time_s=data,
        compute_time_s=compute,
        comm_exposed_s=exposed,
        comm_time_s=values[figures.COMM_TIME],
        other_s=max(step_time - data - compute - exposed, 0.0),
        bytes_per_step=values[figures.COMM_BYTES],
    )


def allocation(row: Allocation) -> schemas.AllocationView:
    return schemas.AllocationView(
        id=row.id,
        attempt=row.attempt,
        master_addr=row.master_addr,
        master_port=row.master_port,
        active=row.active,
        fenced=row.fenced,
        end_reason=row.end_reason,
        resume_step=row.resume_step,
        created_at=row.created_at,
        ended_at=row.ended_at,
        nodes=[
            schemas.NodeView(
                node_rank=n.node_rank,
                agent_id=n.agent_id,
                agent_name=n.agent.name,
                slot_indices=list(n.slot_indices),
                state=schemas.NodeState(n.state),
                exit_code=n.exit_code,
            )
            for n in row.nodes
        ],
    )


def latest_metrics_by_job(session: Session, job_ids: Collection[int]) -> dict[int, LatestMetrics]:
    """`latest_metrics` of each job in one query; jobs that reported nothing are absent."""
    rows = session.execute(
        select(Allocation.job_id, Allocation.latest_metrics, Allocation.latest_step)
        .where(Allocation.job_id.in_(job_ids), Allocation.latest_metrics.is_not(None))
        .order_by(Allocation.job_id, Allocation.attempt)
    )
    return _merged_latest(rows)


def _merged_latest(rows: Iterable[tuple[int, dict[str, float] | None, int | None]]) -> dict[int, LatestMetrics]:
    """(job id, latest metrics, latest step) of attempts in the order they were made, each job's
    attempts together: per job, its attempts' metrics merged (a later one's value wins) and the
    last attempt's step."""
    result: dict[int, LatestMetrics] = {}
    for job_id, metrics, newest_step in rows:
        values, _ = result.setdefault(job_id, ({}, None))
        # Phalanx's own figures have their place (JobDetail.communication); these are the script's
        values.update((name, value) for name, value in (metrics or {}).items() if not name.startswith(figures.PREFIX))
        result[job_id] = (values, newest_step)
    return result


# The columns of an agent's view: a list of a thousand agents reads these, not ORM objects.
AGENT_VIEW_COLUMNS = (
    Agent.id,
    Agent.name,
    Agent.address,
    Agent.state,
    Agent.cpu_slots,
    Agent.gpu_slots,
    Agent.registered_at,
    Agent.last_heartbeat,
)


def agents(session: Session, rows: Sequence[Agent | Row[*tuple[Any, ...]]]) -> list[schemas.AgentView]:
    """The rows (agents, or rows of `AGENT_VIEW_COLUMNS`) as views with their slots in use, in one
    query whatever their number. The leases are read by the rows' range of ids, not by a list of
    them: the pages are ranges, and a thousand ids cost PostgreSQL more to parse than the read."""
    used: dict[tuple[int, str], int] = {}
    if rows:
        ids = {a.id for a in rows}
        query = (
            select(SlotLease.agent_id, SlotLease.slot_type, func.count())
            .where(SlotLease.agent_id.between(min(ids), max(ids)))
            .group_by(SlotLease.agent_id, SlotLease.slot_type)
        )
        used = {
            (agent_id, slot_type): count for agent_id, slot_type, count in session.execute(query) if agent_id in ids
        }
    return [
        schemas.AgentView(
            id=a.id,
            name=a.name,
            address=a.address,
            state=schemas.AgentState(a.state),
            cpu_slots=a.cpu_slots,
            gpu_slots=a.gpu_slots,
            used_cpu_slots=used.get((a.id, "cpu"), 0),
            used_gpu_slots=used.get((a.id, "gpu"), 0),
            registered_at=a.registered_at,
            last_heartbeat=a.last_heartbeat,
        )
        for a in rows
    ]


def log_record(row: LogLine) -> schemas.LogRecord:
    return schemas.LogRecord(
        id=row.id,
        allocation_id=row.allocation_id,
        rank=row.rank,
        stream=row.stream,
        time=row.time,
        line=row.line,
    )


def checkpoint(row: Checkpoint) -> schemas.CheckpointView:
    return schemas.CheckpointView(
        id=row.id,
        job_id=row.job_id,
        attempt=row.attempt,
        step=row.step,
        metrics=row.metrics,
        size_bytes=row.size_bytes,
        path=row.path,
        state=row.state,
        created_at=row.created_at,
    )


# --- studies ---------------------------------------------------------------------------------


def _dominates(a: list[float], b: list[float], signs: list[float]) -> bool:
    """`a` is at least as good as `b` in every objective and better in one (signs: +1 minimise)."""
    pairs = [(x * s, y * s) for x, y, s in zip(a, b, signs, strict=True)]
    return all(x <= y for x, y in pairs) and any(x < y for x, y in pairs)


def _trial_views(spec: schemas.StudySpec, rows: list[tuple[TuningTrial, str]]) -> list[schemas.TrialView]:
    signs = [1.0 if o.direction is schemas.Direction.MINIMIZE else -1.0 for o in spec.objectives]
    single = len(signs) == 1
    complete = {t.id: t.values for t, _ in rows if t.state == schemas.TrialState.COMPLETE.value and t.values}
    if single:
        # the best value; among equal ones the lowest trial number (Optuna leaves ties to the database)
        ranked = sorted((values[0] * signs[0], t.number, t.id) for t, _ in rows if (values := complete.get(t.id)))
        best_ids = {ranked[0][2]} if ranked else set()
    else:  # the Pareto front
        best_ids = {
            i for i, v in complete.items() if not any(_dominates(o, v, signs) for j, o in complete.items() if j != i)
        }
    views, best = [], None
    for trial, job_state in rows:
        values = complete.get(trial.id)
        if single and values:
            best = values[0] if best is None or values[0] * signs[0] < best * signs[0] else best
        views.append(
            schemas.TrialView(
                number=trial.number,
                job_id=trial.job_id,
                job_state=schemas.JobState(job_state),
                state=schemas.TrialState(trial.state),
                params=trial.params,
                values=trial.values,
                last_step=trial.reported_step,
                reason=trial.reason,
                best=trial.id in best_ids,
                best_so_far=best if single else None,
                created_at=trial.created_at,
                ended_at=trial.ended_at,
            )
        )
    return views


def trials_by_study(session: Session, study_ids: Collection[int]) -> dict[int, list[tuple[TuningTrial, str]]]:
    """Each study's trials with their jobs' states, by number, in one query; studies without trials are absent."""
    rows = session.execute(
        select(TuningTrial, Job.state)
        .join(Job, Job.id == TuningTrial.job_id)
        .where(TuningTrial.study_id.in_(study_ids))
        .order_by(TuningTrial.study_id, TuningTrial.number)
    )
    result: dict[int, list[tuple[TuningTrial, str]]] = defaultdict(list)
    for trial, state in rows:
        result[trial.study_id].append((trial, state))
    return result


def study(session: Session, row: TuningStudy) -> schemas.Study:
    return studies(session, [row])[0]


def studies(session: Session, rows: Sequence[TuningStudy]) -> list[schemas.Study]:
    """The rows as summaries (no trials), in two queries at most whatever their number."""
    return [
        schemas.Study.model_validate(detail.model_dump(exclude={"trials", "version"}))
        for detail in study_details(session, rows)
    ]


def study_detail(session: Session, row: TuningStudy) -> schemas.StudyDetail:
    return study_details(session, [row])[0]


def study_details(session: Session, rows: Sequence[TuningStudy]) -> list[schemas.StudyDetail]:
    """The rows with their trials, in their order: one query for every study's trials, one for the
    owners the caller did not load."""
    trials_of = trials_by_study(session, [row.id for row in rows]) if rows else {}
    owners = owner_names(session, rows)
    return [_study_detail(row, trials_of.get(row.id, []), owners[row.owner_id]) for row in rows]


def _study_detail(row: TuningStudy, trial_rows: list[tuple[TuningTrial, str]], owner: str) -> schemas.StudyDetail:
    spec = schemas.StudySpec.model_validate(row.spec)
    trials = _trial_views(spec, trial_rows)
    best = [t for t in trials if t.best]
    fingerprint = [row.state, row.reason, *((t.number, t.state, t.job_state, t.values, t.last_step) for t in trials)]
    return schemas.StudyDetail(
        id=row.id,
        name=row.name,
        state=schemas.StudyState(row.state),
        reason=row.reason,
        owner=owner,
        team=spec.team,
        spec=spec,
        optuna_study_name=row.optuna_name,
        created_at=row.created_at,
        ended_at=row.ended_at,
        trial_counts=dict(Counter(t.state.value for t in trials)),
        best_values=best[0].values if len(best) == 1 else None,
        best_trial=best[0].number if len(best) == 1 else None,
        version=hashlib.sha1(json.dumps(fingerprint, default=str).encode()).hexdigest()[:16],
        trials=trials,
    )


def token(row: ApiToken) -> schemas.TokenView:
    kind: Literal["user", "agent"] = "agent" if row.kind == "agent" else "user"
    return schemas.TokenView(
        id=row.id,
        kind=kind,
        name=row.name,
        created_at=row.created_at,
        expires_at=row.expires_at,
        configured=row.configured,
    )


def team(session: Session, principal: Principal, row: Team) -> schemas.TeamView:
    return teams(session, principal, [row])[0]


def teams(session: Session, principal: Principal, rows: Sequence[Team]) -> list[schemas.TeamView]:
    """The teams with their members (loaded with the rows by `access.visible_teams`), their shares,
    what they hold now and how many of their jobs wait."""
    ids = [row.id for row in rows]
    holding: dict[int | None, dict[str, int]] = defaultdict(dict)
    queued: dict[int | None, int] = {}
    if ids:
        held_slots = (
            select(Job.team_id, SlotLease.slot_type, func.count())
            .select_from(SlotLease)
            .join(AllocationNode, SlotLease.node_id == AllocationNode.id)
            .join(Allocation, AllocationNode.allocation_id == Allocation.id)
            .join(Job, Allocation.job_id == Job.id)
            .where(Job.team_id.in_(ids))
            .group_by(Job.team_id, SlotLease.slot_type)
        )
        for team_id, slot_type, count in session.execute(held_slots):
            holding[team_id][slot_type] = count
        waiting = (
            select(Job.team_id, func.count())
            .where(Job.team_id.in_(ids), Job.state == schemas.JobState.QUEUED.value)
            .group_by(Job.team_id)
        )
        queued = {team_id: count for team_id, count in session.execute(waiting)}
    result = []
    for row in rows:
        members = [schemas.TeamMemberView(user=m.user.name, role=_role(m.role)) for m in row.members]
        mine = next((m.role for m in row.members if m.user_id == principal.user_id), None)
        result.append(
            schemas.TeamView(
                id=row.id,
                name=row.name,
                created_at=row.created_at,
                members=sorted(members, key=lambda m: m.user),
                your_role=_role(mine) if mine else None,
                weight=row.weight,
                guarantee=dict(row.guarantee or {}),
                limit=dict(row.slot_limit or {}),
                user_limit=dict(row.user_limit or {}),
                queue_held=row.queue_held,
                holding=holding.get(row.id, {}),
                queued=queued.get(row.id, 0),
            )
        )
    return result


def _role(role: str) -> schemas.TeamRole:
    return "admin" if role == "admin" else "member"
