"""On-demand profiles through the REST API on the real database: a user asks a placed job for one;
its ranks hear of it in the answers to their metric batches and send their traces (or why they
have none) with their attempt's own credential; the server summarises each trace, keeps the first
answer per rank, and serves the traces back. Whatever is not a trace, not theirs to send or not
the caller's to see is refused and changes nothing."""

from __future__ import annotations

import gzip
import json
import os
import time
from typing import Any

from fastapi.testclient import TestClient

from scheduler.service import schedule_pass
from server.app import create_app
from server.db import session_scope
from server.settings import Settings
from tests.agent_tokens import as_agent
from tests.integration.test_access import new_user
from tests.integration.test_api import USER, register, spec, submit

pytestmark = __import__("pytest").mark.integration


def trace(step_us: float = 100.0) -> bytes:
    """Two steps of a gloo rank: compute 0-60 % of each step, an all-reduce 40-90 %."""
    events = []
    for start in (0.0, step_us):
        events += [
            {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "tid": 1, "ts": start, "dur": step_us},
            {"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "tid": 1, "ts": start, "dur": 0.6 * step_us},
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": "gloo:all_reduce",
                "tid": 2,
                "ts": start + 0.4 * step_us,
                "dur": 0.5 * step_us,
            },
        ]
    return gzip.compress(json.dumps({"traceEvents": events}).encode())


def metric_batch() -> dict[str, Any]:
    return {"records": [{"rank": 0, "step": 1, "time": time.time(), "values": {"loss": 0.5}}]}


def placed_two_rank_jobs(client: TestClient, settings: Settings, count: int) -> list[dict[str, Any]]:
    """`count` placed jobs of two ranks on one node each; each one's assignment as its agent sees it."""
    for number in range(count):
        register(client, f"n{number}", slots=2)
        assert submit(client, spec(resources={"nodes": 1, "slots_per_node": 2})).status_code == 201
        with session_scope(settings.database_url) as session:
            schedule_pass(session)
    assignments = []
    for agent in client.get("/api/v1/agents", headers=USER).json():
        work = client.get(f"/api/v1/agents/{agent['id']}/work", headers=as_agent(agent["id"])).json()
        assignments += work["assignments"]
    assert len(assignments) == count
    return sorted(assignments, key=lambda a: a["allocation_id"])


def two_rank_job(client: TestClient, settings: Settings) -> tuple[int, int, dict[str, str]]:
    """A placed job of two ranks: its id, its allocation and its ranks' credential."""
    mine = placed_two_rank_jobs(client, settings, 1)[0]
    return mine["job_id"], mine["allocation_id"], {"Authorization": f"Bearer {mine['credential']}"}


def put_trace(client: TestClient, allocation: int, profile: int, rank: int, body: bytes, token: dict[str, str]) -> Any:
    url = f"/api/v1/allocations/{allocation}/profiles/{profile}/ranks/{rank}"
    return client.put(url, content=body, headers={**token, "Content-Type": "application/gzip"})


def test_a_profile_is_asked_for_heard_by_the_ranks_answered_once_per_rank_and_served(
    client: TestClient, settings: Settings
) -> None:
    job_id, allocation, rank_token = two_rank_job(client, settings)
    quiet = client.post(f"/api/v1/allocations/{allocation}/metrics", json=metric_batch(), headers=rank_token)
    assert quiet.status_code == 204  # nothing asked yet

    asked = client.post(f"/api/v1/jobs/{job_id}/profiles", json={"steps": 7}, headers=USER)
    assert asked.status_code == 201, asked.text
    profile = asked.json()
    assert (profile["state"], profile["steps"], profile["world_size"], profile["ranks"]) == ("recording", 7, 2, [])
    again = client.post(f"/api/v1/jobs/{job_id}/profiles", json={"steps": 7}, headers=USER)
    assert again.status_code == 409 and f"profile {profile['id']} of job {job_id} is still recording" in again.text

    heard = client.post(f"/api/v1/allocations/{allocation}/metrics", json=metric_batch(), headers=rank_token)
    assert heard.status_code == 200 and heard.json() == {"profile": {"id": profile["id"], "steps": 7}}

    first = trace(100.0)
    assert put_trace(client, allocation, profile["id"], 0, first, rank_token).status_code == 204
    # a resend with other bytes changes nothing: the first answer stands
    assert put_trace(client, allocation, profile["id"], 0, trace(500.0), rank_token).status_code == 204
    failure = client.put(
        f"/api/v1/allocations/{allocation}/profiles/{profile['id']}/ranks/1",
        json={"message": "torch.profiler could not start on this rank: already enabled"},
        headers=rank_token,
    )
    assert failure.status_code == 204

    shown = client.get(f"/api/v1/jobs/{job_id}/profiles/{profile['id']}", headers=USER).json()
    assert shown["state"] == "complete"
    rank0, rank1 = shown["ranks"]
    assert rank0["size_bytes"] == len(first) and rank0["error"] is None
    summary = rank0["summary"]
    assert summary["device"] == "cpu" and summary["steps"] == 2
    assert abs(summary["step_time_s"] - 100e-6) < 1e-9
    assert abs(summary["overlap_s"] - 20e-6) < 1e-9 and abs(summary["exposed_comm_s"] - 30e-6) < 1e-9
    assert rank1["summary"] is None and "already enabled" in rank1["error"]
    assert abs(shown["comm_fraction"] - 0.3) < 1e-6 and shown["slowest_rank"] == 0

    served = client.get(f"/api/v1/jobs/{job_id}/profiles/{profile['id']}/ranks/0/trace", headers=USER)
    assert served.status_code == 200 and served.content == first
    assert f"job-{job_id}-profile-{profile['id']}-rank-0.json.gz" in served.headers["content-disposition"]
    none = client.get(f"/api/v1/jobs/{job_id}/profiles/{profile['id']}/ranks/1/trace", headers=USER)
    assert none.status_code == 404 and "already enabled" in none.json()["error"]

    # every rank answered: the request is withdrawn from the batches' answers, and another may be asked
    after = client.post(f"/api/v1/allocations/{allocation}/metrics", json=metric_batch(), headers=rank_token)
    assert after.status_code == 204
    detail = client.get(f"/api/v1/jobs/{job_id}", headers=USER).json()
    assert [p["id"] for p in detail["profiles"]] == [profile["id"]]
    assert client.post(f"/api/v1/jobs/{job_id}/profiles", json={}, headers=USER).status_code == 201


def test_what_is_not_a_trace_or_not_theirs_is_refused_and_changes_nothing(
    client: TestClient, settings: Settings
) -> None:
    mine, other = placed_two_rank_jobs(client, settings, 2)
    token = {"Authorization": f"Bearer {mine['credential']}"}
    foreign = {"Authorization": f"Bearer {other['credential']}"}
    profile = client.post(f"/api/v1/jobs/{mine['job_id']}/profiles", json={"steps": 3}, headers=USER).json()
    allocation, pid = mine["allocation_id"], profile["id"]

    refusals = [
        (put_trace(client, allocation, pid, 0, b"\x1f\x8b not really gzip", token), 422, "not a gzipped Chrome trace"),
        (put_trace(client, allocation, pid, 0, gzip.compress(b'{"traceEvents": []}'), token), 422, "no timed events"),
        (put_trace(client, allocation, pid, 2, trace(), token), 422, "rank 2 is not in this attempt"),
        (put_trace(client, allocation, pid, 0, trace(), foreign), 403, "belongs to allocation"),
        (put_trace(client, other["allocation_id"], pid, 0, trace(), foreign), 404, "was asked for no profile"),
        (
            client.put(
                f"/api/v1/allocations/{allocation}/profiles/{pid}/ranks/0",
                content=trace(),
                headers={**token, "Content-Type": "text/plain"},
            ),
            422,
            "send the trace as application/gzip",
        ),
        (
            client.put(f"/api/v1/allocations/{allocation}/profiles/{pid}/ranks/0", json={"message": ""}, headers=token),
            422,
            "message",
        ),
        (client.post(f"/api/v1/jobs/{mine['job_id']}/profiles", json={"steps": 0}, headers=USER), 422, "steps"),
        (client.post(f"/api/v1/jobs/{mine['job_id']}/profiles", json={"steps": 10_000}, headers=USER), 422, "steps"),
        (client.get(f"/api/v1/jobs/{mine['job_id']}/profiles/999999", headers=USER), 404, "has no profile 999999"),
        (client.get(f"/api/v1/jobs/{other['job_id']}/profiles/{pid}", headers=USER), 404, "has no profile"),
    ]
    for answer, status, says in refusals:
        assert answer.status_code == status, (status, answer.text)
        assert says in answer.text, (says, answer.text)
    shown = client.get(f"/api/v1/jobs/{mine['job_id']}/profiles/{pid}", headers=USER).json()
    assert (shown["state"], shown["ranks"]) == ("recording", [])
    assert not any((settings.data_dir / "profiles").rglob("*.json.gz"))


def test_another_user_neither_sees_nor_asks_for_a_profile_of_a_job_they_cannot_read(
    client: TestClient, settings: Settings
) -> None:
    job_id, _, _ = two_rank_job(client, settings)
    profile = client.post(f"/api/v1/jobs/{job_id}/profiles", json={}, headers=USER).json()
    bob = new_user(client, "bob")
    for method, path in [
        ("POST", f"/api/v1/jobs/{job_id}/profiles"),
        ("GET", f"/api/v1/jobs/{job_id}/profiles"),
        ("GET", f"/api/v1/jobs/{job_id}/profiles/{profile['id']}"),
        ("GET", f"/api/v1/jobs/{job_id}/profiles/{profile['id']}/ranks/0/trace"),
        ("DELETE", f"/api/v1/jobs/{job_id}/profiles/{profile['id']}"),
    ]:
        answer = client.request(method, path, headers=bob, json={} if method == "POST" else None)
        assert answer.status_code == 404, (method, path, answer.text)
    assert client.get(f"/api/v1/jobs/{job_id}/profiles", headers=USER).json()[0]["state"] == "recording"


def test_a_queued_job_has_no_attempt_to_profile(client: TestClient, settings: Settings) -> None:
    files = {"spec": (None, json.dumps({"name": "t", "entrypoint": "python t.py"}), "application/json")}
    job_id = client.post("/api/v1/jobs", files=files, headers=USER).json()["id"]
    refused = client.post(f"/api/v1/jobs/{job_id}/profiles", json={}, headers=USER)
    assert refused.status_code == 409 and "a profile records a running attempt" in refused.json()["error"]


def test_a_job_keeps_its_newest_profiles_and_deleting_one_withdraws_its_request(
    client: TestClient, settings: Settings
) -> None:
    job_id, allocation, token = two_rank_job(client, settings)
    ids = []
    for _ in range(6):
        profile = client.post(f"/api/v1/jobs/{job_id}/profiles", json={"steps": 2}, headers=USER).json()
        ids.append(profile["id"])
        for rank in (0, 1):
            assert put_trace(client, allocation, profile["id"], rank, trace(), token).status_code == 204
    folders = settings.data_dir / "profiles" / str(job_id)
    kept = [p["id"] for p in client.get(f"/api/v1/jobs/{job_id}/profiles", headers=USER).json()]
    assert kept == ids[:0:-1]  # the newest five, newest first
    assert sorted(int(p.name) for p in folders.iterdir()) == ids[1:]

    pending = client.post(f"/api/v1/jobs/{job_id}/profiles", json={}, headers=USER).json()
    assert (
        client.post(f"/api/v1/allocations/{allocation}/metrics", json=metric_batch(), headers=token).status_code == 200
    )
    assert client.delete(f"/api/v1/jobs/{job_id}/profiles/{ids[-1]}", headers=USER).status_code == 204
    assert client.delete(f"/api/v1/jobs/{job_id}/profiles/{pending['id']}", headers=USER).status_code == 204
    assert (
        client.post(f"/api/v1/allocations/{allocation}/metrics", json=metric_batch(), headers=token).status_code == 204
    )
    # the request pushed out the oldest; the deleted ones are gone with their files
    assert [p["id"] for p in client.get(f"/api/v1/jobs/{job_id}/profiles", headers=USER).json()] == ids[-2:1:-1]
    assert sorted(int(p.name) for p in folders.iterdir()) == ids[2:-1]


def test_a_trace_over_the_cap_is_refused_while_it_streams(settings: Settings) -> None:
    capped = settings.model_copy(update={"max_profile_trace_bytes": 2048})
    with TestClient(create_app(capped)) as client:
        job_id, allocation, token = two_rank_job(client, capped)
        profile = client.post(f"/api/v1/jobs/{job_id}/profiles", json={}, headers=USER).json()
        big = os.urandom(4096)
        refused = put_trace(client, allocation, profile["id"], 0, big, token)
        assert refused.status_code == 413 and "2,048 bytes" in refused.json()["error"]
        assert client.get(f"/api/v1/jobs/{job_id}/profiles/{profile['id']}", headers=USER).json()["ranks"] == []
