"""The state machines: for jobs, studies, agents, allocation nodes, trials and checkpoints, every
(from, to) pair is either allowed by a rule or refused, and an allowed move reaches the database."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from phalanx.schemas import AgentState, JobState, NodeState, StudyState, TrialState
from server.db import make_engine, upgrade
from server.errors import IllegalTransition
from server.models import Agent, Allocation, AllocationNode, Checkpoint, Job, JobEvent, TuningStudy, TuningTrial, User
from server.transitions import (
    AGENT_ALLOWED,
    ALLOWED,
    CHECKPOINT_ALLOWED,
    COMMITTED,
    DELETING,
    NODE_ALLOWED,
    STUDY_ALLOWED,
    TRIAL_ALLOWED,
    can_transition,
    transition,
    transition_agent,
    transition_checkpoint,
    transition_node,
    transition_study,
    transition_trial,
)

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


# --- agents, allocation nodes, trials, checkpoints: the same compare-and-set move, their own tables

AGENT_EXPECTED = {
    (AgentState.ACTIVE, AgentState.DRAINING),
    (AgentState.ACTIVE, AgentState.LOST),
    (AgentState.DRAINING, AgentState.ACTIVE),  # undrained by a cluster admin
    (AgentState.DRAINING, AgentState.LOST),
    (AgentState.LOST, AgentState.ACTIVE),
}
NODE_EXPECTED = {
    (NodeState.ASSIGNED, NodeState.RUNNING),
    (NodeState.ASSIGNED, NodeState.EXITED),
    (NodeState.RUNNING, NodeState.EXITED),
}
TRIAL_EXPECTED = {(TrialState.RUNNING, t) for t in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)}
CHECKPOINT_EXPECTED = {(COMMITTED, DELETING)}
KINDS: dict[str, tuple[dict[Any, frozenset[Any]], set[tuple[Any, Any]], list[Any]]] = {
    "agent": (AGENT_ALLOWED, AGENT_EXPECTED, list(AgentState)),
    "node": (NODE_ALLOWED, NODE_EXPECTED, list(NodeState)),
    "trial": (TRIAL_ALLOWED, TRIAL_EXPECTED, list(TrialState)),
    "checkpoint": (CHECKPOINT_ALLOWED, CHECKPOINT_EXPECTED, [COMMITTED, DELETING]),
}
KIND_PAIRS = [(kind, a, b) for kind, (_, _, states) in KINDS.items() for a, b in itertools.product(states, states)]


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_rule_table_is_the_documented_lifecycle(kind: str) -> None:
    table, expected, states = KINDS[kind]
    assert {(a, b) for a, targets in table.items() for b in targets} == expected
    assert set(table) == set(states)


def make_row(session: Session, kind: str, state: Any) -> Any:
    """A row of `kind` in `state`, with the parents its foreign keys need."""
    user = User(name=f"u-{kind}-{state}", is_admin=False)
    agent = Agent(name=f"a-{kind}-{state}", address="127.0.0.1", state="ACTIVE", cpu_slots=1, gpu_slots=0)
    session.add_all([user, agent])
    session.flush()
    if kind == "agent":
        agent.state = str(state)
        session.flush()
        return agent
    job = Job(name="j", owner_id=user.id, state="RUNNING", spec={}, priority=50, nodes=1, slots_per_node=1,
              slot_type="cpu", attempts=1)  # fmt: skip
    session.add(job)
    session.flush()
    allocation = Allocation(job_id=job.id, attempt=1, master_addr="127.0.0.1", active=True)
    session.add(allocation)
    session.flush()
    row: Any
    if kind == "node":
        row = AllocationNode(allocation_id=allocation.id, node_rank=0, agent_id=agent.id, slot_type="cpu",
                             slot_indices=[0], state=str(state), desired="run")  # fmt: skip
    elif kind == "checkpoint":
        row = Checkpoint(job_id=job.id, allocation_id=allocation.id, attempt=1, step=1, metrics={}, size_bytes=1,
                         path="file:///c", state=str(state))  # fmt: skip
    else:
        study = TuningStudy(name="s", owner_id=user.id, optuna_name=f"o-{state}", state="RUNNING", spec={},
                            bundle_size=0, running_seconds=0.0)  # fmt: skip
        session.add(study)
        session.flush()
        row = TuningTrial(study_id=study.id, number=0, optuna_trial_id=abs(hash(str(state))) % 10**6, job_id=job.id,
                          params={}, state=str(state))  # fmt: skip
    session.add(row)
    session.flush()
    return row


MOVES = {
    "agent": transition_agent,
    "node": transition_node,
    "trial": transition_trial,
    "checkpoint": transition_checkpoint,
}


@pytest.mark.parametrize(("kind", "current", "target"), KIND_PAIRS, ids=[f"{k}:{a}->{b}" for k, a, b in KIND_PAIRS])
def test_every_pair_of_every_kind(session_maker, kind: str, current: Any, target: Any) -> None:  # type: ignore[no-untyped-def]
    with session_maker() as session, session.begin():
        row = make_row(session, kind, current)
        if (current, target) in KINDS[kind][1]:
            MOVES[kind](session, row, target)
            assert row.state == str(target)
            session.expire(row)
            assert row.state == str(target)  # written to the database, not only to the object
        else:
            with pytest.raises(IllegalTransition, match=f"{kind} {row.id} is {current} and cannot become {target}"):
                MOVES[kind](session, row, target)
            session.expire(row)
            assert row.state == str(current)
        session.rollback()
