"""The scheduler's Celery app: the queue's configuration (`server/task_queue.py`) plus the tasks of
`scheduler/tasks.py`; the periodic passes come from scheduler/periodic.py."""

from __future__ import annotations

from celery import Celery

from scheduler.periodic import Periodic
from server import task_queue
from server.settings import Settings
from server.task_names import ADVANCE_SCALING_TASK, ADVANCE_STUDIES_TASK, REAP_TASK, RETENTION_TASK, SCHEDULE_TASK


def make_celery(settings: Settings) -> Celery:
    return task_queue.make_celery(settings, include=("scheduler.tasks",))


def periodic_passes(settings: Settings) -> list[Periodic]:
    """What beat would run: placement and study passes as a safety net for lost kicks (and study
    timeouts), the reaper, and retention."""
    return [
        Periodic(SCHEDULE_TASK, settings.schedule_interval),
        Periodic(REAP_TASK, settings.heartbeat_interval),
        Periodic(ADVANCE_STUDIES_TASK, settings.schedule_interval),
        Periodic(ADVANCE_SCALING_TASK, settings.schedule_interval),
        Periodic(RETENTION_TASK, settings.retention_interval),
    ]
