"""The Celery app: JSON only, late acks, prefetch 1; beat drives periodic passes.

Broker: Redis in a deployment; kombu's filesystem transport in the embedded mode (it needs no
server, has fanout and lower latency than the SQLAlchemy transport; see DESIGN.md's pitfalls).
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from scheduler import broker_fs
from server.settings import Settings

SCHEDULE_TASK = "phalanx.schedule"
REAP_TASK = "phalanx.reap"


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
        # The transport sleeps this long between empty polls: it bounds how soon a submit is placed.
        "polling_interval": 0.05,
    }


def make_celery(settings: Settings) -> Celery:
    broker = settings.broker_url
    if broker.startswith("filesystem://"):
        # the same transport, but messages are renamed into place (see scheduler/broker_fs.py)
        broker_fs.register()
        broker = broker.replace("filesystem://", f"{broker_fs.SCHEME}://", 1)
    app = Celery("phalanx", broker=broker, include=["scheduler.tasks"])
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
        # Periodic passes pile up while no worker runs (e.g. during a restart); they are cheap and
        # idempotent, so an expiry keeps the queue from replaying hundreds of stale ones.
        beat_schedule={
            "schedule": {
                "task": SCHEDULE_TASK,
                "schedule": settings.schedule_interval,
                "options": {"expires": settings.schedule_interval * 2},
            },
            "reap": {
                "task": REAP_TASK,
                "schedule": settings.heartbeat_interval,
                "options": {"expires": settings.heartbeat_interval * 2},
            },
        },
    )
    return app
