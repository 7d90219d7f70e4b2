"""Scheduling passes paced by their own cost (`scheduler.pacing`): the policy, and the Celery task
that acts on it against the real database and pending marks, with a Celery app whose sends are
recorded."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, current_app

from scheduler import tasks
from scheduler.pacing import PassPacing
from server.settings import Settings, get_settings
from server.task_names import SCHEDULE_TASK
from server.task_queue import PendingPasses


def test_a_pass_is_followed_by_a_rest_as_long_as_it_took_and_a_lone_request_waits_for_nothing() -> None:
    pacing = PassPacing(rest_ratio=1.0, max_rest_s=2.0)
    assert pacing.delay(100.0) == 0.0
    pacing.ran(began=100.0, ended=100.5)
    assert pacing.delay(100.5) == pytest.approx(0.5)
    assert pacing.delay(100.8) == pytest.approx(0.2)
    assert pacing.delay(101.0) == 0.0
    pacing.ran(began=110.0, ended=115.0)  # a long pass rests at most max_rest_s
    assert pacing.delay(115.0) == pytest.approx(2.0)
    assert PassPacing(rest_ratio=0.5).delay(0.0) == 0.0


class Recording(Celery):
    def __init__(self) -> None:
        super().__init__("recording")
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def send_task(self, name: str, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        self.sent.append((name, kwargs))


@pytest.fixture
def recording(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Iterator[Recording]:
    """The tasks module reading this test's database and Redis, sending through `Recording`."""
    monkeypatch.setenv("PHALANX_DATABASE_URL", settings.database_url)
    monkeypatch.setenv("PHALANX_BROKER_URL", settings.broker_url)
    monkeypatch.setenv("PHALANX_DATA_DIR", str(settings.data_dir))
    caches = (get_settings, tasks._sessions, tasks._pending)
    for cache in caches:
        cache.cache_clear()
    previous = current_app._get_current_object()
    app = Recording()
    app.set_current()
    try:
        yield app
    finally:
        previous.set_current()
        for cache in caches:
            cache.cache_clear()


def test_a_pass_asked_for_during_the_rest_stays_pending_and_is_sent_for_the_rests_end(
    settings: Settings, recording: Recording, monkeypatch: pytest.MonkeyPatch
) -> None:
    pacing = PassPacing()
    monkeypatch.setattr(tasks, "_pacing", lambda: pacing)
    pending = PendingPasses.for_settings(settings)
    assert pending.claim(SCHEDULE_TASK)
    tasks.schedule()  # no pass before it: it runs at once, and clears the mark as it starts
    assert recording.sent == [] and pacing.not_before > 0
    assert pending.claim(SCHEDULE_TASK), "the pass started: a request after it needs a pass of its own"

    pacing.not_before = tasks.time.monotonic() + 1.5  # as after a pass of 1.5 s
    tasks.schedule()
    ((name, options),) = recording.sent
    assert name == SCHEDULE_TASK and 1.0 < options["countdown"] <= 1.5
    assert not pending.claim(SCHEDULE_TASK), "still pending: requests until the rest ends join that pass"
