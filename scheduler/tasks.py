"""Celery tasks. They take IDs only, run one pass each in their own transaction, are idempotent (a
pass re-reads everything), and what must follow a pass (waking agents, another scheduling pass, a
study's driver) is carried out after its commit by the sessions' `publish_after_commit`."""

from __future__ import annotations

import time
from functools import lru_cache

from celery import current_app, shared_task
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from phalanx.schemas import TERMINAL_JOB_STATES, StudyState, TrialState
from scheduler import service
from scheduler.pacing import PassPacing
from scheduler.study_driver import Driver
from server import checkpoints, retention, scaling
from server.db import session_factory
from server.models import Job, TuningStudy, TuningTrial
from server.settings import get_settings
from server.task_names import (
    ADVANCE_SCALING_TASK,
    ADVANCE_STUDIES_TASK,
    ADVANCE_STUDY_TASK,
    DELETE_CHECKPOINTS_TASK,
    REAP_TASK,
    RETENTION_TASK,
    SCHEDULE_TASK,
)
from server.task_queue import EXPIRES_S, PendingPasses, enqueuer
from server.wakeups import Publisher, publish_after_commit


@lru_cache(maxsize=1)
def _pending() -> PendingPasses:
    return PendingPasses.for_settings(get_settings())


@lru_cache(maxsize=1)
def _sessions() -> sessionmaker[Session]:
    """This process's sessions; each commit carries out the wake-ups and tasks it noted."""
    settings = get_settings()
    sessions = session_factory(settings.database_url)
    publish_after_commit(sessions, Publisher(settings.redis_url, settings.wake_dir), enqueuer(current_app, _pending()))
    return sessions


@lru_cache(maxsize=1)
def _pacing() -> PassPacing:
    """This worker process's passes."""
    return PassPacing(rest_ratio=get_settings().schedule_rest_ratio)


@shared_task(name=SCHEDULE_TASK)  # type: ignore[untyped-decorator]
def schedule() -> int:
    """One placement pass, or, within the rest after the last one (`scheduler.pacing`), the same
    task again once the rest is over: until then the pass stays pending, and the requests that
    come meanwhile join it. Requests that come once it starts need a pass of their own: it may
    read before their commits (`task_queue.PendingPasses`)."""
    rest = _pacing().delay(time.monotonic())
    if rest > 0:
        current_app.send_task(SCHEDULE_TASK, countdown=rest, expires=rest + EXPIRES_S)
        return 0
    _pending().clear(SCHEDULE_TASK)
    began = time.monotonic()
    try:
        with _sessions().begin() as session:
            woken = service.schedule_pass(session)
    finally:
        _pacing().ran(began, time.monotonic())
    return len(woken)


@shared_task(name=REAP_TASK)  # type: ignore[untyped-decorator]
def reap() -> int:
    """Periodic: lost agents and hung attempts (their jobs restart or fail at once: the freed slots
    note a scheduling pass), and retention whose enqueue was lost."""
    settings = get_settings()
    woken = service.reap_pass(_sessions().begin, settings.heartbeat_timeout)
    with _sessions().begin() as session:
        woken |= service.hang_pass(session)
    with _sessions().begin() as session:
        for job_id in checkpoints.jobs_with_deletions(session):
            checkpoints.delete_marked(session, job_id)
    return len(woken)


@shared_task(name=RETENTION_TASK)  # type: ignore[untyped-decorator]
def apply_retention() -> int:
    """Periodic: old metric points thinned and old log lines deleted (`server.retention`), for at
    most `retention_pass_seconds`. The slices done."""
    settings = get_settings()
    return retention.retention_pass(_sessions().begin, settings.retention, settings.retention_pass_seconds).slices


@shared_task(name=DELETE_CHECKPOINTS_TASK)  # type: ignore[untyped-decorator]
def delete_checkpoints(job_id: int) -> int:
    """Remove the files of checkpoints retention dropped, then their rows. Idempotent."""
    with _sessions().begin() as session:
        return checkpoints.delete_marked(session, job_id)


@shared_task(name=ADVANCE_STUDY_TASK)  # type: ignore[untyped-decorator]
def advance_study(study_id: int) -> int:
    """One pass of the study's driver (scheduler/study_driver.py); places the trials it launched
    at once rather than after a broker round trip. Idempotent; serialised per study by its lock."""
    launched = Driver(get_settings(), _sessions()).advance(study_id)
    if launched:
        schedule()
    return launched


@shared_task(name=ADVANCE_STUDIES_TASK)  # type: ignore[untyped-decorator]
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


@shared_task(name=ADVANCE_SCALING_TASK)  # type: ignore[untyped-decorator]
def advance_scaling() -> int:
    """Periodic: one step of every running scaling run, each in its own transaction under its row
    lock (a run another scheduler is advancing is skipped)."""
    with _sessions().begin() as session:
        run_ids = scaling.running_run_ids(session)
    for run_id in run_ids:
        with _sessions().begin() as session:
            run = scaling.lock_running(session, run_id)
            if run is not None:
                scaling.advance(session, run)
    return len(run_ids)
