"""Effects noted in a transaction are carried out once after its commit, and never after a rollback."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from server.db import make_engine
from server.task_names import ADVANCE_STUDY_TASK, DELETE_CHECKPOINTS_TASK, SCHEDULE_TASK
from server.wakeups import (
    JOBS_CHANNEL,
    Publisher,
    note_agent_work,
    note_job_change,
    note_job_data,
    note_schedule,
    note_study_change,
    note_task,
    noted_agents,
    publish_after_commit,
)


class RecordingPublisher(Publisher):
    """The real class with no broker: records what it would publish."""

    def __init__(self) -> None:
        super().__init__(None)
        self.published: list[set[str]] = []

    def publish(self, channels: Iterable[str]) -> None:
        self.published.append(set(channels))


@pytest.fixture
def wired(tmp_path: Path) -> tuple[sessionmaker[Session], RecordingPublisher, list[tuple[Any, ...]]]:
    sessions = sessionmaker(make_engine(f"sqlite:///{tmp_path / 'w.db'}"))
    publisher, enqueued = RecordingPublisher(), []
    publish_after_commit(sessions, publisher, lambda task, *args, **_: enqueued.append((task, *args)))
    return sessions, publisher, enqueued


def note_everything(session: Session) -> None:
    note_job_change(session, 1)
    note_study_change(session, 7, trial_ended=True)
    note_agent_work(session, [2, 3])
    note_job_data(session, 4)
    note_schedule(session)
    note_schedule(session)  # noted twice, enqueued once
    note_task(session, DELETE_CHECKPOINTS_TASK, 4)


def test_noted_effects_follow_the_commit_once(wired: Any) -> None:
    sessions, publisher, enqueued = wired
    with sessions.begin() as session:
        note_everything(session)
        assert noted_agents(session) == {2, 3}
        assert not publisher.published and not enqueued  # nothing before the commit
    assert publisher.published == [{"job:1", JOBS_CHANNEL, "study:7", "agent:2", "agent:3", "job-data:4"}]
    assert sorted(enqueued) == sorted([(SCHEDULE_TASK,), (DELETE_CHECKPOINTS_TASK, 4), (ADVANCE_STUDY_TASK, 7)])
    with sessions.begin():
        pass  # the next transaction starts clean
    assert len(publisher.published) == 1 and len(enqueued) == 3


def test_a_rollback_drops_what_was_noted(wired: Any) -> None:
    sessions, publisher, enqueued = wired
    with pytest.raises(RuntimeError), sessions.begin() as session:
        note_everything(session)
        raise RuntimeError("refused")
    with sessions.begin():
        pass
    assert publisher.published == [] and enqueued == []


def test_a_released_savepoint_carries_out_nothing_before_the_commit(wired: Any) -> None:
    sessions, publisher, enqueued = wired
    with sessions.begin() as session:
        with session.begin_nested():
            note_everything(session)
        assert not publisher.published and not enqueued, "the woken would read rows not committed yet"
    assert publisher.published == [{"job:1", JOBS_CHANNEL, "study:7", "agent:2", "agent:3", "job-data:4"}]
    assert len(enqueued) == 3


def test_a_savepoint_rolled_back_keeps_what_the_transaction_noted(wired: Any) -> None:
    sessions, publisher, _ = wired
    with sessions.begin() as session:
        note_agent_work(session, [2])
        with pytest.raises(RuntimeError), session.begin_nested():
            note_agent_work(session, [3])
            raise RuntimeError("one report refused")
        note_job_data(session, 4)
    assert publisher.published == [{"agent:2", "agent:3", "job-data:4"}]


def test_a_rollback_from_inside_a_savepoint_drops_everything(wired: Any) -> None:
    sessions, publisher, enqueued = wired
    with pytest.raises(RuntimeError), sessions.begin() as session:
        note_agent_work(session, [2])
        with session.begin_nested():
            note_everything(session)
            raise RuntimeError("the whole call fails")
    with sessions.begin():
        pass
    assert publisher.published == [] and enqueued == []
