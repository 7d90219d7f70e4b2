"""An agent's node reports and log batches, many in one call (`POST /agents/{id}/reports` and
`POST /agents/{id}/logs`): each is applied or refused on its own, as its own call would have been,
in the order sent; calls that touch the same jobs in opposite orders both go through."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import func, select

from phalanx.client import Client
from phalanx.schemas import ExitReport, JobState, NodeState
from phalanx.schemas.protocol import MAX_REPORTS_PER_CALL
from server import attempts
from server.db import session_scope
from server.models import Allocation, AllocationNode, Job, JobEvent, LogLine, SlotLease
from server.settings import Settings
from tests.agent_tokens import as_agent, token_of
from tests.conftest import AGENT_TOKEN
from tests.integration.test_api import register, schedule, spec, submit
from tests.integration.test_dashboard_live import LiveServer
from tests.processes import wait_for
from worker_agent.agent import AgentConfig, AgentDaemon, NodeRunner

ONE_NODE = spec(resources={"nodes": 1})


def placed(client: TestClient, settings: Settings, count: int) -> list[tuple[int, int, int]]:
    """`count` one-node jobs, placed: (job, allocation, agent) each."""
    job_ids = [submit(client, ONE_NODE).json()["id"] for _ in range(count)]
    schedule(settings)
    found = []
    with session_scope(settings.database_url) as session:
        for job_id in job_ids:
            allocation = attempts.active_allocation(session, job_id)
            assert allocation is not None, f"job {job_id} was not placed"
            found.append((job_id, allocation.id, allocation.nodes[0].agent_id))
    return found


def report(client: TestClient, agent_id: int, *reports: dict[str, Any]) -> list[dict[str, Any]]:
    answer = client.post(
        f"/api/v1/agents/{agent_id}/reports", json={"reports": list(reports)}, headers=as_agent(agent_id)
    )
    assert answer.status_code == 200, answer.text
    results: list[dict[str, Any]] = answer.json()["results"]
    return results


def started(allocation_id: int) -> dict[str, Any]:
    return {"kind": "started", "allocation_id": allocation_id, "node_rank": 0}


def exited(allocation_id: int, code: int = 0) -> dict[str, Any]:
    return {"kind": "exit", "allocation_id": allocation_id, "node_rank": 0, "exit_code": code}


def job_states(settings: Settings, job_ids: list[int]) -> list[str]:
    with session_scope(settings.database_url) as session:
        states = dict(session.execute(select(Job.id, Job.state).where(Job.id.in_(job_ids))).all())
    return [states[j] for j in job_ids]


def test_the_nodes_an_agent_starts_together_are_reported_in_one_call(client: TestClient, settings: Settings) -> None:
    (job_a, alloc_a, agent), (job_b, alloc_b, agent_b) = placed(client, settings, 2)
    assert agent == agent_b  # the fixture's one agent, two slots
    assert report(client, agent, started(alloc_a), started(alloc_b)) == [{"status": 204, "error": None}] * 2
    assert job_states(settings, [job_a, job_b]) == [JobState.RUNNING.value] * 2
    # sent again (its answer was lost): applied once, answered the same
    assert report(client, agent, started(alloc_a), started(alloc_b)) == [{"status": 204, "error": None}] * 2


def test_a_refused_report_changes_nothing_and_the_others_apply(client: TestClient, settings: Settings) -> None:
    (job_a, alloc_a, agent), (job_b, alloc_b, _) = placed(client, settings, 2)
    other = register(client, "n1", slots=1)  # after: both jobs above are on the fixture's agent
    outcomes = report(client, agent, started(alloc_a), started(999_999), started(alloc_b))
    assert [o["status"] for o in outcomes] == [204, 404, 204]
    assert "999999 does not exist" in outcomes[1]["error"]
    # another agent's node: 409 for that report alone, its job untouched
    (job_c, alloc_c, agent_c), *_ = placed(client, settings, 1)
    assert agent_c == other
    outcomes = report(client, agent, started(alloc_c), exited(alloc_a))
    assert [o["status"] for o in outcomes] == [409, 204]
    assert f"belongs to agent {other}" in outcomes[0]["error"]
    assert job_states(settings, [job_a, job_b, job_c]) == ["COMPLETED", "RUNNING", "SCHEDULED"]


def test_reports_apply_in_the_order_sent(client: TestClient, settings: Settings) -> None:
    """A node that started and ended between two calls is reported started, then exited."""
    ((job_id, allocation_id, agent),) = placed(client, settings, 1)
    assert [o["status"] for o in report(client, agent, started(allocation_id), exited(allocation_id, 3))] == [204, 204]
    with session_scope(settings.database_url) as session:
        node = session.scalars(select(AllocationNode).where(AllocationNode.allocation_id == allocation_id)).one()
        assert (node.state, node.exit_code) == (NodeState.EXITED.value, 3)
        assert node.started_at is not None  # started first: the exit ended a node that ran
    assert job_states(settings, [job_id]) != [JobState.SCHEDULED.value]


def test_calls_that_lock_the_same_jobs_in_opposite_orders_both_apply(client: TestClient, settings: Settings) -> None:
    """Each call locks its jobs first, in id order: two calls holding several job locks never
    wait for each other in a cycle (PostgreSQL would abort one as a deadlock: a 500)."""
    jobs = placed(client, settings, 2)
    agent = jobs[0][2]
    (_, first, _), (_, second, _) = jobs
    answers: list[int] = []

    def send(reports: list[dict[str, Any]]) -> None:
        for _ in range(20):
            body = {"reports": reports}
            answer = client.post(f"/api/v1/agents/{agent}/reports", json=body, headers=as_agent(agent))
            answers.append(answer.status_code)

    callers = [
        threading.Thread(target=send, args=([started(first), started(second)],)),
        threading.Thread(target=send, args=([started(second), started(first)],)),
    ]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert answers == [200] * 40


def attempt_of(settings: Settings, job_id: int) -> tuple[bool, list[tuple[int, str, int | None]], int, list[str]]:
    """The job's first attempt: whether it is active, its nodes (rank, state, exit code), the
    slots it still holds, and the job's history (from → to: reason)."""
    with session_scope(settings.database_url) as session:
        allocation = session.scalars(select(Allocation).where(Allocation.job_id == job_id)).one()
        nodes = [(n.node_rank, n.state, n.exit_code) for n in sorted(allocation.nodes, key=lambda n: n.node_rank)]
        held = session.execute(
            select(func.count()).select_from(SlotLease).where(SlotLease.node_id.in_([n.id for n in allocation.nodes]))
        ).scalar_one()
        events = session.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)).all()
        return allocation.active, nodes, held, [f"{e.from_state} → {e.to_state}: {e.reason}" for e in events]


def placed_gang(client: TestClient, settings: Settings, **overrides: Any) -> tuple[int, int, dict[int, int]]:
    """A two-node job, placed: its id, its allocation's, and its node rank on each agent."""
    job_id = submit(client, spec(resources={"nodes": 2}, **overrides)).json()["id"]
    schedule(settings)
    with session_scope(settings.database_url) as session:
        allocation = attempts.active_allocation(session, job_id)
        assert allocation is not None, f"job {job_id} was not placed"
        return job_id, allocation.id, {n.agent_id: n.node_rank for n in allocation.nodes}


def test_the_clean_exits_an_agent_reports_together_end_their_attempts(client: TestClient, settings: Settings) -> None:
    """Exits with code 0 of attempts still open are applied together (`attempts.report_nodes_exited`),
    with every effect one exit of its own has: nodes exited, slots freed, the job COMPLETED with
    its event when its last node exited, the attempt closed. A gang completes only at its last
    node; a report sent again, and refused ones, change nothing."""
    ((solo, solo_alloc, agent),) = placed(client, settings, 1)
    report(client, agent, started(solo_alloc))
    peer = register(client, "n1", slots=1)
    gang, gang_alloc_id, rank_of = placed_gang(client, settings)
    assert sorted(rank_of) == sorted([agent, peer]), "the gang's nodes are on the two agents"
    for owner, rank in rank_of.items():
        report(client, owner, {**started(gang_alloc_id), "node_rank": rank})
    gang_exit = {**exited(gang_alloc_id), "node_rank": rank_of[agent]}
    peer_exit = {**exited(gang_alloc_id), "node_rank": rank_of[peer]}

    outcomes = report(client, agent, exited(solo_alloc), gang_exit, exited(999_999), peer_exit, exited(solo_alloc))
    assert [o["status"] for o in outcomes] == [204, 204, 404, 409, 204]
    assert "999999 does not exist" in outcomes[2]["error"]
    assert f"belongs to agent {peer}" in outcomes[3]["error"]
    assert job_states(settings, [solo, gang]) == ["COMPLETED", "RUNNING"]
    active, nodes, held, history = attempt_of(settings, solo)
    assert (active, nodes, held) == (False, [(0, "EXITED", 0)], 0)
    assert history[-1] == "RUNNING → COMPLETED: every rank exited with code 0"
    active, nodes, held, _ = attempt_of(settings, gang)
    assert (active, held) == (True, 1), "the gang's attempt waits for its other node"
    assert sorted(nodes)[rank_of[agent]][1:] == ("EXITED", 0)

    assert [o["status"] for o in report(client, peer, peer_exit, peer_exit)] == [204, 204]
    assert job_states(settings, [gang]) == ["COMPLETED"]
    active, nodes, held, history = attempt_of(settings, gang)
    assert (active, [n[1:] for n in nodes], held) == (False, [("EXITED", 0)] * 2, 0)
    assert [h for h in history if h.endswith("every rank exited with code 0")] == [
        "RUNNING → COMPLETED: every rank exited with code 0"
    ]


def test_a_clean_exit_of_an_attempt_already_ending_follows_its_failure(client: TestClient, settings: Settings) -> None:
    """A node that exits with 0 after its gang's peer failed does not complete the job: the
    attempt ends as a failure and the job restarts, beside another job's exit completing it."""
    ((solo, solo_alloc, agent),) = placed(client, settings, 1)
    peer = register(client, "n1", slots=1)
    gang, gang_alloc_id, rank_of = placed_gang(client, settings, max_restarts=1)
    report(client, agent, started(solo_alloc), {**started(gang_alloc_id), "node_rank": rank_of[agent]})
    report(client, peer, {**started(gang_alloc_id), "node_rank": rank_of[peer]})
    report(client, peer, {**exited(gang_alloc_id, 7), "node_rank": rank_of[peer]})
    assert job_states(settings, [gang]) == ["RESTARTING"]

    outcomes = report(client, agent, {**exited(gang_alloc_id), "node_rank": rank_of[agent]}, exited(solo_alloc))
    assert [o["status"] for o in outcomes] == [204, 204]
    assert job_states(settings, [solo, gang]) == ["COMPLETED", "QUEUED"]
    active, nodes, held, history = attempt_of(settings, gang)
    assert (active, sorted(n[1:] for n in nodes), held) == (False, [("EXITED", 0), ("EXITED", 7)], 0)
    assert not any(h.endswith("every rank exited with code 0") for h in history)


def test_bounds_are_checked_before_anything_is_applied(client: TestClient, settings: Settings) -> None:
    ((job_id, allocation_id, agent),) = placed(client, settings, 1)
    too_many = [started(allocation_id)] * (MAX_REPORTS_PER_CALL + 1)
    url = f"/api/v1/agents/{agent}/reports"
    answer = client.post(url, json={"reports": too_many}, headers=as_agent(agent))
    assert answer.status_code == 422
    unknown = {"kind": "vanished", "allocation_id": allocation_id, "node_rank": 0}
    answer = client.post(url, json={"reports": [started(allocation_id), unknown]}, headers=as_agent(agent))
    assert answer.status_code == 422
    assert client.post(url, json={"reports": []}, headers=as_agent(agent)).status_code == 422
    assert job_states(settings, [job_id]) == [JobState.SCHEDULED.value]  # nothing applied


def lines(text: str, count: int = 2) -> list[dict[str, Any]]:
    return [{"rank": 0, "stream": "stdout", "time": 1.0, "line": f"{text} {i}"} for i in range(count)]


def stored_lines(settings: Settings) -> dict[int, int]:
    with session_scope(settings.database_url) as session:
        return dict(session.execute(select(LogLine.allocation_id, func.count()).group_by(LogLine.allocation_id)).all())


def test_an_agents_log_batches_of_several_allocations_travel_in_one_call(
    client: TestClient, settings: Settings
) -> None:
    (_, alloc_a, agent), (_, alloc_b, _) = placed(client, settings, 2)
    report(client, agent, exited(alloc_b))  # ended: its logs are closed
    body = {
        "batches": [
            {"allocation_id": alloc_a, "batch_id": "s-0", "lines": lines("a")},
            {"allocation_id": alloc_b, "batch_id": "s-0", "lines": lines("b")},
            {"allocation_id": alloc_a, "batch_id": "s-2", "lines": lines("a", 3)},
            {"allocation_id": alloc_a, "batch_id": "s-0", "lines": lines("a")},  # twice in one call: once
        ]
    }
    url = f"/api/v1/agents/{agent}/logs"
    answer = client.post(url, json=body, headers=as_agent(agent))
    assert answer.status_code == 200, answer.text
    outcomes = answer.json()["results"]
    assert [o["status"] for o in outcomes] == [204, 409, 204, 204]
    assert "has ended" in outcomes[1]["error"]
    assert stored_lines(settings) == {alloc_a: 5}
    # sent again: every batch is known by its id, stored once
    assert client.post(url, json=body, headers=as_agent(agent)).status_code == 200
    assert stored_lines(settings) == {alloc_a: 5}


def test_a_log_call_is_capped_by_its_lines_altogether(client: TestClient, settings: Settings) -> None:
    ((_, allocation_id, agent),) = placed(client, settings, 1)
    half = 50_001  # two batches under the cap of one, over it together
    body = {"batches": [{"allocation_id": allocation_id, "lines": lines("x", half)} for _ in range(2)]}
    answer = client.post(f"/api/v1/agents/{agent}/logs", json=body, headers=as_agent(agent))
    assert answer.status_code == 422
    assert "100,000" in answer.text
    assert stored_lines(settings) == {}


def test_an_agent_never_starts_again_a_node_it_ran_to_its_exit(
    client: TestClient, settings: Settings, tmp_path: Path
) -> None:
    """A work answer read before a node's exit was applied still lists it to run (its own exit
    wakes no long-poll): the agent must not run that node a second time. An exit report the server
    never got is sent again while the server still lists the node."""
    (_, first, agent_id), (_, second, _) = placed(client, settings, 2)
    with LiveServer(settings) as live:
        agent = AgentDaemon(AgentConfig(live.url, AGENT_TOKEN, "a0", "127.0.0.1", 2, 0, tmp_path / "work"))
        agent.client = Client(live.url, token_of(as_agent(agent_id)))
        agent.agent_id = agent_id
        agent.reporter.start()
        stale = agent.client.agent_work(agent_id, "", wait=0).assignments
        assert sorted(a.allocation_id for a in stale) == [first, second]
        for assignment in stale:
            runner = NodeRunner(agent, assignment)  # never started: its node "ran" and ended
            agent._runners[(assignment.allocation_id, 0)] = runner
            report = ExitReport(kind="exit", allocation_id=assignment.allocation_id, node_rank=0, exit_code=0)
            delivered = assignment.allocation_id == first and agent.report_exit(report)
            agent.forget(runner, None if delivered else report)  # the second's report was lost

        agent.reconcile(stale)
        assert agent._runners == {}, "a node that ended was started again"
        wait_for(lambda: node_states(settings) == {first: "EXITED", second: "EXITED"}, 30, "the lost exit re-sent")
        agent.reconcile(agent.client.agent_work(agent_id, "", wait=0).assignments)
        assert agent._runners == {} and agent._ended == {}, "nodes the server no longer lists are forgotten"
        agent.client.close()


def node_states(settings: Settings) -> dict[int, str]:
    with session_scope(settings.database_url) as session:
        return dict(session.execute(select(AllocationNode.allocation_id, AllocationNode.state)).all())
