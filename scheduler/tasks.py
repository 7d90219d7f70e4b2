"""Celery tasks. They take no ORM objects, run one pass each in their own transaction, are
idempotent (a pass re-reads everything), and wake agents only after the commit."""

from __future__ import annotations

from functools import lru_cache

from celery import shared_task
from sqlalchemy.orm import Session, sessionmaker

from scheduler import service
from server import checkpoints
from server.db import session_factory
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
    wake_job_watchers_after_commit(sessions, _publisher())
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
