"""Races between two requests on PostgreSQL, each on its own connection: neither loses the other's
effect. One side holds its transaction open (its row locks taken, its change flushed, not yet
committed) while the other runs in a thread; once the other has either finished or is waiting on
a lock (PostgreSQL's own `pg_stat_activity` says which), the first commits."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from phalanx.schemas import AgentRegistration, JobState
from scheduler.service import schedule_pass
from server import agents, attempts, jobs
from server.db import engine_for, session_factory, session_scope
from server.errors import Conflict, IllegalTransition
from server.models import Agent, Allocation, Job, SlotLease
from server.settings import Settings
from server.transitions import transition
from tests.agent_tokens import as_agent
from tests.integration.test_api import register, spec, submit

ONE_NODE = spec(resources={"nodes": 1})


class Racer:
    """`work` in a thread of its own, in its own transaction; records its result or error."""

    def __init__(self, work: Callable[[Session], Any], database_url: str) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self._url = database_url
        self._thread = threading.Thread(target=self._run, args=(work,))
        self._thread.start()

    def _run(self, work: Callable[[Session], Any]) -> None:
        try:
            with session_scope(self._url) as session:
                self.result = work(session)
        except BaseException as exc:  # recorded for the test's assertions
            self.error = exc

    def finished_or_blocked(self, timeout: float = 30.0) -> str:
        """Until the thread ended ("finished") or a backend of this database waits on a lock
        ("blocked"): the first transaction's locks are what it can wait on."""
        deadline = time.monotonic() + timeout
        with engine_for(self._url).connect() as conn:
            while time.monotonic() < deadline:
                if not self._thread.is_alive():
                    return "finished"
                waiting = conn.execute(
                    text(
                        "SELECT count(*) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND wait_event_type = 'Lock'"
                    )
                ).scalar_one()
                conn.commit()  # a fresh snapshot of pg_stat_activity on every read
                if waiting:
                    return "blocked"
                self._thread.join(0.01)
        raise AssertionError(f"the second transaction neither finished nor waited on a lock in {timeout} s")

    def join(self) -> Any:
        self._thread.join(30)
        assert not self._thread.is_alive(), "the second transaction never finished"
        if self.error is not None:
            raise self.error
        return self.result


@contextmanager
def held(settings: Settings) -> Iterator[Session]:
    """A transaction the test commits when it leaves the block."""
    with session_factory(settings.database_url)() as session, session.begin():
        yield session


def job_row(settings: Settings, job_id: int) -> Job:
    with session_scope(settings.database_url) as session:
        job = session.get(Job, job_id)
        assert job is not None
        session.expunge(job)
        return job


@pytest.fixture
def one_slot(client: TestClient, settings: Settings) -> TestClient:
    """The fixture's agent a0 drained away: one agent, `n1`, with one CPU slot."""
    register(client, "n1", slots=1)
    with session_scope(settings.database_url) as session:
        a0 = session.scalars(select(Agent).where(Agent.name == "a0")).one()
        agents.drain_agent(session, a0)
    return client


def test_a_kill_is_never_overwritten_by_a_scheduling_pass(one_slot: TestClient, settings: Settings) -> None:
    """Reported by a user: 7 of 200 jobs killed right after their submit ended COMPLETED, because
    a pass that read the job QUEUED before the kill committed wrote SCHEDULED over CANCELLED."""
    job_id = submit(one_slot, ONE_NODE).json()["id"]
    with held(settings) as session:
        jobs.kill_job(session, jobs.get_job(session, job_id, lock=True))
        session.flush()
        scheduler = Racer(schedule_pass, settings.database_url)
        scheduler.finished_or_blocked()
    scheduler.join()
    assert job_row(settings, job_id).state == "CANCELLED"
    with session_scope(settings.database_url) as session:
        assert session.scalar(select(func.count()).select_from(Allocation)) == 0
        assert session.scalar(select(func.count()).select_from(SlotLease)) == 0


def test_a_job_placed_by_a_pass_is_killed_after_it(one_slot: TestClient, settings: Settings) -> None:
    """The other order: the pass holds the job; the kill waits for it and then stops the attempt."""
    job_id = submit(one_slot, ONE_NODE).json()["id"]
    with held(settings) as session:
        assert schedule_pass(session)
        session.flush()
        killer = Racer(lambda s: jobs.kill_job(s, jobs.get_job(s, job_id, lock=True)), settings.database_url)
        assert killer.finished_or_blocked() == "blocked"
    killer.join()
    assert job_row(settings, job_id).state == "CANCELLED"
    work = one_slot.get(
        f"/api/v1/agents/{scheduled_agent(settings, job_id)}/work", headers=as_agent(scheduled_agent(settings, job_id))
    ).json()
    assert [a["desired"] for a in work["assignments"]] == ["stop"]


def scheduled_agent(settings: Settings, job_id: int) -> int:
    with session_scope(settings.database_url) as session:
        allocation = attempts.active_allocation(session, job_id)
        assert allocation is not None
        return allocation.nodes[0].agent_id


def running_job(client: TestClient, settings: Settings) -> tuple[int, int, int]:
    """A one-node job whose torchrun started: (job, allocation, agent)."""
    job_id = submit(client, ONE_NODE).json()["id"]
    with session_scope(settings.database_url) as session:
        schedule_pass(session)
    with session_scope(settings.database_url) as session:
        allocation = attempts.active_allocation(session, job_id)
        assert allocation is not None
        allocation_id, agent_id = allocation.id, allocation.nodes[0].agent_id
    started = client.post(
        f"/api/v1/agents/{agent_id}/allocations/{allocation_id}/started",
        json={"node_rank": 0},
        headers=as_agent(agent_id),
    )
    assert started.status_code == 204
    return job_id, allocation_id, agent_id


def exit_node(settings: Settings, agent_id: int, allocation_id: int, code: int) -> Callable[[Session], None]:
    def report(session: Session) -> None:
        allocation, node = attempts.find_node(session, agent_id, allocation_id, 0)
        attempts.record_node_exit(session, allocation, node, code, "")

    return report


def test_a_pause_then_a_clean_exit_leaves_the_job_paused(one_slot: TestClient, settings: Settings) -> None:
    job_id, allocation_id, agent_id = running_job(one_slot, settings)
    with held(settings) as session:
        jobs.pause_job(session, jobs.get_job(session, job_id, lock=True))
        session.flush()
        node = Racer(exit_node(settings, agent_id, allocation_id, 0), settings.database_url)
        assert node.finished_or_blocked() == "blocked"
    node.join()
    assert job_row(settings, job_id).state == "PAUSED"
    with session_scope(settings.database_url) as session:
        assert attempts.active_allocation(session, job_id) is None  # ended, its slot free again
        assert session.scalar(select(func.count()).select_from(SlotLease)) == 0


def test_a_clean_exit_then_a_pause_is_refused(one_slot: TestClient, settings: Settings) -> None:
    job_id, allocation_id, agent_id = running_job(one_slot, settings)
    with held(settings) as session:
        exit_node(settings, agent_id, allocation_id, 0)(session)
        session.flush()
        pauser = Racer(lambda s: jobs.pause_job(s, jobs.get_job(s, job_id, lock=True)), settings.database_url)
        assert pauser.finished_or_blocked() == "blocked"
    with pytest.raises(Conflict, match="only a queued or running job can be paused"):
        pauser.join()
    assert job_row(settings, job_id).state == "COMPLETED"


def registration(name: str) -> AgentRegistration:
    return AgentRegistration(name=name, address="127.0.0.1", cpu_slots=1)


def test_a_drained_agent_stays_drained_when_it_registers_again(one_slot: TestClient, settings: Settings) -> None:
    """An agent restarted (by its service manager, say) while an operator drains it."""
    with held(settings) as session:
        n1 = session.scalars(select(Agent).where(Agent.name == "n1").with_for_update()).one()
        agents.drain_agent(session, n1)
        session.flush()
        n1_id = n1.id
        restarted = Racer(lambda s: agents.register_agent(s, registration("n1"), n1_id), settings.database_url)
        assert restarted.finished_or_blocked() == "blocked"
    restarted.join()
    with session_scope(settings.database_url) as session:
        assert session.scalars(select(Agent.state).where(Agent.name == "n1")).one() == "DRAINING"


def test_a_drain_after_a_registration_drains(one_slot: TestClient, settings: Settings) -> None:
    with held(settings) as session:
        n1_id = session.scalars(select(Agent.id).where(Agent.name == "n1")).one()
        agent_id = agents.register_agent(session, registration("n1"), n1_id)[0].id
        session.flush()
        drainer = Racer(
            lambda s: agents.drain_agent(s, agents.get_agent(s, agent_id, lock=True)), settings.database_url
        )
        assert drainer.finished_or_blocked() == "blocked"
    drainer.join()
    with session_scope(settings.database_url) as session:
        assert session.scalars(select(Agent.state).where(Agent.id == agent_id)).one() == "DRAINING"


def test_a_stale_write_is_refused_not_applied(one_slot: TestClient, settings: Settings) -> None:
    """Compare-and-set itself: a writer whose copy of the row is stale loses, naming the winner."""
    job_id = submit(one_slot, ONE_NODE).json()["id"]
    with session_factory(settings.database_url)() as stale, stale.begin():
        job = stale.get(Job, job_id)
        assert job is not None and job.state == "QUEUED"
        with session_scope(settings.database_url) as other:
            jobs.kill_job(other, jobs.get_job(other, job_id, lock=True))
        with pytest.raises(IllegalTransition, match="became CANCELLED while this request moved it from QUEUED"):
            transition(stale, job, JobState.SCHEDULED, "placed")
    assert job_row(settings, job_id).state == "CANCELLED"


def test_the_last_two_profile_answers_racing_still_clear_the_request(client: TestClient, settings: Settings) -> None:
    """Each answer counts the answers so far; the profile's row lock makes the second count see
    the first's, so the attempt's request is cleared and the next profile may be asked for."""
    from server import profiles
    from server.models import Profile
    from tests.integration.test_api import USER

    register(client, "n2", slots=2)
    job_id = submit(client, spec(resources={"nodes": 1, "slots_per_node": 2})).json()["id"]
    with session_scope(settings.database_url) as session:
        schedule_pass(session)
    asked = client.post(f"/api/v1/jobs/{job_id}/profiles", json={"steps": 2}, headers=USER)
    assert asked.status_code == 201, asked.text
    profile_id = asked.json()["id"]

    def answer(rank: int) -> Callable[[Session], bool]:
        def record(session: Session) -> bool:
            profile = session.get(Profile, profile_id)
            assert profile is not None
            return profiles.record_answer(session, profile, rank, error=f"rank {rank}: no profiler here")

        return record

    with held(settings) as session:
        assert answer(0)(session)
        session.flush()
        second = Racer(answer(1), settings.database_url)
        assert second.finished_or_blocked() == "blocked"
    assert second.join() is True
    with session_scope(settings.database_url) as session:
        allocation = attempts.active_allocation(session, job_id)
        assert allocation is not None and allocation.profile_request is None
    assert client.get(f"/api/v1/jobs/{job_id}/profiles/{profile_id}", headers=USER).json()["state"] == "complete"


def test_a_heartbeat_batch_skips_an_agent_another_transaction_holds(client: TestClient, settings: Settings) -> None:
    """The reaper failing one agent's nodes (its row locked for update) must not hold up the other
    agents' heartbeats in the same batch, nor may a pass that just placed work on an agent (a
    key-share lock from the new node's foreign key) make its heartbeat wait or be skipped."""
    first, second = register(client, "hb1"), register(client, "hb2")
    with session_scope(settings.database_url) as session:
        before = dict(session.execute(select(Agent.id, Agent.last_heartbeat)).all())
    with held(settings) as reaper:
        reaper.execute(select(Agent).where(Agent.id == first).with_for_update()).one()
        with session_scope(settings.database_url) as session:
            outcome = agents.heartbeat_many(session, [first, second])
    assert outcome == {first: "busy"}, "the locked agent waits for a later batch; the other counts now"
    with held(settings) as placing:
        placing.execute(text("SELECT 1 FROM agents WHERE id = :id FOR KEY SHARE"), {"id": first}).one()
        with session_scope(settings.database_url) as session:
            assert agents.heartbeat_many(session, [first, second]) == {}
    with session_scope(settings.database_url) as session:
        after = dict(session.execute(select(Agent.id, Agent.last_heartbeat)).all())
    assert after[first] > before[first] and after[second] > before[second]


def test_the_last_of_a_gangs_started_reports_moves_the_job_whichever_commits_first(
    client: TestClient, settings: Settings
) -> None:
    """Both nodes of a gang report started at once. Each report counts the nodes still waiting to
    launch; without the job's row lock, each would count the other's uncommitted node as waiting,
    and the job would stay SCHEDULED with every node running."""
    register(client, "n1", slots=1)
    job_id = submit(client, spec(resources={"nodes": 2})).json()["id"]
    with session_scope(settings.database_url) as session:
        schedule_pass(session)
    with session_scope(settings.database_url) as session:
        allocation = attempts.active_allocation(session, job_id)
        assert allocation is not None
        nodes = [(n.agent_id, n.node_rank) for n in allocation.nodes]
        allocation_id = allocation.id
    (first_agent, first_rank), (second_agent, second_rank) = nodes
    with held(settings) as session:
        attempts.report_node_started(session, first_agent, allocation_id, first_rank)
        session.flush()
        second = Racer(
            lambda s: attempts.report_node_started(s, second_agent, allocation_id, second_rank), settings.database_url
        )
        assert second.finished_or_blocked() == "blocked"
    second.join()
    assert job_row(settings, job_id).state == JobState.RUNNING.value
