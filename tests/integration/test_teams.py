"""Teams on the real app and PostgreSQL: members read their team's jobs and studies, its admins act
on them and manage the members, everyone else gets 404; a job joins its submitter's team."""

from __future__ import annotations

import json
from typing import Any

from fastapi.testclient import TestClient

from server.settings import Settings
from tests.integration.test_access import new_user
from tests.integration.test_api import USER, spec
from tests.integration.test_dashboard import schedule, sign_in
from tests.integration.test_studies import study_body


def make_team(client: TestClient, name: str, **members: str) -> dict[str, Any]:
    created = client.post("/api/v1/teams", json={"name": name}, headers=USER)
    assert created.status_code == 201, created.text
    team: dict[str, Any] = created.json()
    for user, role in members.items():
        answer = client.put(f"/api/v1/teams/{name}/members/{user}", json={"role": role}, headers=USER)
        assert answer.status_code == 200, answer.text
        team = answer.json()
    return team


def submit_as(client: TestClient, headers: dict[str, str], **overrides: Any) -> Any:
    body = json.dumps(spec(resources={"nodes": 1}, **overrides))
    return client.post("/api/v1/jobs", files={"spec": (None, body, "application/json")}, headers=headers)


def test_members_read_the_teams_jobs_and_only_owners_and_team_admins_act(client: TestClient) -> None:
    lead, dev, dev2, outsider = (new_user(client, n) for n in ("lead", "dev", "dev2", "outsider"))
    team = make_team(client, "vision", lead="admin", dev="member", dev2="member")
    assert [(m["user"], m["role"]) for m in team["members"]] == [
        ("dev", "member"),
        ("dev2", "member"),
        ("lead", "admin"),
    ]

    job = submit_as(client, dev)  # dev's only team is the default
    assert job.status_code == 201 and job.json()["team"] == "vision", job.text
    job_id = job.json()["id"]

    for reader in (dev2, lead, USER):
        assert client.get(f"/api/v1/jobs/{job_id}", headers=reader).status_code == 200
        assert job_id in [j["id"] for j in client.get("/api/v1/jobs", headers=reader).json()]
    assert client.get(f"/api/v1/jobs/{job_id}/logs", headers=dev2).status_code == 200
    hidden = client.get(f"/api/v1/jobs/{job_id}", headers=outsider)
    assert hidden.status_code == 404 and client.get("/api/v1/jobs", headers=outsider).json() == []

    refused = client.post(f"/api/v1/jobs/{job_id}/kill", headers=dev2)  # a member reads, does not act
    assert refused.status_code == 403 and "an admin of its team" in refused.json()["error"]
    assert client.post(f"/api/v1/jobs/{job_id}/kill", headers=outsider).status_code == 404
    assert client.get(f"/api/v1/jobs/{job_id}", headers=dev).json()["state"] == "QUEUED"
    paused = client.post(f"/api/v1/jobs/{job_id}/pause", headers=lead)  # the team's admin acts
    assert paused.status_code == 200 and paused.json()["state"] == "PAUSED"
    assert client.post(f"/api/v1/jobs/{job_id}/resume", headers=dev).status_code == 200  # and so does its owner


def test_team_admins_manage_members_and_members_do_not(client: TestClient) -> None:
    lead, dev, _newcomer, outsider = (new_user(client, n) for n in ("lead", "dev", "newcomer", "outsider"))
    make_team(client, "nlp", lead="admin", dev="member")
    refused = client.put("/api/v1/teams/nlp/members/newcomer", json={"role": "member"}, headers=dev)
    assert refused.status_code == 403 and "only an admin of team 'nlp'" in refused.json()["error"]
    assert client.put("/api/v1/teams/nlp/members/newcomer", json={}, headers=outsider).status_code == 404
    added = client.put("/api/v1/teams/nlp/members/newcomer", json={"role": "member"}, headers=lead)
    assert added.status_code == 200 and "newcomer" in [m["user"] for m in added.json()["members"]]
    promoted = client.put("/api/v1/teams/nlp/members/dev", json={"role": "admin"}, headers=lead)
    assert {m["user"]: m["role"] for m in promoted.json()["members"]}["dev"] == "admin"
    removed = client.delete("/api/v1/teams/nlp/members/newcomer", headers=dev)
    assert removed.status_code == 200 and "newcomer" not in [m["user"] for m in removed.json()["members"]]
    assert client.delete("/api/v1/teams/nlp/members/newcomer", headers=dev).status_code == 404

    unknown = client.put("/api/v1/teams/nlp/members/nobody", json={"role": "member"}, headers=lead)
    assert unknown.status_code == 404 and "phalanx tokens create nobody" in unknown.json()["error"]
    assert client.post("/api/v1/teams", json={"name": "mine"}, headers=lead).status_code == 403  # cluster admins
    assert client.post("/api/v1/teams", json={"name": "nlp"}, headers=USER).status_code == 409
    assert client.put("/api/v1/teams/nlp/members/dev", json={"role": "owner"}, headers=lead).status_code == 422

    assert [t["name"] for t in client.get("/api/v1/teams", headers=dev).json()] == ["nlp"]
    assert client.get("/api/v1/teams", headers=outsider).json() == []
    assert client.get("/api/v1/teams/nlp", headers=outsider).status_code == 404
    assert client.get("/api/v1/teams/nlp", headers=dev).json()["your_role"] == "admin"


def test_the_team_of_a_new_job_is_named_or_the_only_one(client: TestClient) -> None:
    solo, multi = new_user(client, "solo"), new_user(client, "multi")
    personal = submit_as(client, solo)
    assert personal.status_code == 201 and personal.json()["team"] is None  # in no team: their own job
    make_team(client, "a", multi="member")
    make_team(client, "b", multi="member")
    ambiguous = submit_as(client, multi)
    assert ambiguous.status_code == 422 and "several teams (a, b)" in ambiguous.json()["error"]
    assert submit_as(client, multi, team="b").json()["team"] == "b"
    not_mine = submit_as(client, solo, team="b")
    assert not_mine.status_code == 422 and "not a member of team 'b'; your teams: none" in not_mine.json()["error"]
    assert submit_as(client, USER, team="a").json()["team"] == "a"  # a cluster admin submits into any team


def test_a_studys_trials_are_in_its_team(client: TestClient) -> None:
    owner, mate = new_user(client, "owner"), new_user(client, "mate")
    make_team(client, "tune", owner="member", mate="member")
    body = study_body()
    files = {"spec": (None, json.dumps(body), "application/json")}
    created = client.post("/api/v1/studies", files=files, headers=owner)
    assert created.status_code == 201 and created.json()["team"] == "tune", created.text
    study_id = created.json()["id"]
    assert client.get(f"/api/v1/studies/{study_id}", headers=mate).status_code == 200
    assert client.post(f"/api/v1/studies/{study_id}/stop", headers=mate).status_code == 403
    bad = {**body, "trial": {**body["trial"], "team": "tune"}}
    refused = client.post("/api/v1/studies", files={"spec": (None, json.dumps(bad), "application/json")}, headers=owner)
    assert refused.status_code == 422 and "trial.team is not used" in refused.text


def test_the_agents_page_names_only_the_jobs_a_user_may_read(client: TestClient, settings: Settings) -> None:
    make_team(client, "x")
    stranger = new_user(client, "stranger")
    job = submit_as(client, USER, team="x")
    assert job.status_code == 201
    schedule(settings)
    sign_in(client)
    assert f"job {job.json()['id']} (t)" in client.get("/agents").text
    client.cookies.clear()
    sign_in(client, stranger["Authorization"].removeprefix("Bearer "))
    hidden = client.get("/agents").text
    assert f"job {job.json()['id']}" not in hidden and "in use by another team" in hidden
