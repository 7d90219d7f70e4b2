"""The Celery app: JSON only, late acks, prefetch 1; periodic passes come from scheduler/periodic.py.

Broker: Redis in a deployment; kombu's filesystem transport in the embedded mode (it needs no
server, has fanout and lower latency than the SQLAlchemy transport; see DESIGN.md's pitfalls).
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from scheduler import broker_fs
from scheduler.periodic import Periodic
from server import inotify
from server.settings import Settings

SCHEDULE_TASK = "phalanx.schedule"
REAP_TASK = "phalanx.reap"
STUDIES_TASK = "phalanx.advance_studies"


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
        # The consumer waits on an inotify watch of the queue folder (scheduler/broker_fs.py); this
        # only bounds that wait, and is the poll period on systems without inotify.
        "polling_interval": 1.0 if inotify.available() else 0.05,
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
    )
    return app


def periodic_passes(settings: Settings) -> list[Periodic]:
    """What beat would run: placement and study passes as a safety net for lost kicks (and study
    timeouts), and the reaper."""
    return [
        Periodic(SCHEDULE_TASK, settings.schedule_interval),
        Periodic(REAP_TASK, settings.heartbeat_interval),
        Periodic(STUDIES_TASK, settings.schedule_interval),
    ]
