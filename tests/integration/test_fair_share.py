"""Fair sharing on the real app and PostgreSQL: team shares set by cluster admins, limits, holds,
preemption of borrowed slots (costing no restart), the queue's order and estimates, and usage.

Scheduling passes run in the test (`scheduler.service.schedule_pass`) so that each step is seen;
agents report through their own tokens, ranks through their allocation's credential."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from scheduler.service import schedule_pass
from server.app import create_app
from server.db import session_scope
from server.settings import Settings
from tests.agent_tokens import as_agent, register_agent
from tests.integration.test_access import new_user
from tests.integration.test_api import USER, spec
from tests.integration.test_fault_tolerance import exit_node, job, start_all
from tests.integration.test_teams import make_team


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    """The app with no agent: each test registers the slots its story needs."""
    with TestClient(create_app(settings, enqueue=lambda *_, **__: None), follow_redirects=False) as test_client:
        yield test_client


def submit(client: TestClient, headers: dict[str, str], name: str, slots: int = 1, **overrides: Any) -> int:
    body = json.dumps(spec(name=name, resources={"nodes": 1, "slots_per_node": slots}, **overrides))
    response = client.post("/api/v1/jobs", files={"spec": (None, body, "application/json")}, headers=headers)
    assert response.status_code == 201, response.text
    job_id: int = response.json()["id"]
    return job_id


def schedule(settings: Settings, **overrides: Any) -> None:
    with session_scope(settings.database_url) as session:
        schedule_pass(session, settings.model_copy(update=overrides))


def state(client: TestClient, job_id: int) -> str:
    value: str = job(client, job_id)["state"]
    return value


def test_only_cluster_admins_set_a_teams_share_and_bad_ones_are_refused(client: TestClient) -> None:
    lead = new_user(client, "lead")
    make_team(client, "vision", lead="admin")
    body = {"weight": 2, "guarantee": {"cpu": 4}, "limit": {"cpu": 8, "gpu": 2}, "user_limit": {"cpu": 2}}
    refused = client.patch("/api/v1/teams/vision", json=body, headers=lead)
    assert refused.status_code == 403 and "cluster admin" in refused.json()["error"]
    assert client.get("/api/v1/teams/vision", headers=lead).json()["weight"] == 1

    team = client.patch("/api/v1/teams/vision", json=body, headers=USER)
    assert team.status_code == 200, team.text
    shown = client.get("/api/v1/teams/vision", headers=lead).json()
    assert (shown["weight"], shown["guarantee"], shown["limit"], shown["user_limit"]) == (
        2,
        {"cpu": 4},
        {"cpu": 8, "gpu": 2},
        {"cpu": 2},
    )
    # a guarantee above the limit could never be met: refused, nothing changes
    over = client.patch("/api/v1/teams/vision", json={"guarantee": {"cpu": 9}}, headers=USER)
    assert over.status_code == 422 and "raise the limit or lower the guarantee" in over.json()["error"]
    for bad in ({"weight": 0}, {"limit": {"tpu": 1}}, {"limit": {"cpu": -1}}, {"colour": "red"}):
        assert client.patch("/api/v1/teams/vision", json=bad, headers=USER).status_code == 422, bad
    # null drops one slot type's value, the rest stays
    dropped = client.patch("/api/v1/teams/vision", json={"limit": {"gpu": None}}, headers=USER).json()
    assert dropped["limit"] == {"cpu": 8} and dropped["guarantee"] == {"cpu": 4} and dropped["weight"] == 2


def test_a_team_at_its_limit_waits_while_slots_are_free_and_the_reason_names_the_limit(
    client: TestClient, settings: Settings
) -> None:
    dev = new_user(client, "dev")
    make_team(client, "small", dev="member")
    assert client.patch("/api/v1/teams/small", json={"limit": {"cpu": 1}}, headers=USER).status_code == 200
    register_agent(client, "n1", cpu_slots=2)
    first, second = submit(client, dev, "a"), submit(client, dev, "b")
    schedule(settings)
    assert (state(client, first), state(client, second)) == ("SCHEDULED", "QUEUED")
    waiting = job(client, second)
    assert "team small's limit is 1 cpu slot and it holds 1" in waiting["wait_reason"]
    assert waiting["queue"]["position"] == 1 and "limit" in waiting["queue"]["reason"]
    assert client.get("/api/v1/teams/small", headers=dev).json()["holding"] == {"cpu": 1}


def test_admins_hold_and_release_jobs_and_team_queues(client: TestClient, settings: Settings) -> None:
    lead, dev = new_user(client, "lead"), new_user(client, "dev")
    make_team(client, "ops", lead="admin", dev="member")
    register_agent(client, "n1", cpu_slots=2)
    job_id = submit(client, dev, "held")
    refused = client.post(f"/api/v1/jobs/{job_id}/hold", headers=dev)  # its owner pauses instead
    assert refused.status_code == 403 and "may pause it" in refused.json()["error"]
    assert client.post(f"/api/v1/jobs/{job_id}/hold", headers=lead).json()["held"] is True
    schedule(settings)
    held = job(client, job_id)
    assert held["state"] == "QUEUED" and f"phalanx jobs release {job_id}" in held["wait_reason"]
    assert held["queue"]["position"] is None
    assert client.post(f"/api/v1/jobs/{job_id}/release", headers=lead).json()["held"] is False

    assert client.post("/api/v1/teams/ops/hold", headers=dev).status_code == 403
    assert client.post("/api/v1/teams/ops/hold", headers=lead).json()["queue_held"] is True
    other = submit(client, dev, "second")
    schedule(settings)
    assert (state(client, job_id), state(client, other)) == ("QUEUED", "QUEUED")
    assert "phalanx teams release ops" in job(client, other)["wait_reason"]
    assert client.post("/api/v1/teams/ops/release", headers=USER).json()["queue_held"] is False
    schedule(settings)
    assert (state(client, job_id), state(client, other)) == ("SCHEDULED", "SCHEDULED")
    ended = client.post(f"/api/v1/jobs/{job_id}/kill", headers=dev)
    assert ended.status_code == 200
    assert client.post(f"/api/v1/jobs/{job_id}/hold", headers=lead).status_code == 409


def test_a_team_below_its_guarantee_preempts_a_borrower_which_requeues_at_no_cost(
    client: TestClient, settings: Settings
) -> None:
    owner_a, owner_b = new_user(client, "alice"), new_user(client, "bob")
    make_team(client, "lender", bob="member")
    make_team(client, "borrower", alice="member")
    client.patch("/api/v1/teams/lender", json={"guarantee": {"cpu": 2}}, headers=USER)
    register_agent(client, "n1", cpu_slots=2)
    borrowing = submit(client, owner_a, "borrowing", slots=2)
    schedule(settings)
    allocation = start_all(client, borrowing)
    assert state(client, borrowing) == "RUNNING"

    owed = submit(client, owner_b, "owed", slots=2)
    schedule(settings, preemption_min_runtime=3600)  # too young to preempt: it waits, and says so
    assert state(client, borrowing) == "RUNNING" and state(client, owed) == "QUEUED"
    schedule(settings, preemption_min_runtime=0, preemption_grace=7)
    victim = job(client, borrowing)
    assert victim["state"] == "RESTARTING", victim
    assert "being preempted" in job(client, owed)["wait_reason"]
    assert any(f"preempting job {borrowing}" in e["reason"] for e in job(client, owed)["events"])
    node = allocation["nodes"][0]
    work = client.get(f"/api/v1/agents/{node['agent_id']}/work", headers=as_agent(node["agent_id"])).json()
    (assignment,) = [a for a in work["assignments"] if a["allocation_id"] == allocation["id"]]
    assert (assignment["desired"], assignment["stop_grace"]) == ("stop", 7)

    exit_node(client, allocation, 0, -15, "stopped by Phalanx")
    victim = job(client, borrowing)
    assert victim["state"] == "QUEUED"
    assert (victim["restarts_used"], victim["infra_restarts_used"]) == (0, 0)
    assert any("costing no restart" in e["reason"] and "preempted" in e["reason"] for e in victim["events"])
    schedule(settings, preemption_min_runtime=0)
    assert state(client, owed) == "SCHEDULED" and state(client, borrowing) == "QUEUED"


def test_the_queue_goes_by_fair_share_and_hides_other_teams_jobs(client: TestClient, settings: Settings) -> None:
    heavy, light, outsider = new_user(client, "heavy"), new_user(client, "light"), new_user(client, "outsider")
    make_team(client, "big", heavy="member")
    make_team(client, "tiny", light="member")
    register_agent(client, "n1", cpu_slots=1)
    running = submit(client, heavy, "running")
    schedule(settings)
    start_all(client, running)
    waiting_heavy = [submit(client, heavy, f"h{i}") for i in range(3)]
    waiting_light = submit(client, light, "l0")  # submitted last, first in line: its team holds nothing
    queue = client.get("/api/v1/queue", headers=light).json()
    assert queue["queued"] == 4
    entries = queue["entries"]
    assert [e["position"] for e in entries] == [1, 2, 3, 4]
    assert entries[0]["job_id"] == waiting_light and entries[0]["team"] == "tiny"
    assert [e["job_id"] for e in entries[1:]] == [None, None, None]  # big's jobs: no id, name or owner
    assert {e["team"] for e in entries[1:]} == {"big"} and entries[1]["name"] is None
    mine = client.get("/api/v1/queue", headers=heavy).json()["entries"]
    assert [e["job_id"] for e in mine[1:]] == waiting_heavy
    assert [e["team_position"] for e in mine] == [1, 1, 2, 3]
    shown = job(client, waiting_heavy[1])["queue"]
    assert (shown["position"], shown["team_position"], shown["queued"]) == (3, 2, 4)
    assert client.get("/api/v1/queue", headers=outsider).json()["entries"][0]["job_id"] is None


def test_a_queued_job_gets_a_start_estimate_from_the_running_jobs_progress(
    client: TestClient, settings: Settings
) -> None:
    register_agent(client, "n1", cpu_slots=1)
    running = submit(client, USER, "declared", total_steps=1000)
    schedule(settings)
    allocation = start_all(client, running)
    waiting = submit(client, USER, "next")
    assert job(client, waiting)["queue"]["estimated_start"] is None  # no step reported yet
    credential = {"Authorization": f"Bearer {allocation_credential(client, allocation)}"}
    batch = {"records": [{"rank": 0, "step": 100, "time": time.time(), "values": {"loss": 1.0}}]}
    url = f"/api/v1/allocations/{allocation['id']}/metrics"
    assert client.post(url, json=batch, headers=credential).status_code == 204
    place = job(client, waiting)["queue"]
    assert place["estimated_start"] is not None, place
    assert "total_steps" in place["estimate"]


def allocation_credential(client: TestClient, allocation: dict[str, Any]) -> str:
    node = allocation["nodes"][0]
    work = client.get(f"/api/v1/agents/{node['agent_id']}/work", headers=as_agent(node["agent_id"])).json()
    (assignment,) = [a for a in work["assignments"] if a["allocation_id"] == allocation["id"]]
    credential: str = assignment["credential"]
    return credential


def test_usage_counts_slot_hours_by_team_and_user_for_those_who_may_see_them(
    client: TestClient, settings: Settings
) -> None:
    dev, outsider = new_user(client, "dev"), new_user(client, "outsider")
    make_team(client, "vision", dev="member")
    register_agent(client, "n1", cpu_slots=2)
    job_id = submit(client, dev, "used", slots=2)
    schedule(settings)
    allocation = start_all(client, job_id)
    exit_node(client, allocation, 0, 0)
    assert state(client, job_id) == "COMPLETED"
    report = client.get("/api/v1/usage", headers=dev).json()
    (row,) = report["rows"]
    assert (row["user"], row["team"], row["slot_type"], row["jobs"]) == ("dev", "vision", "cpu", 1)
    assert row["slot_hours"] > 0 and report["by_team"] == {"vision": row["slot_hours"]}
    assert client.get("/api/v1/usage", headers=USER).json()["rows"] == [row]  # a cluster admin sees all
    assert client.get("/api/v1/usage", headers=outsider).json()["rows"] == []
    # a period before the job held nothing; a reversed one is refused
    before = client.get("/api/v1/usage", params={"until": "2020-01-01T00:00:00"}, headers=dev).json()
    assert before["rows"] == []
    reversed_period = client.get(
        "/api/v1/usage", params={"since": "2030-01-01T00:00:00+05:00", "until": "2029-01-01"}, headers=dev
    )
    assert reversed_period.status_code == 422 and "must come after" in reversed_period.json()["error"]
