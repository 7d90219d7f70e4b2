"""What answered 500 under the OpenAPI fuzz (tests/e2e/test_fuzz_openapi.py) and the hand probes
beside it, each pinned here: text PostgreSQL cannot store (NUL) is refused with 422 naming the
field, or, where a training program printed it, stored with U+FFFD in its place; a spec number JSON
cannot hold (Infinity, NaN), or a float step too fine to count, is refused with 422 and nothing is
stored."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from scheduler.service import schedule_pass
from server.db import session_scope
from server.models import Job, TuningStudy
from server.settings import Settings
from tests.agent_tokens import CLUSTER_AGENT, as_agent, as_rank
from tests.integration.test_api import USER

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
    if method == "GET":
        headers = USER
    elif "register" in path:
        headers = CLUSTER_AGENT
    else:
        headers = as_rank(client, allocation_id)  # who posts metrics and checkpoints
    answer = client.request(method, path.format(a=allocation_id), json=body, headers=headers)
    assert answer.status_code == 422, answer.text
    assert field in answer.json()["error"], answer.text


def test_a_printed_nul_is_stored_as_a_replacement_character(client: TestClient, allocation_id: int) -> None:
    logs = {"lines": [{"rank": 0, "time": 1.0, "line": f"loss {NUL}"}]}
    assert (
        client.post(f"/api/v1/agents/1/allocations/{allocation_id}/logs", json=logs, headers=as_agent(1)).status_code
        == 204
    )
    exit_body = {"node_rank": 0, "exit_code": 1, "reason": f"rank 0 exited; its last stderr lines:\n{NUL}"}
    url = f"/api/v1/agents/1/allocations/{allocation_id}/exit"
    assert client.post(url, json=exit_body, headers=as_agent(1)).status_code == 204
    job_id = client.get("/api/v1/jobs", headers=USER).json()[0]["id"]
    assert [line["line"] for line in client.get(f"/api/v1/jobs/{job_id}/logs", headers=USER).json()] == [
        "loss a\ufffdb"
    ]
    events = client.get(f"/api/v1/jobs/{job_id}", headers=USER).json()["events"]
    assert any("a\ufffdb" in event["reason"] for event in events), events


JOB = '{"name": "j", "entrypoint": "python t.py", %s}'
STUDY = (
    '{"name": "s", "objective": {"metric": "loss"}, "n_trials": 2, "trial": {"entrypoint": "python t.py"},'
    ' "search_space": {"x": %s}, %s}'
)
FLOAT_PARAM = '{"type": "float", "low": 0.0, "high": 1.0}'


@pytest.mark.parametrize(
    ("path", "spec", "field"),
    [
        ("/api/v1/jobs", JOB % '"hang_timeout": Infinity', "hang_timeout: Input should be a finite number"),
        ("/api/v1/studies", STUDY % (FLOAT_PARAM, '"target_value": NaN'), "target_value"),
        ("/api/v1/studies", STUDY % (FLOAT_PARAM, '"timeout": Infinity'), "timeout"),
        ("/api/v1/studies", STUDY % ('{"type": "float", "low": -Infinity, "high": 1.0}', '"n_trials": 2'), "low"),
        ("/api/v1/studies", STUDY % ('{"type": "categorical", "choices": [NaN, 1]}', '"n_trials": 2'), "choices"),
        (
            "/api/v1/studies",
            STUDY % ('{"type": "float", "low": 0, "high": 1e308, "step": 1e-308}', '"n_trials": 2'),
            "is not a multiple of step",
        ),
    ],
)
def test_a_spec_number_json_cannot_hold_answers_422_and_stores_nothing(
    client: TestClient, settings: Settings, path: str, spec: str, field: str
) -> None:
    answer = client.post(path, files={"spec": (None, spec)}, headers=USER)
    assert answer.status_code == 422 and field in answer.json()["error"], answer.text
    with session_scope(settings.database_url) as session:
        assert session.scalar(select(func.count()).select_from(Job)) == 0
        assert session.scalar(select(func.count()).select_from(TuningStudy)) == 0
