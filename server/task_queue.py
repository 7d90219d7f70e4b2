"""The scheduler's task queue as both sides see it: the Celery app configured for the broker (the
server only sends tasks with it; `scheduler/celery_app.py` adds the tasks and runs them) and the
enqueue function the server's sessions call after commit.

Broker: Redis in a deployment; kombu's filesystem transport in the embedded mode (it needs no
server, has fanout and lower latency than the SQLAlchemy transport; see DESIGN.md's pitfalls),
with atomic renames and an inotify wait (`server/broker_fs.py`).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from server import broker_fs, inotify
from server.settings import Settings
from server.task_names import SCHEDULE_TASK
from server.wakeups import Enqueue

log = logging.getLogger(__name__)
# A task not picked up by then is dropped: the periodic passes would have done its work already.
EXPIRES_S = 60.0
# Passes that read everything afresh when they start: one queued and not yet started covers every
# later request for it, so a burst of requests (10,000 submits, 8,000 jobs ending) costs one or two
# passes instead of one each, and a request is never stuck behind thousands of stale passes.
COALESCED = frozenset({SCHEDULE_TASK})
PENDING_PREFIX = "phalanx:pending:"


class PendingPasses:
    """Which coalesced passes are queued and have not started, shared by every server and
    scheduler of a deployment: a Redis key each, or in the embedded mode a file under data_dir.

    `claim` is True when the caller must enqueue the pass (none is pending; it now is); the pass
    calls `clear` as it starts, before it reads, so a request that comes later than that read gets
    a pass of its own. A mark lives at most as long as its task may wait in the queue
    (`EXPIRES_S`), so a task the broker lost blocks nothing for longer. When Redis cannot be
    reached, `claim` says enqueue: coalescing saves work, it is never needed for correctness."""

    def __init__(self, redis_url: str | None, folder: Path) -> None:
        self._redis = redis.Redis.from_url(redis_url) if redis_url else None
        self._folder = folder

    @classmethod
    def for_settings(cls, settings: Settings) -> PendingPasses:
        return cls(settings.redis_url, settings.data_dir / "pending")

    def claim(self, task: str) -> bool:
        if self._redis is not None:
            try:
                return bool(self._redis.set(PENDING_PREFIX + task, b"1", nx=True, ex=int(EXPIRES_S)))
            except redis.RedisError:
                return True
        self._folder.mkdir(parents=True, exist_ok=True)
        path = self._folder / task
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            return True
        except FileExistsError:
            try:
                stale = time.time() - path.stat().st_mtime > EXPIRES_S
            except FileNotFoundError:  # cleared meanwhile: a pass started after this request
                stale = True
            if stale:
                path.touch()
            return stale

    def clear(self, task: str) -> None:
        if self._redis is not None:
            try:
                self._redis.delete(PENDING_PREFIX + task)
            except redis.RedisError as exc:
                log.warning("could not clear the pending mark of %s: %s", task, exc)
            return
        (self._folder / task).unlink(missing_ok=True)


def broker_options(settings: Settings) -> dict[str, Any]:
    if not settings.broker_url.startswith("filesystem://"):
        return {}
    # The control folder defaults to the current directory; keep every broker file under data_dir.
    folders = {name: settings.broker_dir / name for name in ("queue", "processed", "control")}
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=True)
    return {
        "data_folder_in": str(folders["queue"]),
        "data_folder_out": str(folders["queue"]),
        "processed_folder": str(folders["processed"]),
        "control_folder": str(folders["control"]),
        "store_processed": False,
        # The consumer waits on an inotify watch of the queue folder (server/broker_fs.py); this
        # only bounds that wait, and is the poll period on systems without inotify.
        "polling_interval": 1.0 if inotify.available() else 0.05,
    }


def make_celery(settings: Settings, include: tuple[str, ...] = ()) -> Celery:
    """JSON only, late acks, prefetch 1. `include`: the task modules a worker imports."""
    broker = settings.broker_url
    if broker.startswith("filesystem://"):
        # the same transport, but messages are renamed into place (see server/broker_fs.py)
        broker_fs.register()
        broker = broker.replace("filesystem://", f"{broker_fs.SCHEME}://", 1)
    app = Celery("phalanx", broker=broker, include=list(include))
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        task_ignore_result=True,
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        broker_transport_options=broker_options(settings),
        worker_hijack_root_logger=False,
    )
    return app


def enqueuer(celery: Celery, pending: PendingPasses | None = None) -> Enqueue:
    """Send tasks by name; a broker outage is logged and delays the work, never loses it (every
    task is also run by a periodic pass). With `pending`, a coalesced pass that is queued already
    is not sent again."""

    def enqueue(task: str, *args: int, countdown: float = 0.0) -> None:
        coalesced = pending is not None and task in COALESCED and not args and not countdown
        if coalesced and pending is not None and not pending.claim(task):
            return
        try:
            celery.send_task(
                task, args=list(args), countdown=countdown or None, expires=countdown + EXPIRES_S, retry=False
            )
        except Exception as exc:
            log.warning("could not enqueue %s: %s", task, exc)
            if coalesced and pending is not None:
                pending.clear(task)  # the next request tries again

    return enqueue
