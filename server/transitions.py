"""The only code that writes a state column: jobs, studies, agents, allocation nodes, trials,
scaling runs and checkpoints.

Each kind has a rule table of the moves it allows; everything else raises `IllegalTransition`
(409). Every write is a compare-and-set, `UPDATE … SET state = :to WHERE id = :id AND state = :from`:
a writer that read the row before another transaction moved it finds no row to update and gets
`IllegalTransition` naming the state it found, so a race never overwrites a committed change (a
scheduling pass that read a QUEUED job cannot undo a kill that committed meanwhile). Callers that
must not fail on such a race lock the row first (`FOR UPDATE`, or `SKIP LOCKED` in the scheduling
pass) and re-read it.

Callers own the transaction. A job's change records a `JobEvent` with the reason, keeps its
timestamps and `wait_reason` in step, and notes the job (and its study, for a trial) in the
session so that `wakeups.publish_after_commit` wakes their watchers once the commit succeeds.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol, cast

from sqlalchemy import func, insert, select, update
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from phalanx.schemas import AgentState, JobState, NodeState, ScalingState, StudyState, TrialState
from server.errors import IllegalTransition
from server.models import (
    Agent,
    AllocationNode,
    Checkpoint,
    Job,
    JobEvent,
    ScalingRun,
    TuningStudy,
    TuningTrial,
    utcnow,
)
from server.wakeups import note_job_change, note_scaling_change, note_study_change

S = JobState
# What a QUEUED job's `wait_reason` says until the next scheduling pass gives the real one.
WAITING_FOR_PASS = "waiting for the scheduler's next pass"

ALLOWED: dict[JobState, frozenset[JobState]] = {
    S.QUEUED: frozenset({S.SCHEDULED, S.PAUSED, S.CANCELLED, S.FAILED}),
    S.SCHEDULED: frozenset({S.RUNNING, S.RESTARTING, S.PAUSED, S.COMPLETED, S.FAILED, S.CANCELLED}),
    S.RUNNING: frozenset({S.COMPLETED, S.FAILED, S.CANCELLED, S.PRUNED, S.RESTARTING, S.PAUSED}),
    S.RESTARTING: frozenset({S.QUEUED, S.PAUSED, S.FAILED, S.CANCELLED}),
    # Paused: its workers were asked to checkpoint and leave; `resume` queues it again.
    S.PAUSED: frozenset({S.QUEUED, S.CANCELLED}),
    S.COMPLETED: frozenset(),
    S.FAILED: frozenset(),
    S.CANCELLED: frozenset(),
    S.PRUNED: frozenset(),
}

STUDY_ALLOWED: dict[StudyState, frozenset[StudyState]] = {
    StudyState.RUNNING: frozenset({StudyState.STOPPED, StudyState.COMPLETED, StudyState.FAILED}),
    StudyState.STOPPED: frozenset({StudyState.RUNNING}),
    StudyState.COMPLETED: frozenset(),
    StudyState.FAILED: frozenset(),
}

# An agent that re-registers keeps DRAINING (a restart does not undo a drain); only a LOST one
# becomes ACTIVE again. Drain is an operator's intent, so a LOST agent cannot be drained.
AGENT_ALLOWED: dict[AgentState, frozenset[AgentState]] = {
    AgentState.ACTIVE: frozenset({AgentState.DRAINING, AgentState.LOST}),
    AgentState.DRAINING: frozenset({AgentState.ACTIVE, AgentState.LOST}),  # ACTIVE: undrained
    AgentState.LOST: frozenset({AgentState.ACTIVE}),
}

NODE_ALLOWED: dict[NodeState, frozenset[NodeState]] = {
    NodeState.ASSIGNED: frozenset({NodeState.RUNNING, NodeState.EXITED}),
    NodeState.RUNNING: frozenset({NodeState.EXITED}),
    NodeState.EXITED: frozenset(),
}

TRIAL_ALLOWED: dict[TrialState, frozenset[TrialState]] = {
    TrialState.RUNNING: frozenset({TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL}),
    TrialState.COMPLETE: frozenset(),
    TrialState.PRUNED: frozenset(),
    TrialState.FAIL: frozenset(),
}

SCALING_ALLOWED: dict[ScalingState, frozenset[ScalingState]] = {
    ScalingState.RUNNING: frozenset({ScalingState.COMPLETED, ScalingState.FAILED, ScalingState.CANCELLED}),
    ScalingState.COMPLETED: frozenset(),
    ScalingState.FAILED: frozenset(),
    ScalingState.CANCELLED: frozenset(),
}

COMMITTED, DELETING = "COMMITTED", "DELETING"
# A committed checkpoint that retention dropped is DELETING until its files and row are removed.
CHECKPOINT_ALLOWED: dict[str, frozenset[str]] = {COMMITTED: frozenset({DELETING}), DELETING: frozenset()}


class _Stateful(Protocol):
    id: Any
    state: Any


def db_now(session: Session) -> datetime:
    """The database clock: every timestamp and heartbeat comparison uses it, never a host's.

    One instant per transaction, read at its first use: everything a transaction stamps happens at
    once, as for PostgreSQL's own now(), and a node's exit (its node, its lease, its allocation and
    its job stamped) costs one round trip for the clock instead of four."""
    transaction = session.get_transaction()
    known = session.info.get(_DB_NOW)
    if transaction is not None and known is not None and known[0] is transaction:
        return cast(datetime, known[1])
    now: datetime = session.execute(select(utcnow())).scalar_one()
    # (the transaction itself is kept, not its id: a new one could reuse a freed one's id)
    session.info[_DB_NOW] = (session.get_transaction(), now)
    return now


_DB_NOW = "phalanx.db_now"


def _compare_and_set(session: Session, row: _Stateful, expected: str, values: dict[str, Any]) -> bool:
    """Write `values` to `row` only while its state is still `expected`; False when it moved.

    The ORM object is updated as if loaded (no second UPDATE at flush); on a lost race its state
    is re-read, so the caller's error names the state that won."""
    model: Any = type(row)
    result: Any = session.execute(
        update(model)
        .where(model.id == row.id, model.state == expected)
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:
        session.refresh(row, ["state"])
        return False
    for key, value in values.items():
        set_committed_value(row, key, value)
    return True


def _move(
    session: Session, kind: str, row: _Stateful, table: dict[Any, frozenset[Any]], target: Any, **values: Any
) -> None:
    """The one compare-and-set move: the rule table, then the conditional write."""
    current = type(target)(row.state)
    if target not in table[current]:
        raise IllegalTransition(kind, row.id, str(current), str(target))
    if not _compare_and_set(session, row, str(current), {"state": str(target), **values}):
        raise IllegalTransition(kind, row.id, str(row.state), str(target), raced_from=str(current))


def can_transition(current: JobState, target: JobState) -> bool:
    return target in ALLOWED[current]


def transition(session: Session, job: Job, target: JobState, reason: str) -> None:
    """Move `job` to `target`, or raise `IllegalTransition` leaving it untouched."""
    current = JobState(job.state)
    if not can_transition(current, target):
        raise IllegalTransition("job", job.id, current.value, target.value)
    now = db_now(session)
    values: dict[str, Any] = {"wait_reason": WAITING_FOR_PASS if target is S.QUEUED else None}
    if target is S.RUNNING and job.started_at is None:
        values["started_at"] = now
    if target.is_terminal:
        values["ended_at"] = now
    if target is S.FAILED:
        values["failure_reason"] = reason
    _move(session, "job", job, ALLOWED, target, **values)
    session.add(JobEvent(job_id=job.id, time=now, from_state=current.value, to_state=target.value, reason=reason))
    session.flush()
    note_job_change(session, job.id)
    study_id = session.execute(select(TuningTrial.study_id).where(TuningTrial.job_id == job.id)).scalar_one_or_none()
    if study_id is not None:
        note_study_change(session, study_id, trial_ended=target.is_terminal)


def start_running(session: Session, job_ids: Collection[int], reason: str) -> set[int]:
    """SCHEDULED → RUNNING for jobs whose rows the caller locked, without loading them, in one
    UPDATE and one insert of events: the last node of every attempt reports its start here,
    thousands at once when a cluster fills. The jobs that moved; one no longer SCHEDULED is left
    as it is."""
    if not can_transition(S.SCHEDULED, S.RUNNING):
        raise IllegalTransition("job", min(job_ids, default=0), S.SCHEDULED.value, S.RUNNING.value)
    if not job_ids:
        return set()
    moved = dict(
        session.execute(
            update(Job)
            .where(Job.id.in_(sorted(job_ids)), Job.state == S.SCHEDULED.value)
            .values(state=S.RUNNING.value, wait_reason=None, started_at=func.coalesce(Job.started_at, utcnow()))
            .returning(Job.id, utcnow())
            .execution_options(synchronize_session=False)
        ).all()
    )
    if not moved:
        return set()
    session.execute(
        insert(JobEvent),
        [
            {
                "job_id": job_id,
                "time": at,
                "from_state": S.SCHEDULED.value,
                "to_state": S.RUNNING.value,
                "reason": reason,
            }
            for job_id, at in moved.items()
        ],
    )
    for job_id in moved:
        note_job_change(session, job_id)
    studies = select(TuningTrial.study_id).where(TuningTrial.job_id.in_(list(moved))).distinct()
    for study_id in session.scalars(studies):
        note_study_change(session, study_id)
    return set(moved)


def start_nodes(session: Session, node_ids: Collection[int]) -> set[int]:
    """ASSIGNED → RUNNING for nodes, by id, in one UPDATE (the caller holds their jobs' row
    locks); the nodes that moved: one no longer ASSIGNED (a report sent again, or the node
    exited) is left as it is."""
    if NodeState.RUNNING not in NODE_ALLOWED[NodeState.ASSIGNED]:
        raise IllegalTransition("node", min(node_ids, default=0), NodeState.ASSIGNED.value, NodeState.RUNNING.value)
    if not node_ids:
        return set()
    moved = session.scalars(
        update(AllocationNode)
        .where(AllocationNode.id.in_(sorted(node_ids)), AllocationNode.state == NodeState.ASSIGNED.value)
        .values(state=NodeState.RUNNING.value, started_at=utcnow())
        .returning(AllocationNode.id)
        .execution_options(synchronize_session=False)
    )
    return set(moved)


def exit_nodes(session: Session, reasons: Mapping[int, str], now: datetime) -> set[int]:
    """ASSIGNED or RUNNING → EXITED with code 0 for nodes, by id, each with its reason, in one
    UPDATE per distinct reason (the caller holds their jobs' row locks); the nodes that moved: one
    already EXITED (a report sent again) is left as it is."""
    if not reasons:
        return set()
    movable = [state.value for state, targets in NODE_ALLOWED.items() if NodeState.EXITED in targets]
    moved: set[int] = set()
    by_reason: dict[str, list[int]] = {}
    for node_id, reason in reasons.items():
        by_reason.setdefault(reason, []).append(node_id)
    for reason, node_ids in sorted(by_reason.items()):
        moved |= set(
            session.scalars(
                update(AllocationNode)
                .where(AllocationNode.id.in_(sorted(node_ids)), AllocationNode.state.in_(movable))
                .values(state=NodeState.EXITED.value, exit_code=0, reason=reason, ended_at=now)
                .returning(AllocationNode.id)
                .execution_options(synchronize_session=False)
            )
        )
    return moved


def complete_jobs(session: Session, from_states: Mapping[int, str], reason: str, now: datetime) -> set[int]:
    """Jobs whose rows the caller locked, each in the state it read under that lock, → COMPLETED,
    without loading them: one UPDATE per state they leave and one insert of events (an agent
    reports the ends of the nodes it ran together). The jobs that moved; one that left its state
    meanwhile is left as it is."""
    moved: dict[int, str] = {}
    for current in sorted(set(from_states.values())):
        if not can_transition(S(current), S.COMPLETED):
            raise IllegalTransition("job", min(from_states), current, S.COMPLETED.value)
        ids = sorted(job_id for job_id, state in from_states.items() if state == current)
        for job_id in session.scalars(
            update(Job)
            .where(Job.id.in_(ids), Job.state == current)
            .values(state=S.COMPLETED.value, wait_reason=None, ended_at=now)
            .returning(Job.id)
            .execution_options(synchronize_session=False)
        ):
            moved[job_id] = current
    if not moved:
        return set()
    session.execute(
        insert(JobEvent),
        [
            {"job_id": job_id, "time": now, "from_state": state, "to_state": S.COMPLETED.value, "reason": reason}
            for job_id, state in sorted(moved.items())
        ],
    )
    for job_id in moved:
        note_job_change(session, job_id)
    studies = select(TuningTrial.study_id).where(TuningTrial.job_id.in_(sorted(moved))).distinct()
    for study_id in session.scalars(studies):
        note_study_change(session, study_id, trial_ended=True)
    return set(moved)


def record_event(session: Session, job: Job, reason: str) -> None:
    """An event that moves nothing (a preemption made for the job), in the job's history."""
    state = JobState(job.state).value
    session.add(JobEvent(job_id=job.id, time=db_now(session), from_state=state, to_state=state, reason=reason))
    note_job_change(session, job.id)


def schedule_jobs(session: Session, placed: Sequence[tuple[Job, str]]) -> None:
    """QUEUED → SCHEDULED for every placed job (locked by the caller), each attempt counted, in one
    UPDATE and one insert of events for a whole scheduling pass: a pass that places thousands of
    jobs must not pay round trips per job. Raises `IllegalTransition` if any job moved meanwhile
    (the caller's transaction then writes nothing)."""
    if not placed:
        return
    for job, _ in placed:
        if job.state != S.QUEUED.value:
            raise IllegalTransition("job", job.id, job.state, S.SCHEDULED.value)
    ids = [job.id for job, _ in placed]
    now = db_now(session)
    moved = dict(
        session.execute(
            update(Job)
            .where(Job.id.in_(ids), Job.state == S.QUEUED.value)
            .values(state=S.SCHEDULED.value, wait_reason=None, attempts=Job.attempts + 1)
            .returning(Job.id, Job.attempts)
            .execution_options(synchronize_session=False)
        ).all()
    )
    for job, _ in placed:
        if job.id not in moved:
            session.refresh(job, ["state"])
            raise IllegalTransition("job", job.id, str(job.state), S.SCHEDULED.value, raced_from=S.QUEUED.value)
        set_committed_value(job, "state", S.SCHEDULED.value)
        set_committed_value(job, "wait_reason", None)
        set_committed_value(job, "attempts", moved[job.id])
    session.execute(
        insert(JobEvent),
        [
            {
                "job_id": job.id,
                "time": now,
                "from_state": S.QUEUED.value,
                "to_state": S.SCHEDULED.value,
                "reason": reason,
            }
            for job, reason in placed
        ],
    )
    for job_id in ids:
        note_job_change(session, job_id)
    for study_id in set(session.scalars(select(TuningTrial.study_id).where(TuningTrial.job_id.in_(ids)))):
        note_study_change(session, study_id)


def set_wait_reasons(session: Session, reasons: Mapping[int, str]) -> None:
    """Why each QUEUED job waits (the scheduling pass's sentences), one UPDATE per distinct reason;
    a job that left QUEUED meanwhile keeps what it has."""
    by_reason: dict[str, list[int]] = {}
    for job_id, reason in reasons.items():
        by_reason.setdefault(reason, []).append(job_id)
    for reason, ids in by_reason.items():
        session.execute(
            update(Job)
            .where(Job.id.in_(ids), Job.state == S.QUEUED.value)
            .values(wait_reason=reason)
            .execution_options(synchronize_session=False)
        )


def transition_study(session: Session, study: TuningStudy, target: StudyState, reason: str) -> None:
    """Move `study` to `target`, or raise `IllegalTransition` leaving it untouched. Keeps its
    running time (what `timeout` counts) without the time it spent STOPPED."""
    current = StudyState(study.state)
    now = db_now(session)
    values: dict[str, Any] = {"reason": reason, "running_since": now if target is StudyState.RUNNING else None}
    if current is StudyState.RUNNING and study.running_since is not None:
        values["running_seconds"] = study.running_seconds + (now - study.running_since).total_seconds()
    if target.is_terminal:
        values["ended_at"] = now
    _move(session, "study", study, STUDY_ALLOWED, target, **values)
    session.flush()
    note_study_change(session, study.id)


def transition_agent(session: Session, agent: Agent, target: AgentState) -> None:
    _move(session, "agent", agent, AGENT_ALLOWED, target)


def transition_node(session: Session, node: AllocationNode, target: NodeState, **values: Any) -> None:
    """`values`: what the move records with it (start time; exit code, reason and end time)."""
    _move(session, "node", node, NODE_ALLOWED, target, **values)


def transition_trial(session: Session, trial: TuningTrial, target: TrialState, **values: Any) -> None:
    _move(session, "trial", trial, TRIAL_ALLOWED, target, **values)
    note_study_change(session, trial.study_id)


def transition_scaling(session: Session, run: ScalingRun, target: ScalingState, reason: str) -> None:
    _move(session, "scaling run", run, SCALING_ALLOWED, target, reason=reason, ended_at=db_now(session))
    note_scaling_change(session, run.id)


def transition_checkpoint(session: Session, checkpoint: Checkpoint, target: str) -> None:
    _move(session, "checkpoint", checkpoint, CHECKPOINT_ALLOWED, target)
