"""Celery tasks. They take no ORM objects, run one pass each in their own transaction, are
idempotent (a pass re-reads everything), and wake agents only after the commit."""

from __future__ import annotations

from functools import lru_cache

from celery import shared_task
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from phalanx.schemas import TERMINAL_JOB_STATES, StudyState, TrialState
from scheduler import service
from scheduler.study_driver import Driver
from server import checkpoints
from server.db import session_factory
from server.models import Job, TuningStudy, TuningTrial
from server.settings import get_settings
from server.wakeups import Publisher, agent_channel, wake_job_watchers_after_commit


@lru_cache(maxsize=1)
def _publisher() -> Publisher:
    settings = get_settings()
    return Publisher(settings.redis_url, settings.wake_dir)


@lru_cache(maxsize=1)
def _sessions() -> sessionmaker[Session]:
    """This process's sessions; each commit wakes the watchers of the jobs whose state it changed."""
    sessions = session_factory(get_settings().database_url)
    wake_job_watchers_after_commit(sessions, _publisher(), drive_study=lambda study_id: advance_study.delay(study_id))
    return sessions


def _wake(agent_ids: set[int]) -> None:
    _publisher().publish(agent_channel(a) for a in agent_ids)


@shared_task(name="phalanx.schedule")  # type: ignore[untyped-decorator]
def schedule() -> int:
    with _sessions().begin() as session:
        woken = service.schedule_pass(session)
    _wake(woken)
    return len(woken)


@shared_task(name="phalanx.reap")  # type: ignore[untyped-decorator]
def reap() -> int:
    """Periodic: lost agents and hung attempts. Their jobs restart (or fail) at once."""
    settings = get_settings()
    with _sessions().begin() as session:
        woken = service.reap_pass(session, settings.heartbeat_timeout)
    with _sessions().begin() as session:
        woken |= service.hang_pass(session)
    with _sessions().begin() as session:  # retention whose enqueue was lost
        for job_id in checkpoints.jobs_with_deletions(session):
            checkpoints.delete_marked(session, job_id)
    _wake(woken)
    if woken:
        schedule.delay()
    return len(woken)


@shared_task(name="phalanx.delete_checkpoints")  # type: ignore[untyped-decorator]
def delete_checkpoints(job_id: int) -> int:
    """Remove the files of checkpoints retention dropped, then their rows. Idempotent."""
    with _sessions().begin() as session:
        return checkpoints.delete_marked(session, job_id)


@shared_task(name="phalanx.advance_study")  # type: ignore[untyped-decorator]
def advance_study(study_id: int) -> int:
    """One pass of the study's driver (scheduler/study_driver.py); places the trials it launched
    at once rather than after a broker round trip. Idempotent; serialised per study by its lock."""
    outcome = Driver(get_settings(), _sessions()).advance(study_id)
    _wake(outcome.woken)
    if outcome.launched:
        schedule()
    return outcome.launched


@shared_task(name="phalanx.advance_studies")  # type: ignore[untyped-decorator]
def advance_studies() -> int:
    """Periodic: a pass for every running study (timeouts; driver enqueues that were lost) and for
    every study with a trial whose end its driver has not told Optuna yet."""
    with _sessions().begin() as session:
        running = select(TuningStudy.id).where(TuningStudy.state == StudyState.RUNNING.value)
        untold = (
            select(TuningTrial.study_id)
            .join(Job, Job.id == TuningTrial.job_id)
            .where(
                TuningTrial.state == TrialState.RUNNING.value,
                Job.state.in_([s.value for s in TERMINAL_JOB_STATES]),
            )
        )
        study_ids = sorted(set(session.scalars(running)) | set(session.scalars(untold)))
    for study_id in study_ids:
        advance_study.delay(study_id)
    return len(study_ids)
