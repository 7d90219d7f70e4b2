"""Each agent proves which agent it is: the cluster's agent token only registers; the token a
registration answers acts for that agent alone, and a taken name stays with its agent."""

from __future__ import annotations

from fastapi.testclient import TestClient
from sqlalchemy import update

from server.db import session_scope
from server.models import Agent
from server.settings import Settings
from tests.agent_tokens import CLUSTER_AGENT, as_agent, register_agent
from tests.integration.test_api import USER, bundle_bytes, schedule, spec, submit


def registration(name: str, **extra: object) -> dict[str, object]:
    return {"name": name, "address": "127.0.0.1", "cpu_slots": 1, **extra}


def test_an_agent_token_acts_for_its_own_agent_only(client: TestClient) -> None:
    mine, theirs = register_agent(client, "mine"), register_agent(client, "theirs")
    assert client.post(f"/api/v1/agents/{mine}/heartbeat", headers=as_agent(mine)).status_code == 204
    for method, path in [
        ("POST", f"/api/v1/agents/{theirs}/heartbeat"),
        ("GET", f"/api/v1/agents/{theirs}/work"),
        ("POST", f"/api/v1/agents/{theirs}/allocations/1/exit"),
    ]:
        answer = client.request(method, path, headers=as_agent(mine), json={"node_rank": 0, "exit_code": 0})
        assert answer.status_code == 403 and f"belongs to agent {mine}" in answer.json()["error"], (path, answer.text)
    bootstrap = client.post(f"/api/v1/agents/{mine}/heartbeat", headers=CLUSTER_AGENT)
    assert bootstrap.status_code == 403 and "only registers agents" in bootstrap.json()["error"]
    assert client.get("/api/v1/jobs", headers=as_agent(mine)).status_code == 403  # no user route either
    # its own token re-registers itself, never another name
    other_name = client.post("/api/v1/agents/register", json=registration("theirs"), headers=as_agent(mine))
    assert other_name.status_code == 403


def test_a_taken_name_is_refused_unless_the_agent_proves_it_is_restarting(
    client: TestClient, settings: Settings
) -> None:
    first = client.post("/api/v1/agents/register", json=registration("node7"), headers=CLUSTER_AGENT).json()
    squatter = client.post("/api/v1/agents/register", json=registration("node7", cpu_slots=64), headers=CLUSTER_AGENT)
    assert squatter.status_code == 409 and "belongs to a running agent" in squatter.json()["error"]
    forged = registration("node7", agent_token=f"phx_n_{first['id']}_guessed")
    assert client.post("/api/v1/agents/register", json=forged, headers=CLUSTER_AGENT).status_code == 409

    restarted = client.post(
        "/api/v1/agents/register", json=registration("node7", agent_token=first["agent_token"]), headers=CLUSTER_AGENT
    )
    assert restarted.status_code == 200 and restarted.json()["id"] == first["id"]
    old = {"Authorization": f"Bearer {first['agent_token']}"}
    assert client.post(f"/api/v1/agents/{first['id']}/heartbeat", headers=old).status_code == 401  # rotated
    new = {"Authorization": f"Bearer {restarted.json()['agent_token']}"}
    assert client.post(f"/api/v1/agents/{first['id']}/heartbeat", headers=new).status_code == 204

    # a machine that was replaced (its agent declared lost) may take the name over
    with session_scope(settings.database_url) as session:
        session.execute(update(Agent).where(Agent.id == first["id"]).values(state="LOST"))
    replaced = client.post("/api/v1/agents/register", json=registration("node7"), headers=CLUSTER_AGENT)
    assert replaced.status_code == 200 and replaced.json()["state"] == "ACTIVE"
    assert client.post(f"/api/v1/agents/{first['id']}/heartbeat", headers=new).status_code == 401


def test_an_agent_fetches_only_the_code_of_jobs_it_hosts(client: TestClient, settings: Settings) -> None:
    host, idle = register_agent(client, "host"), register_agent(client, "idle")
    job = submit(client, spec(resources={"nodes": 1}), bundle_bytes())
    assert job.status_code == 201
    assert client.get(f"/api/v1/jobs/{job.json()['id']}/bundle", headers=as_agent(host)).status_code == 403
    placed = schedule(settings)
    (on,) = placed
    (off,) = {host, idle} - placed
    assert client.get(f"/api/v1/jobs/{job.json()['id']}/bundle", headers=as_agent(on)).content == bundle_bytes()
    refused = client.get(f"/api/v1/jobs/{job.json()['id']}/bundle", headers=as_agent(off))
    assert refused.status_code == 403 and "no current node on this agent" in refused.json()["error"]
    assert client.get(f"/api/v1/jobs/{job.json()['id']}/bundle", headers=CLUSTER_AGENT).status_code == 403
    assert client.get(f"/api/v1/jobs/{job.json()['id']}/bundle", headers=USER).status_code == 403
