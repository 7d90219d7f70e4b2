"""What the OpenAPI fuzz (tests/e2e/test_fuzz_openapi.py) found answering 500, each pinned here:
text PostgreSQL cannot store (NUL) is refused with 422 naming the field, or, where a training
program printed it, stored with U+FFFD in its place."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from scheduler.service import schedule_pass
from server.db import session_scope
from server.settings import Settings
from tests.integration.test_api import AGENT, USER

NUL = "a\x00b"


@pytest.fixture
def allocation_id(client: TestClient, settings: Settings) -> int:
    """A placed one-node job's allocation, on the agent the client registered."""
    spec = '{"name": "j", "entrypoint": "python t.py"}'
    job_id = client.post("/api/v1/jobs", files={"spec": (None, spec)}, headers=USER).json()["id"]
    with session_scope(settings.database_url) as session:
        schedule_pass(session)
    return int(client.get(f"/api/v1/jobs/{job_id}", headers=USER).json()["allocations"][-1]["id"])


def metric_batch(**overrides: Any) -> dict[str, Any]:
    return {"records": [{"rank": 0, "step": 1, "time": 1.0, "values": {"loss": 0.5}}], **overrides}


@pytest.mark.parametrize(
    ("method", "path", "body", "field"),
    [
        ("POST", "/api/v1/agents/register", {"name": "b0", "address": NUL, "cpu_slots": 1}, "address"),
        ("GET", "/api/v1/jobs/1/metrics?name=a%00b", None, "query.name"),
        ("POST", "/api/v1/allocations/{a}/metrics", metric_batch(batch_id=NUL), "batch_id"),
        (
            "POST",
            "/api/v1/allocations/{a}/metrics",
            metric_batch(records=[{"rank": 0, "step": 1, "time": 1.0, "values": {NUL: 1.0}}]),
            "records.0.values",
        ),
        (
            "POST",
            "/api/v1/allocations/{a}/checkpoints",
            {"step": 1, "path": "p", "size_bytes": 1, "metrics": {NUL: 1.0}},
            "metrics",
        ),
    ],
)
def test_a_nul_where_text_is_stored_or_compared_answers_422(
    client: TestClient,
    allocation_id: int,
    method: str,
    path: str,
    body: Any,
    field: str,
) -> None:
    headers = USER if method == "GET" else AGENT
    answer = client.request(method, path.format(a=allocation_id), json=body, headers=headers)
    assert answer.status_code == 422, answer.text
    assert field in answer.json()["error"], answer.text


def test_a_printed_nul_is_stored_as_a_replacement_character(client: TestClient, allocation_id: int) -> None:
    logs = {"lines": [{"rank": 0, "time": 1.0, "line": f"loss {NUL}"}]}
    assert (
        client.post(f"/api/v1/agents/1/allocations/{allocation_id}/logs", json=logs, headers=AGENT).status_code == 204
    )
    exit_body = {"node_rank": 0, "exit_code": 1, "reason": f"rank 0 exited; its last stderr lines:\n{NUL}"}
    url = f"/api/v1/agents/1/allocations/{allocation_id}/exit"
    assert client.post(url, json=exit_body, headers=AGENT).status_code == 204
    job_id = client.get("/api/v1/jobs", headers=USER).json()[0]["id"]
    assert [line["line"] for line in client.get(f"/api/v1/jobs/{job_id}/logs", headers=USER).json()] == [
        "loss a\ufffdb"
    ]
    events = client.get(f"/api/v1/jobs/{job_id}", headers=USER).json()["events"]
    assert any("a\ufffdb" in event["reason"] for event in events), events
