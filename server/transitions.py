"""The only code that changes a job's or a study's state.

Each rule names the states it moves between; `transition` refuses everything else, records a
`JobEvent` with the reason, and keeps the job's timestamps in step. Callers own the transaction;
watchers of the job (`GET /jobs/{id}?state=…&wait=…`) are woken once it commits, and so are the
watchers of its study when it is a trial; a trial job that ended also gets its study's driver
enqueued after the commit (`wakeups.wake_job_watchers_after_commit`). `transition_study` does the
same for studies.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from phalanx.schemas import JobState, StudyState
from server.errors import IllegalStudyTransition, IllegalTransition
from server.models import Job, JobEvent, TuningStudy, TuningTrial, utcnow
from server.wakeups import note_job_change, note_study_change

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
    study_id = session.execute(select(TuningTrial.study_id).where(TuningTrial.job_id == job.id)).scalar_one_or_none()
    if study_id is not None:
        note_study_change(session, study_id, trial_ended=target.is_terminal)


STUDY_ALLOWED: dict[StudyState, frozenset[StudyState]] = {
    StudyState.RUNNING: frozenset({StudyState.STOPPED, StudyState.COMPLETED, StudyState.FAILED}),
    StudyState.STOPPED: frozenset({StudyState.RUNNING}),
    StudyState.COMPLETED: frozenset(),
    StudyState.FAILED: frozenset(),
}


def transition_study(session: Session, study: TuningStudy, target: StudyState, reason: str) -> None:
    """Move `study` to `target`, or raise `IllegalStudyTransition` leaving it untouched. Keeps
    its running time (what `timeout` counts) without the time it spent STOPPED."""
    current = StudyState(study.state)
    if target not in STUDY_ALLOWED[current]:
        raise IllegalStudyTransition(study.id, current, target)
    now: datetime = session.execute(select(utcnow())).scalar_one()
    if current is StudyState.RUNNING and study.running_since is not None:
        study.running_seconds += (now - study.running_since).total_seconds()
        study.running_since = None
    if target is StudyState.RUNNING:
        study.running_since = now
    if target.is_terminal:
        study.ended_at = now
    study.state = target.value
    study.reason = reason
    session.flush()
    note_study_change(session, study.id)
