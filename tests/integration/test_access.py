"""The REST API asks the access rule the dashboard asks (tests/integration/test_dashboard.py shows
the pages): a user sees and changes only their own jobs and studies (another's answers 404, as an
unknown id does, and nothing changes); an admin all."""

from __future__ import annotations

import json

from fastapi.testclient import TestClient

from server.settings import Settings
from tests.integration.test_api import USER, spec, submit
from tests.integration.test_studies import study_body


def new_user(client: TestClient, name: str) -> dict[str, str]:
    created = client.post("/api/v1/tokens", json={"kind": "user", "name": name}, headers=USER)
    assert created.status_code == 201, created.text
    return {"Authorization": f"Bearer {created.json()['token']}"}


def test_another_users_job_answers_404_and_is_left_alone(client: TestClient, settings: Settings) -> None:
    alice, bob = new_user(client, "alice"), new_user(client, "bob")
    files = {"spec": (None, json.dumps(spec(resources={"nodes": 1})), "application/json")}
    job_id = client.post("/api/v1/jobs", files=files, headers=alice).json()["id"]
    mine = submit(client, spec(resources={"nodes": 1}), None)  # the admin's own
    assert mine.status_code == 201

    for method, path in [
        ("GET", f"/api/v1/jobs/{job_id}"),
        ("GET", f"/api/v1/jobs/{job_id}/logs"),
        ("GET", f"/api/v1/jobs/{job_id}/metrics"),
        ("GET", f"/api/v1/jobs/{job_id}/checkpoints"),
        ("GET", f"/api/v1/jobs/{job_id}/checkpoints/1/archive"),
        ("POST", f"/api/v1/jobs/{job_id}/kill"),
        ("POST", f"/api/v1/jobs/{job_id}/pause"),
        ("POST", f"/api/v1/jobs/{job_id}/resume"),
    ]:
        answer = client.request(method, path, headers=bob)
        assert answer.status_code == 404, (method, path, answer.text)
        assert f"There is no job {job_id} that you can see" in answer.json()["error"]
    assert client.get(f"/api/v1/jobs/{job_id}", headers=alice).json()["state"] == "QUEUED"  # untouched
    assert [j["id"] for j in client.get("/api/v1/jobs", headers=bob).json()] == []
    assert [j["id"] for j in client.get("/api/v1/jobs", headers=alice).json()] == [job_id]
    assert {j["id"] for j in client.get("/api/v1/jobs", headers=USER).json()} == {job_id, mine.json()["id"]}
    killed = client.post(f"/api/v1/jobs/{job_id}/kill", headers=USER)  # an admin may
    assert killed.status_code == 200 and killed.json()["state"] == "CANCELLED"


def test_another_users_study_answers_404(client: TestClient) -> None:
    alice, bob = new_user(client, "alice"), new_user(client, "bob")
    files = {"spec": (None, json.dumps(study_body()), "application/json")}
    created = client.post("/api/v1/studies", files=files, headers=alice)
    assert created.status_code == 201, created.text
    study_id = created.json()["id"]
    for method, path in [
        ("GET", f"/api/v1/studies/{study_id}"),
        ("GET", f"/api/v1/studies/{study_id}/best"),
        ("GET", f"/api/v1/studies/{study_id}/importance"),
        ("POST", f"/api/v1/studies/{study_id}/stop"),
        ("POST", f"/api/v1/studies/{study_id}/resume"),
    ]:
        answer = client.request(method, path, headers=bob)
        assert answer.status_code == 404, (method, path, answer.text)
    assert client.get(f"/api/v1/studies/{study_id}", headers=alice).json()["state"] == "RUNNING"
    assert client.get("/api/v1/studies", headers=bob).json() == []


def test_only_a_cluster_admin_drains_an_agent(client: TestClient) -> None:
    alice = new_user(client, "alice")
    agent_id = client.get("/api/v1/agents", headers=alice).json()[0]["id"]  # every user may list them
    refused = client.post(f"/api/v1/agents/{agent_id}/drain", headers=alice)
    assert refused.status_code == 403 and "cluster admin" in refused.json()["error"]
    assert client.get("/api/v1/agents", headers=USER).json()[0]["state"] == "ACTIVE"  # unchanged
    drained = client.post(f"/api/v1/agents/{agent_id}/drain", headers=USER)
    assert drained.status_code == 200 and drained.json()["state"] == "DRAINING"
    assert client.post(f"/api/v1/agents/{agent_id}/undrain", headers=alice).status_code == 403
    undrained = client.post(f"/api/v1/agents/{agent_id}/undrain", headers=USER)
    assert undrained.status_code == 200 and undrained.json()["state"] == "ACTIVE"
    again = client.post(f"/api/v1/agents/{agent_id}/undrain", headers=USER)
    assert again.status_code == 200 and again.json()["state"] == "ACTIVE"  # nothing to undo
