"""The periodic passes (schedule, reap), published by a thread inside the scheduler process.

This does beat's job without beat: Celery's embedded beat is a forked child that survives a
kill -9 of its worker (an orphan publishing forever) and spends several milliseconds of CPU per
second on timezone arithmetic even when idle, CPU that training on the same machine would
otherwise get. A daemon thread dies with its process and costs one publish per due entry.

Contract: `start()` once per scheduler process; entries are published at their interval from
then on, with `expires` of two intervals so a stopped worker does not come back to a pile of stale
passes. Several scheduler processes publish several copies: the tasks are idempotent and
serialized by the database (the advisory lock in scheduler/service.py), as with several beats.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from celery import Celery

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Periodic:
    task: str
    interval_s: float


class PeriodicPublisher(threading.Thread):
    def __init__(self, app: Celery, entries: list[Periodic]) -> None:
        super().__init__(name="phalanx-periodic", daemon=True)
        self._app = app
        self._entries = entries

    def run(self) -> None:
        due = {entry.task: time.monotonic() for entry in self._entries}
        while True:
            now = time.monotonic()
            for entry in self._entries:
                if due[entry.task] <= now:
                    due[entry.task] = now + entry.interval_s
                    self._publish(entry)
            time.sleep(max(0.0, min(due.values()) - time.monotonic()))

    def _publish(self, entry: Periodic) -> None:
        try:
            self._app.send_task(entry.task, expires=entry.interval_s * 2)
        except Exception as exc:  # a broker outage must not end the passes: the next one retries
            log.warning("could not publish %s (%s); retrying in %.1f s", entry.task, exc, entry.interval_s)
