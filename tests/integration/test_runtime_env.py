"""The server's side of runtime environments: the first lock reported is the job's, every node's
assignment carries it, and a node whose environment failed ends the job without a restart."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from phalanx.schemas.protocol import MAX_LOCK_CHARS
from scheduler.service import schedule_pass
from server.db import session_scope
from server.settings import Settings
from tests.agent_tokens import as_agent
from tests.integration.test_api import USER, register, spec, submit

RUNTIME_ENV = {"pip": ["phx-probe==1.0"]}


def assignments(client: TestClient, agents: list[int]) -> dict[int, dict[str, Any]]:
    """Node rank -> its assignment, as each agent sees it."""
    found = {}
    for agent in agents:
        for a in client.get(f"/api/v1/agents/{agent}/work", headers=as_agent(agent)).json()["assignments"]:
            found[a["node_rank"]] = {**a, "agent": agent}
    return found


def placed_job(client: TestClient, settings: Settings, **overrides: Any) -> dict[int, dict[str, Any]]:
    agents = [register(client, "n1"), register(client, "n2")]
    body = spec(runtime_env=RUNTIME_ENV, max_restarts=3, **overrides)
    assert submit(client, body).status_code == 201
    with session_scope(settings.database_url) as session:
        schedule_pass(session)
    nodes = assignments(client, agents)
    assert len(nodes) == 2
    return nodes


def test_the_first_lock_reported_is_the_one_every_node_installs(client: TestClient, settings: Settings) -> None:
    nodes = placed_job(client, settings)
    assert all(
        n["runtime_env"] == {**RUNTIME_ENV, "requirements": None} and n["env_lock"] is None for n in nodes.values()
    )
    zero = nodes[0]
    url = f"/api/v1/agents/{zero['agent']}/allocations/{zero['allocation_id']}/environment"
    first = client.post(url, json={"lock": "phx-probe==1.0 --hash=sha256:aa\n"}, headers=as_agent(zero["agent"]))
    again = client.post(url, json={"lock": "phx-probe==1.0 --hash=sha256:bb\n"}, headers=as_agent(zero["agent"]))
    assert first.json() == again.json() == {"lock": "phx-probe==1.0 --hash=sha256:aa\n"}
    assert {n["env_lock"] for n in assignments(client, [n["agent"] for n in nodes.values()]).values()} == {
        "phx-probe==1.0 --hash=sha256:aa\n"
    }
    job = client.get(f"/api/v1/jobs/{zero['job_id']}", headers=USER).json()
    assert job["env_lock"] == "phx-probe==1.0 --hash=sha256:aa\n"

    # Only node rank 0's agent resolves; a lock too large or with a NUL is refused and changes nothing.
    one = nodes[1]
    other = f"/api/v1/agents/{one['agent']}/allocations/{one['allocation_id']}/environment"
    assert client.post(other, json={"lock": "x==1\n"}, headers=as_agent(one["agent"])).status_code in (404, 409)
    assert (
        client.post(url, json={"lock": "x" * (MAX_LOCK_CHARS + 1)}, headers=as_agent(zero["agent"])).status_code == 422
    )
    assert client.post(url, json={"lock": "x\x00"}, headers=as_agent(zero["agent"])).status_code == 422


def test_a_failed_environment_fails_the_job_without_a_restart(client: TestClient, settings: Settings) -> None:
    nodes = placed_job(client, settings)
    zero = nodes[0]
    exit_url = f"/api/v1/agents/{zero['agent']}/allocations/{zero['allocation_id']}/exit"
    body = {"node_rank": 0, "exit_code": 1, "reason": "phx-probe was not found", "cause": "environment"}
    assert client.post(exit_url, json=body, headers=as_agent(zero["agent"])).status_code == 204
    one = nodes[1]
    exit_one = f"/api/v1/agents/{one['agent']}/allocations/{one['allocation_id']}/exit"
    stopped = {"node_rank": 1, "exit_code": -15, "reason": "stopped before launch"}
    assert client.post(exit_one, json=stopped, headers=as_agent(one["agent"])).status_code == 204
    job = client.get(f"/api/v1/jobs/{zero['job_id']}", headers=USER).json()
    assert job["state"] == "FAILED" and job["restarts_used"] == 0 and job["attempts"] == 1
    assert "runtime environment failed on agent" in job["failure_reason"]
    assert "phx-probe was not found" in job["failure_reason"] and "not restarted" in job["failure_reason"]
    bad = {**body, "cause": "anything"}
    assert client.post(exit_url, json=bad, headers=as_agent(zero["agent"])).status_code == 422


def test_a_spec_with_a_url_requirement_is_refused_at_submit(client: TestClient) -> None:
    answer = submit(client, spec(runtime_env={"pip": ["evil @ https://example.com/evil.whl"]}))
    assert answer.status_code == 422 and "not a requirement this platform installs" in answer.text
