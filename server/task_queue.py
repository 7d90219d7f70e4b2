"""The scheduler's task queue as both sides see it: the Celery app configured for the broker (the
server only sends tasks with it; `scheduler/celery_app.py` adds the tasks and runs them) and the
enqueue function the server's sessions call after commit.

Broker: Redis in a deployment; kombu's filesystem transport in the embedded mode (it needs no
server, has fanout and lower latency than the SQLAlchemy transport; see DESIGN.md's pitfalls),
with atomic renames and an inotify wait (`server/broker_fs.py`).
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery

from server import broker_fs, inotify
from server.settings import Settings
from server.wakeups import Enqueue

log = logging.getLogger(__name__)
# A task not picked up by then is dropped: the periodic passes would have done its work already.
EXPIRES_S = 60.0


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


def enqueuer(celery: Celery) -> Enqueue:
    """Send tasks by name; a broker outage is logged and delays the work, never loses it (every
    task is also run by a periodic pass)."""

    def enqueue(task: str, *args: int, countdown: float = 0.0) -> None:
        try:
            celery.send_task(
                task, args=list(args), countdown=countdown or None, expires=countdown + EXPIRES_S, retry=False
            )
        except Exception as exc:
            log.warning("could not enqueue %s: %s", task, exc)

    return enqueue
