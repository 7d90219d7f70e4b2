"""The REST API on a real PostgreSQL: auth, the job path from submit to COMPLETED, bad input."""

from __future__ import annotations

import gzip
import io
import json
import math
import tarfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import psycopg
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select, text, update

from scheduler.service import reap_pass, schedule_pass
from server.app import create_app
from server.db import SchemaOutOfDate, engine_for, session_scope
from server.models import Agent, ControlPlane, Job, Metric
from server.settings import Settings
from tests.agent_tokens import CLUSTER_AGENT, as_agent, as_rank, register_agent
from tests.conftest import ADMIN_TOKEN, AGENT_TOKEN, PG_ADMIN
from tests.processes import wait_for

pytestmark = pytest.mark.integration
USER = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
AGENT = {"Authorization": f"Bearer {AGENT_TOKEN}"}


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as test_client:
        yield test_client


def spec(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"name": "t", "entrypoint": "python train.py", "resources": {"nodes": 2}}
    base.update(overrides)
    return base


def bundle_bytes() -> bytes:
    """A one-file code bundle, the same bytes on every call (gzip's header time fixed at 0)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        data = b"print('hello')\n"
        info = tarfile.TarInfo("./train.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return gzip.compress(buffer.getvalue(), mtime=0)


def submit(client: TestClient, body: dict[str, Any], bundle: bytes | None = None) -> Any:
    files: dict[str, Any] = {"spec": (None, json.dumps(body), "application/json")}
    if bundle is not None:
        files["bundle"] = ("b.tar.gz", bundle, "application/gzip")
    return client.post("/api/v1/jobs", files=files, headers=USER)


def register(client: TestClient, name: str, slots: int = 1) -> int:
    return register_agent(client, name, slots)


def count(settings: Settings, model: type[Any]) -> int:
    with session_scope(settings.database_url) as session:
        return int(session.execute(select(func.count()).select_from(model)).scalar_one())


def schedule(settings: Settings) -> set[int]:
    with session_scope(settings.database_url) as session:
        return schedule_pass(session)


def test_every_api_route_needs_a_token(client: TestClient) -> None:
    for method, path in [("GET", "/api/v1/jobs"), ("GET", "/api/v1/agents"), ("POST", "/api/v1/jobs")]:
        response = client.request(method, path)
        assert response.status_code == 401
        assert "PHALANX_TOKEN" in response.json()["error"]
    bad = client.get("/api/v1/jobs", headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401 and "not valid" in bad.json()["error"]
    # user and agent tokens are not interchangeable
    assert client.get("/api/v1/jobs", headers=AGENT).status_code == 403
    wrong_kind = client.post(
        "/api/v1/agents/register", json={"name": "a", "address": "x", "cpu_slots": 1}, headers=USER
    )
    assert wrong_kind.status_code == 403 and "agent token" in wrong_kind.json()["error"]
    # open routes
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/docs").status_code == 200
    # Prometheus needs a user's token (a scraper sends it as a bearer token)
    assert client.get("/metrics").status_code == 401
    assert "phalanx_jobs" in client.get("/metrics", headers=USER).text


def test_admin_mints_tokens_that_work(client: TestClient) -> None:
    created = client.post("/api/v1/tokens", json={"kind": "user", "name": "alice"}, headers=USER)
    assert created.status_code == 201
    alice = {"Authorization": f"Bearer {created.json()['token']}"}
    assert client.get("/api/v1/jobs", headers=alice).status_code == 200
    # alice is no admin
    assert client.post("/api/v1/tokens", json={"kind": "user", "name": "bob"}, headers=alice).status_code == 403
    agent = client.post("/api/v1/tokens", json={"kind": "agent", "name": "rack-2"}, headers=USER).json()
    response = client.post(
        "/api/v1/agents/register",
        json={"name": "n1", "address": "10.0.0.1", "cpu_slots": 2},
        headers={"Authorization": f"Bearer {agent['token']}"},
    )
    assert response.status_code == 200


def test_bad_input_is_rejected_and_changes_nothing(client: TestClient, settings: Settings) -> None:
    register(client, "a0")
    register(client, "a1")
    before = count(settings, Job)

    not_json = client.post("/api/v1/jobs", files={"spec": (None, "{nope", "application/json")}, headers=USER)
    assert not_json.status_code == 422 and "invalid job spec" in not_json.json()["error"]

    bad_field = submit(client, spec(resources={"nodes": 0}))
    assert bad_field.status_code == 422
    assert "resources.nodes" in bad_field.json()["error"]

    never = submit(client, spec(resources={"nodes": 3}))
    assert never.status_code == 422
    assert "can never be placed" in never.json()["error"]

    too_wide = submit(client, spec(resources={"nodes": 1, "slots_per_node": 2}))
    assert too_wide.status_code == 422

    assert client.get("/api/v1/jobs/999", headers=USER).status_code == 404
    assert client.post("/api/v1/jobs/999/kill", headers=USER).status_code == 404
    assert client.get("/api/v1/jobs/999/logs", headers=USER).status_code == 404
    assert count(settings, Job) == before


def test_oversized_payloads_get_413(settings: Settings) -> None:
    small = settings.model_copy(update={"max_bundle_bytes": 1000, "max_metric_batch_bytes": 500})
    with TestClient(create_app(small)) as client:
        register(client, "a0")
        register(client, "a1")
        big = submit(client, spec(), bundle=b"x" * 5000)
        assert big.status_code == 413 and "cap" in big.json()["error"]
        assert count(settings, Job) == 0
        assert not list(small.bundle_dir.glob("*.part"))
        response = client.post(
            "/api/v1/allocations/1/metrics",
            content=json.dumps(
                {"records": [{"rank": 0, "step": i, "time": 0.0, "values": {"x": 1}} for i in range(50)]}
            ),
            headers=CLUSTER_AGENT,
        )
        assert response.status_code == 413


def test_job_runs_from_submit_to_completed(client: TestClient, settings: Settings) -> None:
    a0, a1 = register(client, "a0"), register(client, "a1")
    created = submit(client, spec(hyperparameters={"lr": 0.1}), bundle=bundle_bytes())
    assert created.status_code == 201, created.text
    job_id = created.json()["id"]
    assert created.json()["state"] == "QUEUED"

    assert schedule(settings) == {a0, a1}
    shown = client.get(f"/api/v1/jobs/{job_id}", headers=USER).json()
    assert shown["state"] == "SCHEDULED"
    (allocation,) = shown["allocations"]
    ranks = {n["node_rank"]: n["agent_id"] for n in allocation["nodes"]}
    assert set(ranks) == {0, 1} and set(ranks.values()) == {a0, a1}
    alloc_id = allocation["id"]
    head, other = ranks[0], ranks[1]

    # agents see their assignment; the bundle downloads
    work = client.get(f"/api/v1/agents/{head}/work", headers=as_agent(head)).json()
    (assignment,) = work["assignments"]
    assert assignment["node_rank"] == 0 and assignment["master_port"] is None
    assert assignment["hyperparameters"] == {"lr": 0.1} and assignment["nnodes"] == 2
    assert client.get(f"/api/v1/jobs/{job_id}/bundle", headers=as_agent(head)).content == bundle_bytes()

    # an unchanged version long-polls until the timeout; a change answers at once
    started = time.monotonic()
    same = client.get(
        f"/api/v1/agents/{other}/work", params={"version": "x", "wait": 0}, headers=as_agent(other)
    ).json()
    unchanged = client.get(
        f"/api/v1/agents/{other}/work", params={"version": same["version"], "wait": 0.5}, headers=as_agent(other)
    ).json()
    assert unchanged["version"] == same["version"] and time.monotonic() - started >= 0.5

    # only rank 0's agent sets the rendezvous; the other agent may not report for it
    url = f"/api/v1/agents/{{agent}}/allocations/{alloc_id}"
    assert (
        client.post(
            url.format(agent=other) + "/rendezvous", json={"master_port": 1234}, headers=as_agent(other)
        ).status_code
        == 409
    )
    assert (
        client.post(
            url.format(agent=head) + "/rendezvous", json={"master_port": 29600}, headers=as_agent(head)
        ).status_code
        == 204
    )
    assignment = client.get(f"/api/v1/agents/{other}/work", headers=as_agent(other)).json()["assignments"][0]
    assert assignment["master_port"] == 29600

    for agent, rank in ((head, 0), (other, 1)):
        assert (
            client.post(
                url.format(agent=agent) + "/started", json={"node_rank": rank}, headers=as_agent(agent)
            ).status_code
            == 204
        )
    assert client.get(f"/api/v1/jobs/{job_id}", headers=USER).json()["state"] == "RUNNING"

    # an agent may not report a node that is not its own
    wrong = client.post(
        url.format(agent=other) + "/exit", json={"node_rank": 0, "exit_code": 0}, headers=as_agent(other)
    )
    assert wrong.status_code == 409 and "belongs to agent" in wrong.json()["error"]

    records = [
        {"rank": r, "step": s, "time": time.time(), "values": {"loss": 1.0 / (s + 1)}} for r in (0, 1) for s in range(5)
    ]
    posted = client.post(
        f"/api/v1/allocations/{alloc_id}/metrics", json={"records": records}, headers=as_rank(client, alloc_id)
    )
    assert posted.status_code == 204
    lines = {"lines": [{"rank": 1, "stream": "stdout", "time": time.time(), "line": "hello from 1"}]}
    assert client.post(url.format(agent=other) + "/logs", json=lines, headers=as_agent(other)).status_code == 204

    listed = client.get("/api/v1/jobs", headers=USER).json()
    assert listed[0]["latest_metrics"] == {"loss": pytest.approx(0.2)} and listed[0]["latest_step"] == 4
    assert len(client.get(f"/api/v1/jobs/{job_id}/metrics", headers=USER).json()) == 10
    logs = client.get(f"/api/v1/jobs/{job_id}/logs", params={"rank": 1}, headers=USER).json()
    assert [line["line"] for line in logs] == ["hello from 1"]

    for agent, rank in ((head, 0), (other, 1)):
        response = client.post(
            url.format(agent=agent) + "/exit", json={"node_rank": rank, "exit_code": 0}, headers=as_agent(agent)
        )
        assert response.status_code == 204
    final = client.get(f"/api/v1/jobs/{job_id}", headers=USER).json()
    assert final["state"] == "COMPLETED"
    assert [e["to_state"] for e in final["events"]] == ["SCHEDULED", "RUNNING", "COMPLETED"]
    assert client.get("/api/v1/agents", headers=USER).json()[0]["used_cpu_slots"] == 0

    # a finished allocation is fenced: late metrics are refused and nothing is stored
    late = client.post(
        f"/api/v1/allocations/{alloc_id}/metrics", json={"records": records[:1]}, headers=as_rank(client, alloc_id)
    )
    assert late.status_code == 409
    assert count(settings, Metric) == 10
    assert client.post(f"/api/v1/jobs/{job_id}/kill", headers=USER).status_code == 409


def test_failed_rank_fails_the_job_and_stops_the_gang(client: TestClient, settings: Settings) -> None:
    a0, a1 = register(client, "a0"), register(client, "a1")
    job_id = submit(client, spec()).json()["id"]
    schedule(settings)
    allocation = client.get(f"/api/v1/jobs/{job_id}", headers=USER).json()["allocations"][0]
    node1_agent = next(n["agent_id"] for n in allocation["nodes"] if n["node_rank"] == 1)
    node0_agent = a0 if node1_agent == a1 else a1
    response = client.post(
        f"/api/v1/agents/{node1_agent}/allocations/{allocation['id']}/exit",
        json={"node_rank": 1, "exit_code": 3, "reason": "Traceback: boom"},
        headers=as_agent(node1_agent),
    )
    assert response.status_code == 204
    # the survivor is killed at once: the attempt failed and is fenced
    (survivor,) = client.get(f"/api/v1/agents/{node0_agent}/work", headers=as_agent(node0_agent)).json()["assignments"]
    assert survivor["desired"] == "kill"
    # what the failure costs is settled once every node is gone (the first exit may be collateral)
    assert client.get(f"/api/v1/jobs/{job_id}", headers=USER).json()["state"] == "RESTARTING"
    response = client.post(
        f"/api/v1/agents/{node0_agent}/allocations/{allocation['id']}/exit",
        json={"node_rank": 0, "exit_code": -9},
        headers=as_agent(node0_agent),
    )
    job = client.get(f"/api/v1/jobs/{job_id}", headers=USER).json()
    assert job["state"] == "FAILED"
    assert "exited with code 3" in job["failure_reason"] and "boom" in job["failure_reason"]
    assert "no restarts left: max_restarts is 0" in job["failure_reason"]


def test_kill_stops_every_node(client: TestClient, settings: Settings) -> None:
    register(client, "a0")
    register(client, "a1")
    job_id = submit(client, spec()).json()["id"]
    schedule(settings)
    killed = client.post(f"/api/v1/jobs/{job_id}/kill", headers=USER)
    assert killed.status_code == 200 and killed.json()["state"] == "CANCELLED"
    for agent in client.get("/api/v1/agents", headers=USER).json():
        work = client.get(f"/api/v1/agents/{agent['id']}/work", headers=as_agent(agent["id"])).json()
        assert [a["desired"] for a in work["assignments"]] == ["stop"]


def test_job_long_poll_answers_when_the_state_changes(client: TestClient, settings: Settings) -> None:
    register(client, "a0")
    register(client, "a1")
    created = submit(client, spec())
    assert created.status_code == 201, created.text
    job_id = created.json()["id"]
    url = f"/api/v1/jobs/{job_id}"
    started = time.monotonic()
    unchanged = client.get(url, params={"state": "QUEUED", "wait": 0.5}, headers=USER).json()
    assert unchanged["state"] == "QUEUED" and time.monotonic() - started >= 0.5
    # a state other than the current one answers at once
    assert client.get(url, params={"state": "RUNNING", "wait": 30}, headers=USER).json()["state"] == "QUEUED"

    with ThreadPoolExecutor(1) as pool:
        watcher = pool.submit(client.get, url, params={"state": "QUEUED", "wait": 30}, headers=USER)
        waiter = client.app.state.services.waiter  # type: ignore[attr-defined]
        deadline = time.monotonic() + 10
        while not waiter.listeners(f"job:{job_id}") and time.monotonic() < deadline:
            time.sleep(0.01)
        started = time.monotonic()
        assert client.post(f"{url}/kill", headers=USER).status_code == 200
        answered = watcher.result(timeout=30)
    assert answered.status_code == 200 and answered.json()["state"] == "CANCELLED"
    assert time.monotonic() - started < 5, "the watcher slept through the wake-up until its timeout"
    bad = client.get(url, params={"state": "NOPE", "wait": 1}, headers=USER)
    assert bad.status_code == 422 and "state" in bad.text


def test_waiting_job_says_why(client: TestClient, settings: Settings) -> None:
    register(client, "a0")
    register(client, "a1")
    first = submit(client, spec(name="first")).json()["id"]
    second = submit(client, spec(name="second")).json()["id"]
    schedule(settings)
    assert client.get(f"/api/v1/jobs/{first}", headers=USER).json()["state"] == "SCHEDULED"
    waiting = client.get(f"/api/v1/jobs/{second}", headers=USER).json()
    assert waiting["state"] == "QUEUED"
    assert "2 nodes" in waiting["wait_reason"]


def test_reaper_declares_silent_agents_lost_by_the_database_clock(client: TestClient, settings: Settings) -> None:
    a0 = register(client, "a0")
    register(client, "a1")
    job_id = submit(client, spec()).json()["id"]
    schedule(settings)
    hour_ago = func.timezone("utc", func.now()) - text("interval '1 hour'")
    sessions = partial(session_scope, settings.database_url)
    assert reap_pass(sessions, settings.heartbeat_timeout) == set()
    with session_scope(settings.database_url) as session:
        session.execute(update(Agent).where(Agent.id == a0).values(last_heartbeat=hour_ago))
    # the server started less than a timeout ago: agents could not heartbeat before, so no one is lost
    assert reap_pass(sessions, settings.heartbeat_timeout) == set()
    with session_scope(settings.database_url) as session:
        session.execute(update(ControlPlane).values(time=hour_ago))
    woken = reap_pass(sessions, settings.heartbeat_timeout)
    # the survivor (told to stop its node) and the lost agent itself (told it is lost, if it lives)
    assert a0 in woken and len(woken) == 2
    agents = {a["id"]: a["state"] for a in client.get("/api/v1/agents", headers=USER).json()}
    assert agents[a0] == "LOST"
    job = client.get(f"/api/v1/jobs/{job_id}", headers=USER).json()
    # a lost agent is the infrastructure's fault: the job restarts on the separate budget
    assert job["state"] == "RESTARTING" and "lost" in job["allocations"][-1]["end_reason"]
    # a lost agent that heartbeats is told to register again
    beat = client.post(f"/api/v1/agents/{a0}/heartbeat", headers=as_agent(a0))
    assert beat.status_code == 409 and "register again" in beat.json()["error"]
    register(client, "a0")
    assert {a["state"] for a in client.get("/api/v1/agents", headers=USER).json()} == {"ACTIVE"}


def test_a_heartbeat_that_counted_before_is_answered_at_once_and_a_loss_one_beat_later(
    client: TestClient, settings: Settings
) -> None:
    """`server/heartbeats.py`: the answer of an agent whose last heartbeat counted does not wait for
    the write; the write still happens, and what it finds (the agent declared lost) is the answer
    of the beat after."""
    a0 = register(client, "a0")

    def beat() -> int:
        return client.post(f"/api/v1/agents/{a0}/heartbeat", headers=as_agent(a0)).status_code

    def stamped() -> Any:
        with session_scope(settings.database_url) as session:
            return session.scalar(select(Agent.last_heartbeat).where(Agent.id == a0))

    assert beat() == 204  # the first: written before it is answered
    written = stamped()
    with session_scope(settings.database_url) as session:
        session.execute(update(Agent).where(Agent.id == a0).values(state="LOST"))
    assert beat() == 204  # answered before its write found the agent lost
    wait_for(lambda: beat() == 409, 10, "the loss to be answered")
    register(client, "a0")
    assert beat() == 204 and stamped() > written


def test_server_refuses_an_unmigrated_database(tmp_path: Any) -> None:
    name = f"phalanx_empty_{int(time.time() * 1000) % 10**9}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    try:
        with pytest.raises(SchemaOutOfDate, match="phalanx db upgrade"):
            create_app(Settings(data_dir=tmp_path, database_url=url, broker_url="filesystem://"))
    finally:
        engine_for(url).dispose()
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# --- NaN and infinities: stored and shown ------------------------------------------------------


def test_nan_and_infinities_are_stored_and_shown_on_every_surface(any_store: tuple[TestClient, Settings]) -> None:
    client, settings = any_store
    register(client, "n1")
    job_id = submit(client, spec(resources={"nodes": 1})).json()["id"]
    schedule(settings)
    alloc_id = client.get(f"/api/v1/jobs/{job_id}", headers=USER).json()["allocations"][0]["id"]
    # the documented strings, and the NaN/Infinity tokens Python's json module writes
    raw = (
        '{"records": [{"rank": 0, "step": 1, "time": 1.0, "values": {"loss": NaN, "acc": 0.5, "up": Infinity}},'
        ' {"rank": 0, "step": 2, "time": 1.0, "values": {"loss": "NaN", "up": "Infinity", "down": "-Infinity"}}]}'
    )
    posted = client.post(
        f"/api/v1/allocations/{alloc_id}/metrics",
        content=raw,
        headers={**as_rank(client, alloc_id), "Content-Type": "application/json"},
    )
    assert posted.status_code == 204, posted.text

    points = client.get(f"/api/v1/jobs/{job_id}/metrics", headers=USER)
    assert {(p["name"], p["step"]): p["value"] for p in points.json()} == {
        ("loss", 1): "NaN",
        ("acc", 1): 0.5,
        ("up", 1): "Infinity",
        ("loss", 2): "NaN",
        ("up", 2): "Infinity",
        ("down", 2): "-Infinity",
    }
    latest = {"loss": "NaN", "acc": 0.5, "up": "Infinity", "down": "-Infinity"}
    detail = client.get(f"/api/v1/jobs/{job_id}", headers=USER)
    assert detail.json()["latest_metrics"] == latest
    assert client.get("/api/v1/jobs", headers=USER).json()[0]["latest_metrics"] == latest

    # the SDK reads them back as floats, and the CLI prints them
    from phalanx.cli.output import fmt_metrics
    from phalanx.schemas import JobDetail, MetricPoint

    job = JobDetail.model_validate_json(detail.content)
    assert math.isnan(job.latest_metrics["loss"]) and job.latest_metrics["down"] == -math.inf
    assert fmt_metrics(job.latest_metrics) == "acc=0.5  down=-inf  loss=nan  up=inf"
    assert math.isnan(MetricPoint.model_validate(points.json()[0]).value)

    # a checkpoint's metrics keep them too
    body = {"step": 2, "path": f"{settings.checkpoint_uri}/job-{job_id}/step-2", "size_bytes": 1}
    body["metrics"] = {"loss": "NaN", "up": "Infinity"}
    committed = client.post(f"/api/v1/allocations/{alloc_id}/checkpoints", json=body, headers=as_rank(client, alloc_id))
    assert committed.status_code == 201, committed.text
    assert client.get(f"/api/v1/jobs/{job_id}/checkpoints", headers=USER).json()[0]["metrics"] == body["metrics"]

    # the dashboard: the chart series carry the strings (the chart breaks its line there)
    client.cookies.update({"phalanx_session": ADMIN_TOKEN})
    series = {s["name"]: s for s in client.get(f"/jobs/{job_id}/chart-data").json()["series"]}
    assert series["loss"]["values"] == ["NaN", "NaN"] and series["down"]["values"] == ["-Infinity"]
    page = client.get(f"/jobs/{job_id}")
    assert page.status_code == 200 and "loss=nan" in page.text and "up=inf" in page.text
