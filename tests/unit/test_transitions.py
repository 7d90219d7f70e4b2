"""The job state machine: every (from, to) pair is either allowed by a rule or refused."""

from __future__ import annotations

import itertools

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from phalanx.schemas import JobState, StudyState
from server.db import make_engine, upgrade
from server.errors import IllegalTransition
from server.models import Job, JobEvent, TuningStudy, User
from server.transitions import ALLOWED, STUDY_ALLOWED, can_transition, transition, transition_study

S = JobState
EXPECTED_ALLOWED = {
    (S.QUEUED, S.SCHEDULED),
    (S.QUEUED, S.CANCELLED),
    (S.QUEUED, S.FAILED),
    (S.SCHEDULED, S.RUNNING),
    (S.SCHEDULED, S.RESTARTING),
    (S.SCHEDULED, S.COMPLETED),
    (S.SCHEDULED, S.FAILED),
    (S.SCHEDULED, S.CANCELLED),
    (S.RUNNING, S.COMPLETED),
    (S.RUNNING, S.FAILED),
    (S.RUNNING, S.CANCELLED),
    (S.RUNNING, S.PRUNED),
    (S.RUNNING, S.RESTARTING),
    (S.RESTARTING, S.QUEUED),
    (S.RESTARTING, S.FAILED),
    (S.RESTARTING, S.CANCELLED),
    (S.QUEUED, S.PAUSED),
    (S.SCHEDULED, S.PAUSED),
    (S.RUNNING, S.PAUSED),
    (S.RESTARTING, S.PAUSED),
    (S.PAUSED, S.QUEUED),
    (S.PAUSED, S.CANCELLED),
}
PAIRS = list(itertools.product(JobState, JobState))


@pytest.fixture(scope="module")
def session_maker(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    url = f"sqlite:///{tmp_path_factory.mktemp('db') / 'transitions.db'}"
    upgrade(url)
    engine = make_engine(url)
    yield lambda: Session(engine)
    engine.dispose()


def test_rule_table_is_the_documented_lifecycle() -> None:
    table = {(a, b) for a, targets in ALLOWED.items() for b in targets}
    assert table == EXPECTED_ALLOWED
    assert set(ALLOWED) == set(JobState)


@pytest.mark.parametrize(("current", "target"), PAIRS, ids=[f"{a.value}->{b.value}" for a, b in PAIRS])
def test_every_pair(session_maker, current: JobState, target: JobState) -> None:  # type: ignore[no-untyped-def]
    with session_maker() as session, session.begin():
        user = User(name=f"u-{current.value}-{target.value}", is_admin=False)
        session.add(user)
        session.flush()
        job = Job(
            name="j",
            owner_id=user.id,
            state=current.value,
            spec={},
            priority=50,
            nodes=1,
            slots_per_node=1,
            slot_type="cpu",
            attempts=0,
        )
        session.add(job)
        session.flush()
        if (current, target) in EXPECTED_ALLOWED:
            assert can_transition(current, target)
            transition(session, job, target, "because a test said so")
            assert job.state == target.value
            event = session.scalars(select(JobEvent).where(JobEvent.job_id == job.id)).one()
            assert (event.from_state, event.to_state, event.reason) == (
                current.value,
                target.value,
                "because a test said so",
            )
            assert (job.ended_at is not None) == target.is_terminal
        else:
            assert not can_transition(current, target)
            with pytest.raises(IllegalTransition, match=f"is {current.value} and cannot become {target.value}"):
                transition(session, job, target, "nope")
            assert job.state == current.value
            assert session.scalars(select(JobEvent).where(JobEvent.job_id == job.id)).first() is None
        session.rollback()


STUDY_EXPECTED_ALLOWED = {
    (StudyState.RUNNING, StudyState.STOPPED),
    (StudyState.RUNNING, StudyState.COMPLETED),
    (StudyState.RUNNING, StudyState.FAILED),
    (StudyState.STOPPED, StudyState.RUNNING),
}
STUDY_PAIRS = list(itertools.product(StudyState, StudyState))


def test_study_rule_table_is_the_documented_lifecycle() -> None:
    assert {(a, b) for a, targets in STUDY_ALLOWED.items() for b in targets} == STUDY_EXPECTED_ALLOWED
    assert set(STUDY_ALLOWED) == set(StudyState)


@pytest.mark.parametrize(("current", "target"), STUDY_PAIRS, ids=[f"{a.value}->{b.value}" for a, b in STUDY_PAIRS])
def test_every_study_pair(session_maker, current: StudyState, target: StudyState) -> None:  # type: ignore[no-untyped-def]
    with session_maker() as session, session.begin():
        user = User(name=f"s-{current.value}-{target.value}", is_admin=False)
        session.add(user)
        session.flush()
        running = current is StudyState.RUNNING
        study = TuningStudy(
            name="s",
            owner_id=user.id,
            optuna_name=f"o-{current.value}-{target.value}",
            state=current.value,
            spec={},
            bundle_size=0,
            running_seconds=5.0,
        )
        session.add(study)
        session.flush()
        if running:
            study.running_since = study.created_at
        if (current, target) in STUDY_EXPECTED_ALLOWED:
            transition_study(session, study, target, "because a test said so")
            assert (study.state, study.reason) == (target.value, "because a test said so")
            assert (study.ended_at is not None) == target.is_terminal
            # the clock for `timeout` runs only while RUNNING
            assert (study.running_since is not None) == (target is StudyState.RUNNING)
            assert study.running_seconds >= 5.0
        else:
            with pytest.raises(IllegalTransition, match=f"is {current.value} and cannot become {target.value}"):
                transition_study(session, study, target, "nope")
            assert study.state == current.value
        session.rollback()
