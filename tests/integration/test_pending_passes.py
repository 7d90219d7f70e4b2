"""Coalesced scheduling passes (`server.task_queue.PendingPasses`): one contract, run against both
implementations (a Redis key in a deployment, a file in the embedded mode), and the enqueuer that
uses it, with a real Celery app whose sends are recorded."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery

from server.task_names import REAP_TASK, SCHEDULE_TASK
from server.task_queue import EXPIRES_S, PendingPasses, enqueuer


@pytest.fixture(params=["redis", "file"])
def pending(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[PendingPasses]:
    if request.param == "redis":
        yield PendingPasses(request.getfixturevalue("clean_redis"), tmp_path / "unused")
    else:
        yield PendingPasses(None, tmp_path / "pending")


def test_a_pass_is_claimed_once_until_it_starts(pending: PendingPasses) -> None:
    assert pending.claim(SCHEDULE_TASK)
    assert not pending.claim(SCHEDULE_TASK), "a second request while one is queued must enqueue nothing"
    pending.clear(SCHEDULE_TASK)  # the pass starts: later requests need a pass of their own
    assert pending.claim(SCHEDULE_TASK)
    assert pending.claim("another.task"), "marks are per task"


def test_clearing_what_was_never_claimed_is_harmless(pending: PendingPasses) -> None:
    pending.clear(SCHEDULE_TASK)
    assert pending.claim(SCHEDULE_TASK)


def test_a_stale_file_mark_stops_blocking_after_the_task_expiry(tmp_path: Path) -> None:
    pending = PendingPasses(None, tmp_path / "pending")
    assert pending.claim(SCHEDULE_TASK)
    old = time.time() - EXPIRES_S - 1  # its task was dropped by the broker long ago
    os.utime(tmp_path / "pending" / SCHEDULE_TASK, (old, old))
    assert pending.claim(SCHEDULE_TASK)
    assert not pending.claim(SCHEDULE_TASK)


def test_the_enqueuer_sends_a_burst_of_schedule_requests_once(tmp_path: Path) -> None:
    sent: list[str] = []

    class Recording(Celery):
        def send_task(self, name: str, *args: object, **kwargs: object) -> None:  # type: ignore[override]
            sent.append(name)

    pending = PendingPasses(None, tmp_path / "pending")
    enqueue = enqueuer(Recording("test"), pending)
    for _ in range(100):
        enqueue(SCHEDULE_TASK)
    enqueue(REAP_TASK)
    enqueue(REAP_TASK)  # not coalesced
    assert sent == [SCHEDULE_TASK, REAP_TASK, REAP_TASK]
    pending.clear(SCHEDULE_TASK)  # the pass started
    enqueue(SCHEDULE_TASK)
    assert sent[-1] == SCHEDULE_TASK and len(sent) == 4
