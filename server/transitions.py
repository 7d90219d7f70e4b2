"""The only code that changes a job's state.

Each rule names the states it moves between; `transition` refuses everything else, records a
`JobEvent` with the reason, and keeps the job's timestamps in step. Callers own the transaction;
watchers of the job (`GET /jobs/{id}?state=…&wait=…`) are woken once it commits.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from phalanx.schemas import JobState
from server.errors import IllegalTransition
from server.models import Job, JobEvent, utcnow
from server.wakeups import note_job_change

S = JobState

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


def can_transition(current: JobState, target: JobState) -> bool:
    return target in ALLOWED[current]


def transition(session: Session, job: Job, target: JobState, reason: str) -> None:
    """Move `job` to `target`, or raise `IllegalTransition` leaving it untouched."""
    current = JobState(job.state)
    if not can_transition(current, target):
        raise IllegalTransition(job.id, current, target)
    now: datetime = session.execute(select(utcnow())).scalar_one()
    job.state = target.value
    if target is S.RUNNING and job.started_at is None:
        job.started_at = now
    if target.is_terminal:
        job.ended_at = now
        job.wait_reason = None
        if target is S.FAILED:
            job.failure_reason = reason
    if target is not S.QUEUED:
        job.wait_reason = None
    session.add(JobEvent(job_id=job.id, time=now, from_state=current.value, to_state=target.value, reason=reason))
    session.flush()
    note_job_change(session, job.id)
