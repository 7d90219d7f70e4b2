"""Hostile input gets a clear 4xx and changes nothing: ids no row can have, out-of-range counts,
metric batches and agent reports the database could not store."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from scheduler.service import schedule_pass
from server.checkpoints import delete_marked
from server.db import session_scope
from server.models import Allocation, Checkpoint, Job, Metric
from server.settings import Settings
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


@pytest.fixture
def allocation_id(client: TestClient, settings: Settings) -> int:
    """A placed one-node job's allocation."""
    submitted = client.post(
        "/api/v1/jobs",
        files={"spec": (None, '{"name": "j", "entrypoint": "python t.py"}', "application/json")},
        headers=USER,
    )
    with session_scope(settings.database_url) as session:
        schedule_pass(session)
    detail = client.get(f"/api/v1/jobs/{submitted.json()['id']}", headers=USER).json()
    return int(detail["allocations"][-1]["id"])


def record(**overrides: Any) -> dict[str, Any]:
    return {"rank": 0, "step": 1, "time": 1.0, "values": {"loss": 0.5}, **overrides}


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        ('{"records": [{"rank": 0, "step": 1, "time": 1.0, "values": {"loss": NaN}}]}', "finite"),
        ('{"records": [{"rank": 0, "step": 1, "time": 1.0, "values": {"loss": Infinity}}]}', "finite"),
        (json.dumps({"records": [record(values={"x" * 200: 1.0})]}), "at most 128 characters"),
        (json.dumps({"records": [record(step=2**63)]}), "less than or equal"),
        (json.dumps({"records": [record(rank=2**31)]}), "less than or equal"),
        (json.dumps({"records": [record(time=1e300)]}), "less than or equal"),
        (json.dumps({"records": [record(values={"": 1.0})]}), "at least 1 character"),
    ],
)
def test_a_bad_metric_batch_answers_422_and_stores_nothing(
    client: TestClient, settings: Settings, allocation_id: int, raw: str, problem: str
) -> None:
    answer = client.post(
        f"/api/v1/allocations/{allocation_id}/metrics",
        content=raw,
        headers={**AGENT, "Content-Type": "application/json"},
    )
    assert answer.status_code == 422 and problem in answer.text, answer.text
    with session_scope(settings.database_url) as session:
        assert session.scalar(select(func.count()).select_from(Metric)) == 0


def test_checkpoint_metrics_and_node_reports_are_bounded(client: TestClient, allocation_id: int) -> None:
    commit = {"step": 1, "path": "file:///x/job-1/step-1", "size_bytes": 1, "metrics": {"loss": "NaN"}}
    answer = client.post(f"/api/v1/allocations/{allocation_id}/checkpoints", json=commit, headers=AGENT)
    assert answer.status_code == 422, answer.text
    exit_body = {"node_rank": 0, "exit_code": 2**40, "reason": ""}
    answer = client.post(f"/api/v1/agents/1/allocations/{allocation_id}/exit", json=exit_body, headers=AGENT)
    assert answer.status_code == 422, answer.text


@pytest.mark.parametrize("storage", ["file:///etc", "http://example.com/ckpt", "memory://x", "ftp://host/x"])
def test_checkpoint_storage_outside_the_allowed_roots_is_refused_at_submit(
    client: TestClient, settings: Settings, storage: str
) -> None:
    spec = {"name": "j", "entrypoint": "python t.py", "checkpoint": {"storage": storage}}
    answer = client.post("/api/v1/jobs", files={"spec": (None, json.dumps(spec))}, headers=USER)
    assert answer.status_code == 422 and "checkpoint.storage" in answer.json()["error"], answer.text
    with session_scope(settings.database_url) as session:
        assert session.scalar(select(func.count()).select_from(Job)) == 0


def test_a_sub_path_of_the_default_root_is_accepted(client: TestClient, settings: Settings) -> None:
    spec = {"name": "j", "entrypoint": "python t.py", "checkpoint": {"storage": f"{settings.checkpoint_uri}/team-a"}}
    assert client.post("/api/v1/jobs", files={"spec": (None, json.dumps(spec))}, headers=USER).status_code == 201


def job_root(client: TestClient, settings: Settings) -> Path:
    job_id = client.get("/api/v1/jobs", headers=USER).json()[0]["id"]
    return Path(settings.checkpoint_uri.removeprefix("file://")) / f"job-{job_id}"


def test_a_committed_path_that_climbs_out_of_the_job_is_refused(
    client: TestClient, settings: Settings, allocation_id: int
) -> None:
    root = job_root(client, settings)
    for path in (f"file://{root}/../../../etc", f"file://{root}/../job-999/step-1", f"file://{root}-evil/step-1"):
        body = {"step": 1, "path": path, "size_bytes": 1}
        answer = client.post(f"/api/v1/allocations/{allocation_id}/checkpoints", json=body, headers=AGENT)
        assert answer.status_code == 422 and "outside this job's storage" in answer.json()["error"], path


def test_an_archive_never_follows_a_symlink_out_of_the_checkpoint(
    client: TestClient, settings: Settings, allocation_id: int, tmp_path: Path
) -> None:
    root = job_root(client, settings)
    folder = root / "step-1"
    folder.mkdir(parents=True)
    (folder / "state.pt").write_bytes(b"weights")
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the job's owner")
    (folder / "leak").symlink_to(secret)
    body = {"step": 1, "path": f"file://{folder}", "size_bytes": 7}
    assert client.post(f"/api/v1/allocations/{allocation_id}/checkpoints", json=body, headers=AGENT).status_code == 201
    job_id = client.get("/api/v1/jobs", headers=USER).json()[0]["id"]
    archive = client.get(f"/api/v1/jobs/{job_id}/checkpoints/1/archive", headers=USER)
    assert archive.status_code == 200
    with tarfile.open(fileobj=io.BytesIO(archive.content), mode="r:gz") as tar:
        assert tar.getnames() == ["state.pt"]


def test_retention_goes_on_past_a_row_it_cannot_delete(settings: Settings, allocation_id: int, tmp_path: Path) -> None:
    gone = tmp_path / "gone"
    gone.mkdir()
    with session_scope(settings.database_url) as session:
        allocation = session.get(Allocation, allocation_id)
        assert allocation is not None
        for step, path in ((1, "no-such-protocol://x/y"), (2, f"file://{gone}")):
            session.add(
                Checkpoint(
                    job_id=allocation.job_id,
                    allocation_id=allocation_id,
                    attempt=1,
                    step=step,
                    metrics={},
                    size_bytes=1,
                    path=path,
                    state="DELETING",
                )
            )
    with session_scope(settings.database_url) as session:
        assert delete_marked(session, allocation.job_id) == 1  # the good row; the bad one stays, logged
    assert not gone.exists()
    with session_scope(settings.database_url) as session:
        assert session.scalars(select(Checkpoint.path)).all() == ["no-such-protocol://x/y"]


def test_every_page_forbids_inline_script_and_framing(client: TestClient) -> None:
    from tests.integration.test_dashboard import sign_in

    sign_in(client)
    job_id = client.post(
        "/api/v1/jobs",
        files={"spec": (None, '{"name": "j", "entrypoint": "python t.py"}', "application/json")},
        headers=USER,
    ).json()["id"]
    pages = ("/overview", "/jobs", f"/jobs/{job_id}", "/agents", "/studies", "/submit", "/docs", "/redoc")
    for path in (*pages, "/api/v1/jobs"):
        answer = client.get(path, headers=USER if path.startswith("/api/") else {})
        policy = answer.headers["content-security-policy"]
        assert "script-src 'self';" in policy and "frame-ancestors 'none'" in policy, path
        assert answer.headers["x-content-type-options"] == "nosniff" and answer.headers["x-frame-options"] == "DENY"
        assert "onsubmit=" not in answer.text and "onclick=" not in answer.text, path
        assert "<script>" not in answer.text and "cdn." not in answer.text, path
