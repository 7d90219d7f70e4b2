"""The embedded broker writes each message whole before it becomes visible."""

from __future__ import annotations

import json
from pathlib import Path

from scheduler.celery_app import make_celery
from server.settings import Settings
from server.task_names import SCHEDULE_TASK


def test_messages_appear_whole_and_nothing_else_is_left(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, database_url="sqlite://", broker_url="")
    app = make_celery(settings)
    assert app.conf.broker_url.startswith("phalanxfs://")
    for _ in range(20):
        app.send_task(SCHEDULE_TASK)
    queue = settings.broker_dir / "queue"
    messages = sorted(queue.iterdir())
    assert len(messages) == 20
    assert all(m.name.endswith(".celery.msg") for m in messages)  # no temporary files left behind
    assert all(json.loads(m.read_bytes())["headers"]["task"] == SCHEDULE_TASK for m in messages)
