"""Hostile input gets a clear 4xx and changes nothing: ids no row can have, out-of-range counts."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests.integration.test_api import AGENT, USER

PAST_INT32 = 2**31
PAST_INT64 = 2**63


@pytest.mark.parametrize(
    ("method", "path", "headers"),
    [
        ("GET", f"/api/v1/jobs/{PAST_INT32}", USER),
        ("GET", f"/api/v1/jobs/{PAST_INT32}/logs", USER),
        ("POST", f"/api/v1/jobs/{PAST_INT32}/kill", USER),
        ("GET", f"/api/v1/jobs/1/checkpoints/{PAST_INT64}/archive", USER),
        ("GET", f"/api/v1/studies/{PAST_INT32}", USER),
        ("POST", f"/api/v1/agents/{PAST_INT32}/heartbeat", AGENT),
        ("GET", f"/api/v1/agents/{PAST_INT32}/work", AGENT),
        ("GET", "/api/v1/jobs/0", USER),
        ("GET", "/api/v1/jobs/-1", USER),
        ("GET", "/api/v1/jobs/seven", USER),
    ],
)
def test_an_id_no_row_can_have_answers_404(client: TestClient, method: str, path: str, headers: dict[str, str]) -> None:
    answer = client.request(method, path, headers=headers)
    assert answer.status_code == 404, answer.text
    assert "no such row can exist" in answer.json()["error"]


def test_a_page_with_such_an_id_answers_404_too(client: TestClient) -> None:
    from tests.integration.test_dashboard import sign_in

    sign_in(client)
    answer = client.get(f"/jobs/{PAST_INT32}")
    assert answer.status_code == 404 and "text/html" in answer.headers["content-type"]


@pytest.mark.parametrize(
    "query",
    [f"offset={PAST_INT32}", "limit=0", "limit=1001"],
)
def test_out_of_range_counts_answer_422(client: TestClient, query: str) -> None:
    answer = client.get(f"/api/v1/jobs?{query}", headers=USER)
    assert answer.status_code == 422 and answer.json()["error"].startswith("invalid request: query.")


def test_a_huge_rank_or_cursor_answers_422_not_500(client: TestClient) -> None:
    job_id = client.post(
        "/api/v1/jobs",
        files={"spec": (None, '{"name": "j", "entrypoint": "python t.py"}', "application/json")},
        headers=USER,
    ).json()["id"]
    for query in (f"rank={PAST_INT32}", f"after={PAST_INT64}"):
        answer = client.get(f"/api/v1/jobs/{job_id}/logs?{query}", headers=USER)
        assert answer.status_code == 422, (query, answer.text)
