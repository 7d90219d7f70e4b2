"""The lists at scale, on a real PostgreSQL: the REST jobs list, the dashboard's jobs, overview and
agents pages send as many SQL statements with 300 jobs and 120 agents as with 10 and 3 (paged,
nothing per row), and keyset paging (`before`) returns every job once while jobs are submitted
between page reads. Timings at 100,000 jobs: `bench/bench_lists.py`."""

from __future__ import annotations

import json
import re

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from phalanx.client import Client
from phalanx.schemas import AgentState, JobSpec, JobState
from server.dashboard import job_pages
from server.db import session_scope
from server.models import Agent, Allocation, AllocationNode, Job, SlotLease, Team, User
from server.settings import Settings
from tests.conftest import ADMIN_TOKEN
from tests.integration.test_dashboard import USER, sign_in, submit
from tests.statements import counting

pytestmark = pytest.mark.integration
STATES = (JobState.COMPLETED, JobState.RUNNING, JobState.FAILED, JobState.CANCELLED, JobState.QUEUED)
SPEC = JobSpec.model_validate({"name": "j", "entrypoint": "python t.py", "resources": {"nodes": 1}})


def add_rows(url: str, jobs: int, agents: int) -> None:
    """`agents` more agents of two CPU slots (one in six DRAINING, one in six LOST) and `jobs`
    more jobs of every state, by the admin, alice and bob, a third in team "vision"; a RUNNING job
    holds a slot of one of these agents while one is free, with latest metrics. The newest is QUEUED."""
    with session_scope(url) as session:
        owners = list(session.scalars(select(User.id).order_by(User.id)))
        team = session.scalars(select(Team.id).where(Team.name == "vision")).one()
        first = session.scalars(select(Agent.id).order_by(Agent.id.desc()).limit(1)).one() + 1
        states = (AgentState.ACTIVE, AgentState.ACTIVE, AgentState.ACTIVE, AgentState.ACTIVE)
        new_agents = [
            Agent(
                name=f"n{first + i}",
                address="127.0.0.1",
                state=(*states, AgentState.DRAINING, AgentState.LOST)[i % 6].value,
                cpu_slots=2,
            )
            for i in range(agents)
        ]
        session.add_all(new_agents)
        session.flush()
        free = [(agent.id, slot) for agent in new_agents for slot in (0, 1)]
        for i in range(jobs):
            state = STATES[(i - jobs) % len(STATES)]  # the last one QUEUED
            job = Job(
                name=f"j{i}",
                owner_id=owners[i % len(owners)],
                team_id=team if i % 3 == 0 else None,
                state=state.value,
                spec={**SPEC.model_dump(mode="json"), "team": "vision" if i % 3 == 0 else None},
                priority=SPEC.priority,
                nodes=1,
                slots_per_node=1,
                slot_type="cpu",
                wait_reason="waiting" if state is JobState.QUEUED else None,
            )
            session.add(job)
            session.flush()
            if state is JobState.QUEUED:
                continue
            allocation = Allocation(
                job_id=job.id,
                attempt=1,
                master_addr="127.0.0.1",
                active=state is JobState.RUNNING,
                latest_metrics={"loss": 1.0 / (i + 1)},
                latest_step=i,
            )
            session.add(allocation)
            session.flush()
            if state is JobState.RUNNING and free:
                agent_id, slot = free.pop(0)
                node = AllocationNode(
                    allocation_id=allocation.id,
                    node_rank=0,
                    agent_id=agent_id,
                    slot_type="cpu",
                    slot_indices=[slot],
                    state="RUNNING",
                )
                session.add(node)
                session.flush()
                session.add(SlotLease(agent_id=agent_id, slot_type="cpu", slot_index=slot, node_id=node.id))


def team_with_member(client: TestClient) -> dict[str, str]:
    """Alice, a member of team "vision" (and bob, in no team): alice's headers."""
    tokens = {}
    for name in ("alice", "bob"):
        minted = client.post("/api/v1/tokens", json={"kind": "user", "name": name}, headers=USER)
        tokens[name] = minted.json()["token"]
    assert client.post("/api/v1/teams", json={"name": "vision"}, headers=USER).status_code == 201
    joined = client.put("/api/v1/teams/vision/members/alice", json={"role": "member"}, headers=USER)
    assert joined.status_code == 200, joined.text
    return {"Authorization": f"Bearer {tokens['alice']}"}


LISTS = {
    "rest jobs": ("/api/v1/jobs?limit=100", True),
    "dashboard jobs": ("/jobs", False),
    "overview": ("/overview", False),
    "agents": ("/agents", False),
}


@pytest.mark.parametrize("member", [False, True], ids=["admin", "team member"])
@pytest.mark.parametrize("name", list(LISTS))
def test_a_list_sends_the_same_statements_with_300_jobs_and_120_agents_as_with_10_and_3(
    client: TestClient, settings: Settings, name: str, member: bool
) -> None:
    path, rest = LISTS[name]
    alice = team_with_member(client)
    headers = alice if member else USER
    if not rest:
        sign_in(client, headers["Authorization"].removeprefix("Bearer "))

    def statements() -> int:
        client.get(path, headers=headers if rest else None)  # warm: the token cache, the CSRF cookie
        with counting(settings.database_url) as seen:
            answer = client.get(path, headers=headers if rest else None)
        assert answer.status_code == 200, answer.text
        return seen.count

    add_rows(settings.database_url, jobs=10, agents=2)  # with the fixture's a0: 3 agents
    small = statements()
    add_rows(settings.database_url, jobs=290, agents=117)
    large = statements()
    assert small == large, f"{name}: {small} statements with 10 jobs and 3 agents, {large} with 300 and 120"


def test_the_agents_page_shows_a_page_of_agents_and_counts_every_agent(client: TestClient, settings: Settings) -> None:
    team_with_member(client)
    add_rows(settings.database_url, jobs=300, agents=119)  # with the fixture's a0: 120 agents
    sign_in(client)
    first = client.get("/agents").text
    assert first.count("data-agent=") == 100
    assert "120 agents · 81 active · 20 draining · 19 lost" in first
    last_shown = re.findall(r'data-agent="(\d+)"', first)[-1]
    assert f'href="/agents?after={last_shown}">next →' in first and 'href="/agents">first' not in first
    rest = client.get(f"/agents?after={last_shown}").text
    assert rest.count("data-agent=") == 20 and "next →" not in rest and 'href="/agents">first' in rest
    overview = client.get("/overview").text
    assert '<a href="/agents">120</a> (81 active, 20 draining, 19 lost)' in overview


def test_keyset_pages_return_every_job_once_while_jobs_are_submitted(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    for i in range(22):
        submit(client, name=f"old{i}")
    by_offset: list[int] = []
    for number in range(4):  # the baseline: OFFSET pages shift under submissions and repeat jobs
        answer = client.get("/api/v1/jobs", params={"limit": 7, "offset": 7 * number}, headers=USER).json()
        by_offset += [job["id"] for job in answer]
        submit(client, name="meanwhile")
    assert len(by_offset) > len(set(by_offset))

    newest = submit(client, name="newest")  # ids count from 1: the jobs now are 1..newest
    shown: list[int] = []
    before: str | None = None
    while True:
        params: dict[str, str | int] = {"limit": 7, **({"before": before} if before else {})}
        answer = client.get("/api/v1/jobs", params=params, headers=USER)
        shown += [job["id"] for job in answer.json()]
        submit(client, name="meanwhile")
        before = answer.headers.get("x-next-before")
        if before is None:
            assert "link" not in answer.headers
            break
        assert answer.headers["link"] == f'</api/v1/jobs?limit=7&before={before}>; rel="next"'
        assert int(before) == shown[-1]
    assert shown == list(range(newest, 0, -1))

    # the SDK pages the same way (through this app: its HTTP client is the test client)
    sdk = Client("http://testserver", ADMIN_TOKEN)
    sdk._transport._http.close()
    sdk._transport._http = client  # type: ignore[assignment]  # a TestClient is an httpx.Client
    client.headers["Authorization"] = f"Bearer {ADMIN_TOKEN}"
    newest = submit(client, name="newest")
    seen = []
    for job in sdk.iter_jobs(page_size=6):
        seen.append(job.id)
        if len(seen) % 6 == 0:
            submit(client, name="meanwhile")
    assert seen == list(range(newest, 0, -1))
    assert [j.id for j in sdk.list_jobs(limit=3, before=5)] == [4, 3, 2]

    # the dashboard's "older →" links
    monkeypatch.setattr(job_pages, "PAGE_SIZE", 9)
    sign_in(client)
    rows: list[int] = []
    page = client.get("/jobs").text
    top = int(re.findall(r'data-job="(\d+)"', page)[0])
    while True:
        rows += [int(i) for i in re.findall(r'data-job="(\d+)"', page)]
        submit(client, name="meanwhile")
        older = re.search(r'before=(\d+)">older', page)
        if older is None:
            break
        page = client.get(f"/jobs?before={older.group(1)}").text
    assert rows == list(range(top, 0, -1))


def test_the_rest_list_keeps_offset_and_filters_pages_by_state(client: TestClient) -> None:
    ids = [submit(client, name=f"j{i}") for i in range(5)]
    for job_id in ids[:3]:
        assert client.post(f"/api/v1/jobs/{job_id}/kill", headers=USER).status_code == 200
    offset = client.get("/api/v1/jobs", params={"limit": 2, "offset": 1}, headers=USER).json()
    assert [j["id"] for j in offset] == [ids[3], ids[2]]
    first = client.get("/api/v1/jobs", params={"limit": 2, "state": "CANCELLED"}, headers=USER)
    assert [j["id"] for j in first.json()] == [ids[2], ids[1]]
    assert first.headers["link"] == f'</api/v1/jobs?limit=2&before={ids[1]}&state=CANCELLED>; rel="next"'
    last = client.get("/api/v1/jobs", params={"limit": 2, "state": "CANCELLED", "before": ids[1]}, headers=USER)
    assert [j["id"] for j in last.json()] == [ids[0]] and "x-next-before" not in last.headers
    assert client.get("/api/v1/jobs", params={"before": 0}, headers=USER).status_code == 422
    assert json.loads(client.get("/api/v1/jobs", params={"before": ids[0]}, headers=USER).text) == []
