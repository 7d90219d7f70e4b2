"""A job's ranks hold their allocation's own credential, not the agent's token: it reports metrics
and checkpoints for that allocation and reaches nothing else."""

from __future__ import annotations

import time
from typing import Any

from fastapi.testclient import TestClient

from scheduler.service import schedule_pass
from server.db import session_scope
from server.settings import Settings
from tests.agent_tokens import as_agent
from tests.integration.test_api import USER, register, spec, submit


def placed(client: TestClient, settings: Settings, count: int) -> list[dict[str, Any]]:
    """`count` one-node jobs placed; each one's assignment as its agent sees it."""
    for _ in range(count):
        assert submit(client, spec(resources={"nodes": 1})).status_code == 201
    with session_scope(settings.database_url) as session:
        schedule_pass(session)
    assignments = []
    for agent in client.get("/api/v1/agents", headers=USER).json():
        assignments += client.get(f"/api/v1/agents/{agent['id']}/work", headers=as_agent(agent["id"])).json()[
            "assignments"
        ]
    assert len(assignments) == count
    return sorted(assignments, key=lambda a: a["allocation_id"])


def batch() -> dict[str, Any]:
    return {"records": [{"rank": 0, "step": 1, "time": time.time(), "values": {"loss": 0.5}}]}


def test_a_ranks_credential_reports_for_its_allocation_and_nothing_else(client: TestClient, settings: Settings) -> None:
    register(client, "n1", slots=1)
    mine, other = placed(client, settings, 2)
    token = {"Authorization": f"Bearer {mine['credential']}"}
    assert mine["credential"].startswith(f"phx_r_{mine['allocation_id']}_")
    assert mine["credential"] != other["credential"]

    ok = client.post(f"/api/v1/allocations/{mine['allocation_id']}/metrics", json=batch(), headers=token)
    assert ok.status_code == 204
    checkpoint = {"step": 1, "path": "file:///nowhere", "size_bytes": 1}
    # (its path is outside the job's storage: the credential was accepted, the body was not)
    url = f"/api/v1/allocations/{mine['allocation_id']}/checkpoints"
    assert client.post(url, json=checkpoint, headers=token).status_code == 422

    foreign = client.post(f"/api/v1/allocations/{other['allocation_id']}/metrics", json=batch(), headers=token)
    assert foreign.status_code == 403 and "belongs to allocation" in foreign.json()["error"]
    for method, path in [
        ("GET", "/api/v1/jobs"),
        ("GET", f"/api/v1/jobs/{mine['job_id']}"),
        ("POST", f"/api/v1/jobs/{other['job_id']}/kill"),
        ("GET", f"/api/v1/jobs/{other['job_id']}/bundle"),
        ("GET", "/api/v1/agents/1/work"),
        ("POST", "/api/v1/agents/1/heartbeat"),
        ("POST", "/api/v1/tokens"),
    ]:
        assert client.request(method, path, headers=token).status_code == 403, (method, path)
    register_as_rank = client.post(
        "/api/v1/agents/register", json={"name": "evil", "address": "127.0.0.1", "cpu_slots": 64}, headers=token
    )
    assert register_as_rank.status_code == 403


def test_a_forged_or_ended_credential(client: TestClient, settings: Settings) -> None:
    (mine,) = placed(client, settings, 1)
    forged = mine["credential"][:-4] + "AAAA"
    url = f"/api/v1/allocations/{mine['allocation_id']}/metrics"
    assert client.post(url, json=batch(), headers={"Authorization": f"Bearer {forged}"}).status_code == 401
    past = {"Authorization": f"Bearer phx_r_{2**40}_x"}
    assert client.post(url, json=batch(), headers=past).status_code == 401
    killed = client.post(f"/api/v1/jobs/{mine['job_id']}/kill", headers=USER)
    assert killed.status_code == 200
    ended = client.post(url, json=batch(), headers={"Authorization": f"Bearer {mine['credential']}"})
    assert ended.status_code == 409  # the allocation is no longer current: its ranks must stop
