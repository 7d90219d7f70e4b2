"""Restarts, fencing, checkpoints and retention through the REST API on a real PostgreSQL."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select, text, update

from scheduler.service import hang_pass, schedule_pass
from server.app import create_app
from server.checkpoints import delete_marked
from server.db import session_scope
from server.models import Allocation, Checkpoint, Metric
from server.settings import Settings
from tests.agent_tokens import as_agent, as_rank, register_agent
from tests.conftest import ADMIN_TOKEN

pytestmark = pytest.mark.integration
USER = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings, enqueue=lambda *_, **__: None)) as test_client:
        yield test_client


def setup_job(client: TestClient, settings: Settings, agents: int = 3, **spec: Any) -> int:
    for i in range(agents):
        body = {"name": f"a{i}", "address": "127.0.0.1", "cpu_slots": 1}
        register_agent(client, **body)
    full = {"name": "ft", "entrypoint": "python train.py", "resources": {"nodes": 2}, **spec}
    response = client.post("/api/v1/jobs", files={"spec": (None, json.dumps(full))}, headers=USER)
    assert response.status_code == 201, response.text
    job_id: int = response.json()["id"]
    schedule(settings)
    return job_id


def schedule(settings: Settings) -> None:
    with session_scope(settings.database_url) as session:
        schedule_pass(session)


def job(client: TestClient, job_id: int) -> dict[str, Any]:
    response = client.get(f"/api/v1/jobs/{job_id}", headers=USER)
    assert response.status_code == 200
    body: dict[str, Any] = response.json()
    return body


def start_all(client: TestClient, job_id: int) -> dict[str, Any]:
    allocation = job(client, job_id)["allocations"][-1]
    for node in allocation["nodes"]:
        url = f"/api/v1/agents/{node['agent_id']}/allocations/{allocation['id']}/started"
        assert (
            client.post(url, json={"node_rank": node["node_rank"]}, headers=as_agent(node["agent_id"])).status_code
            == 204
        )
    return allocation


def exit_node(client: TestClient, allocation: dict[str, Any], rank: int, code: int, reason: str = "") -> None:
    node = next(n for n in allocation["nodes"] if n["node_rank"] == rank)
    url = f"/api/v1/agents/{node['agent_id']}/allocations/{allocation['id']}/exit"
    body = {"node_rank": rank, "exit_code": code, "reason": reason}
    assert client.post(url, json=body, headers=as_agent(node["agent_id"])).status_code == 204


def commit(client: TestClient, allocation_id: int, root: str, step: int, **metrics: float) -> Any:
    body = {"step": step, "path": f"{root}/step-{step}", "size_bytes": 10, "metrics": metrics}
    return client.post(
        f"/api/v1/allocations/{allocation_id}/checkpoints", json=body, headers=as_rank(client, allocation_id)
    )


def metrics(client: TestClient, allocation_id: int, steps: range, batch_id: str | None = None) -> Any:
    records = [{"rank": 0, "step": s, "time": time.time(), "values": {"loss": float(s)}} for s in steps]
    body: dict[str, Any] = {"records": records}
    if batch_id:
        body["batch_id"] = batch_id
    return client.post(
        f"/api/v1/allocations/{allocation_id}/metrics", json=body, headers=as_rank(client, allocation_id)
    )


def root_of(settings: Settings, job_id: int) -> str:
    return f"{settings.checkpoint_uri}/job-{job_id}"


def test_crash_restarts_from_the_newest_checkpoint_and_fences_the_old_attempt(
    client: TestClient, settings: Settings
) -> None:
    job_id = setup_job(client, settings, max_restarts=1)
    first = start_all(client, job_id)
    root = root_of(settings, job_id)
    assert commit(client, first["id"], root, 10, val_loss=0.5).status_code == 201
    assert metrics(client, first["id"], range(1, 16)).status_code == 204

    exit_node(client, first, 1, -9, "rank 1 exited with code -9 (SIGKILL)")
    state = job(client, job_id)
    assert state["state"] == "RESTARTING" and "attempt 1 is ending" in state["events"][-1]["reason"]
    # fenced at once: a zombie of attempt 1 writes nothing more
    assert metrics(client, first["id"], range(16, 18)).status_code == 409
    assert commit(client, first["id"], root, 20).status_code == 409
    survivor = next(n for n in first["nodes"] if n["node_rank"] == 0)
    work = client.get(f"/api/v1/agents/{survivor['agent_id']}/work", headers=as_agent(survivor["agent_id"])).json()
    assert [a["desired"] for a in work["assignments"]] == ["kill"]

    exit_node(client, first, 0, -9)
    state = job(client, job_id)
    assert state["state"] == "QUEUED" and state["restarts_used"] == 1
    assert "restart 1 of 1 (max_restarts)" in state["events"][-1]["reason"]
    schedule(settings)
    state = job(client, job_id)
    second = state["allocations"][-1]
    assert state["state"] == "SCHEDULED" and second["attempt"] == 2 and second["resume_step"] == 10
    assert "resuming from the checkpoint of step 10" in state["events"][-1]["reason"]
    assignment = client.get(
        f"/api/v1/agents/{second['nodes'][0]['agent_id']}/work", headers=as_agent(second["nodes"][0]["agent_id"])
    ).json()
    (assigned,) = [a for a in assignment["assignments"] if a["allocation_id"] == second["id"]]
    assert assigned["resume"] == {"step": 10, "path": f"{root}/step-10"}
    assert assigned["checkpoint_root"] == root

    # steps 11..15 of attempt 1 are re-done by attempt 2: reads show each step once
    start_all(client, job_id)
    assert metrics(client, second["id"], range(11, 13)).status_code == 204
    points = client.get(f"/api/v1/jobs/{job_id}/metrics", headers=USER).json()
    assert sorted(p["step"] for p in points) == list(range(1, 13))
    everything = client.get(f"/api/v1/jobs/{job_id}/metrics", params={"all_attempts": True}, headers=USER).json()
    assert len(everything) == 15 + 2

    # the second crash exhausts max_restarts
    exit_node(client, second, 0, 1, "Traceback: boom")
    exit_node(client, second, 1, -9)
    final = job(client, job_id)
    assert final["state"] == "FAILED" and "no restarts left" in final["failure_reason"]


BROKEN_COLLECTIVE = (
    "rank 0 exited with code 1; its last stderr lines:\nRuntimeError: [gloo/transport/tcp/pair.cc:537] "
    "Read error [127.0.0.1]:24273: Connection reset by peer. Check the logs of the remote worker."
)
OWN_CRASH = "rank 1 exited with code 7"


@pytest.mark.parametrize("first", [0, 1])
def test_the_failure_reason_names_the_crashed_node_whichever_reports_first(
    client: TestClient, settings: Settings, first: int
) -> None:
    """The crashing rank's peer fails on a broken connection within milliseconds: which node's
    report arrives first is a race, the job's reason must not be."""
    job_id = setup_job(client, settings, agents=2)
    allocation = start_all(client, job_id)
    reports = {0: (1, BROKEN_COLLECTIVE), 1: (1, OWN_CRASH)}
    exit_node(client, allocation, first, *reports[first])
    exit_node(client, allocation, 1 - first, *reports[1 - first])
    final = job(client, job_id)
    assert final["state"] == "FAILED"
    assert final["failure_reason"].startswith("node 1 on agent a1 exited with code 1: rank 1 exited with code 7")


def test_a_stopped_node_never_becomes_the_failure_reason(client: TestClient, settings: Settings) -> None:
    job_id = setup_job(client, settings, agents=2)
    allocation = start_all(client, job_id)
    exit_node(client, allocation, 0, 1, BROKEN_COLLECTIVE)
    node = next(n for n in allocation["nodes"] if n["node_rank"] == 1)
    url = f"/api/v1/agents/{node['agent_id']}/allocations/{allocation['id']}/exit"
    body = {"node_rank": 1, "exit_code": -9, "reason": "stopped by Phalanx", "cause": "stopped"}
    assert client.post(url, json=body, headers=as_agent(node["agent_id"])).status_code == 204
    final = job(client, job_id)
    assert final["state"] == "FAILED" and "Connection reset by peer" in final["failure_reason"]
    assert final["failure_reason"].startswith("node 0 on agent a0")


def test_retried_metric_batch_is_stored_once(client: TestClient, settings: Settings) -> None:
    job_id = setup_job(client, settings)
    allocation = start_all(client, job_id)
    for _ in range(3):
        assert metrics(client, allocation["id"], range(5), batch_id="stream-0").status_code == 204
    with session_scope(settings.database_url) as session:
        assert session.execute(select(func.count()).select_from(Metric)).scalar_one() == 5


def test_lost_agent_restarts_on_the_infrastructure_budget(client: TestClient, settings: Settings) -> None:
    job_id = setup_job(client, settings, max_restarts=0)
    allocation = start_all(client, job_id)
    node = allocation["nodes"][1]
    from scheduler.service import reap_pass
    from server.models import Agent, ControlPlane

    hour_ago = func.timezone("utc", func.now()) - text("interval '1 hour'")
    with session_scope(settings.database_url) as session:
        session.execute(update(ControlPlane).values(time=hour_ago))
        session.execute(update(Agent).where(Agent.id == node["agent_id"]).values(last_heartbeat=hour_ago))
    reap_pass(partial(session_scope, settings.database_url), settings.heartbeat_timeout)
    state = job(client, job_id)
    assert state["state"] == "RESTARTING"
    assert "lost" in state["allocations"][-1]["end_reason"]
    # the survivor's own exit (its peer vanished) is collateral: the attempt stays the infrastructure's
    exit_node(client, allocation, 1 - node["node_rank"], 1, "Connection reset by peer")
    state = job(client, job_id)
    assert state["state"] == "QUEUED"
    assert state["restarts_used"] == 0 and state["infra_restarts_used"] == 1
    schedule(settings)
    again = job(client, job_id)
    assert again["state"] == "SCHEDULED"
    assert node["agent_id"] not in {n["agent_id"] for n in again["allocations"][-1]["nodes"]}


def test_hang_restarts_the_attempt(client: TestClient, settings: Settings) -> None:
    job_id = setup_job(client, settings, max_restarts=1, hang_timeout=30)
    allocation = start_all(client, job_id)
    assert metrics(client, allocation["id"], range(3)).status_code == 204
    with session_scope(settings.database_url) as session:
        assert hang_pass(session) == set()
        old = func.timezone("utc", func.now()) - text("interval '1 minute'")
        session.execute(update(Allocation).values(last_progress_at=old))
    with session_scope(settings.database_url) as session:
        assert hang_pass(session)
    state = job(client, job_id)
    assert state["state"] == "RESTARTING" and "hang" in state["allocations"][-1]["end_reason"]


def test_pause_drain_and_resume(client: TestClient, settings: Settings) -> None:
    job_id = setup_job(client, settings, agents=2)
    allocation = start_all(client, job_id)
    paused = client.post(f"/api/v1/jobs/{job_id}/pause", headers=USER)
    assert paused.status_code == 200 and paused.json()["state"] == "PAUSED"
    # graceful: not fenced, so the checkpoint written on the way out still commits
    assert commit(client, allocation["id"], root_of(settings, job_id), 7).status_code == 201
    node = allocation["nodes"][0]
    work = client.get(f"/api/v1/agents/{node['agent_id']}/work", headers=as_agent(node["agent_id"])).json()
    assert [a["desired"] for a in work["assignments"]] == ["stop"]
    for n in allocation["nodes"]:
        exit_node(client, allocation, n["node_rank"], 143)
    assert job(client, job_id)["state"] == "PAUSED"
    assert client.post(f"/api/v1/jobs/{job_id}/pause", headers=USER).status_code == 409
    assert client.post(f"/api/v1/jobs/{job_id}/resume", headers=USER).json()["state"] == "QUEUED"
    schedule(settings)
    second = start_all(client, job_id)
    assert second["attempt"] == 2 and second["resume_step"] == 7

    drained = client.post(f"/api/v1/agents/{node['agent_id']}/drain", headers=USER)
    assert drained.status_code == 200 and drained.json()["state"] == "DRAINING"
    state = job(client, job_id)
    assert state["state"] == "RESTARTING" and "draining" in state["allocations"][-1]["end_reason"]
    for n in second["nodes"]:  # they checkpoint and leave (graceful), then the restart is charged
        exit_node(client, second, n["node_rank"], 0)
    state = job(client, job_id)
    assert state["state"] == "QUEUED" and state["infra_restarts_used"] == 1 and state["restarts_used"] == 0
    assert client.post("/api/v1/agents/999/drain", headers=USER).status_code == 404


def test_retention_keeps_last_and_best_and_deletes_files_first(
    client: TestClient, settings: Settings, tmp_path: Path
) -> None:
    policy = {"keep_last": 2, "keep_best": 1, "metric": "val_loss", "mode": "min"}
    job_id = setup_job(client, settings, checkpoint=policy)
    allocation = start_all(client, job_id)
    root = root_of(settings, job_id)
    local_root = Path(root.removeprefix("file://"))
    losses = {1: 0.9, 2: 0.2, 3: 0.5, 4: 0.7, 5: 0.6}
    for step, loss in losses.items():
        (local_root / f"step-{step}").mkdir(parents=True)
        (local_root / f"step-{step}" / "state.pt").write_bytes(b"x" * 10)
        assert commit(client, allocation["id"], root, step, val_loss=loss).status_code == 201
    with session_scope(settings.database_url) as session:
        removed = delete_marked(session, job_id)
    assert removed == 2
    listed = client.get(f"/api/v1/jobs/{job_id}/checkpoints", headers=USER).json()
    assert [c["step"] for c in listed] == [2, 4, 5]  # best val_loss (2) and the newest two
    assert sorted(p.name for p in local_root.iterdir()) == ["step-2", "step-4", "step-5"]
    with session_scope(settings.database_url) as session:
        assert session.execute(select(func.count()).select_from(Checkpoint)).scalar_one() == 3
    outside = client.post(
        f"/api/v1/allocations/{allocation['id']}/checkpoints",
        json={"step": 9, "path": "file:///etc/passwd", "size_bytes": 1},
        headers=as_rank(client, allocation["id"]),
    )
    assert outside.status_code == 422 and "outside this job's storage" in outside.json()["error"]
    archive = client.get(f"/api/v1/jobs/{job_id}/checkpoints/5/archive", headers=USER)
    assert archive.status_code == 200 and archive.content[:2] == b"\x1f\x8b"
    assert client.get(f"/api/v1/jobs/{job_id}/checkpoints/1/archive", headers=USER).status_code == 404


def test_a_retried_checkpoint_commit_is_recorded_once(client: TestClient, settings: Settings) -> None:
    """Rank 0 resends a commit whose answer it lost: the same record answers, nothing is doubled."""
    job_id = setup_job(client, settings)
    allocation = start_all(client, job_id)
    root = root_of(settings, job_id)
    first, again = commit(client, allocation["id"], root, 3), commit(client, allocation["id"], root, 3)
    assert first.status_code == again.status_code == 201 and first.json() == again.json()
    with session_scope(settings.database_url) as session:
        assert session.execute(select(func.count()).select_from(Checkpoint)).scalar_one() == 1
    elsewhere = {"step": 3, "path": f"{root}/elsewhere", "size_bytes": 1}
    clash = client.post(
        f"/api/v1/allocations/{allocation['id']}/checkpoints", json=elsewhere, headers=as_rank(client, allocation["id"])
    )
    assert clash.status_code == 409 and "already committed" in clash.json()["error"]


def test_nodes_reporting_at_the_same_moment_each_see_the_other(client: TestClient, settings: Settings) -> None:
    """Both nodes of a gang report started, then exit, at the same instant (in two transactions):
    the job must still become RUNNING, then COMPLETED. Each report locks the job row first and
    then re-reads the nodes, so the second one sees the first one's change."""
    import threading

    from server import attempts

    job_id = setup_job(client, settings, agents=2)
    allocation = job(client, job_id)["allocations"][0]

    def report_all(action: str) -> None:
        barrier = threading.Barrier(len(allocation["nodes"]))
        errors: list[BaseException] = []

        def report(node: dict[str, Any]) -> None:
            try:
                with session_scope(settings.database_url) as session:
                    if action == "start":
                        barrier.wait(10)
                        attempts.report_node_started(session, node["agent_id"], allocation["id"], node["node_rank"])
                        return
                    found, row = attempts.find_node(session, node["agent_id"], allocation["id"], node["node_rank"])
                    barrier.wait(10)
                    attempts.record_node_exit(session, found, row, 0, "")
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=report, args=(n,)) for n in allocation["nodes"]]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert not errors, errors

    report_all("start")
    assert job(client, job_id)["state"] == "RUNNING"
    report_all("exit")
    final = job(client, job_id)
    assert final["state"] == "COMPLETED" and not final["allocations"][0]["active"]


def lose_agent(settings: Settings, agent_id: int) -> None:
    """The reaper declares `agent_id` lost: its last heartbeat an hour ago by the database clock."""
    from scheduler.service import reap_pass
    from server.models import Agent, ControlPlane

    hour_ago = func.timezone("utc", func.now()) - text("interval '1 hour'")
    with session_scope(settings.database_url) as session:
        session.execute(update(ControlPlane).values(time=hour_ago))
        session.execute(update(Agent).where(Agent.id == agent_id).values(last_heartbeat=hour_ago))
    reap_pass(partial(session_scope, settings.database_url), settings.heartbeat_timeout)


def test_a_gang_whose_peer_vanished_restarts_without_waiting_for_the_peers_agent(
    client: TestClient, settings: Settings
) -> None:
    """The survivor's ranks fail on a reset connection: the gang queues again at once, on the
    infrastructure's budget, instead of waiting for the silent agent's heartbeat timeout; that
    agent's slot stays leased, and its loss, found later, settles the charge as it stands."""
    job_id = setup_job(client, settings, agents=3, max_restarts=1)
    allocation = start_all(client, job_id)
    vanished = next(n for n in allocation["nodes"] if n["node_rank"] == 1)
    exit_node(client, allocation, 0, 1, BROKEN_COLLECTIVE)
    state = job(client, job_id)
    assert state["state"] == "QUEUED", state["events"][-1]
    assert state["infra_restarts_used"] == 1 and state["restarts_used"] == 0
    assert f"without waiting for node 1 on agent {vanished['agent_name']}" in state["events"][-1]["reason"]
    old = state["allocations"][-1]
    assert not old["active"] and "presumed gone with its agent" in old["end_reason"]
    assert next(n for n in old["nodes"] if n["node_rank"] == 1)["state"] == "RUNNING"
    # fenced: nothing of the old attempt writes any more
    assert metrics(client, allocation["id"], range(3)).status_code == 409

    schedule(settings)
    state = job(client, job_id)
    assert state["state"] == "SCHEDULED"
    assert vanished["agent_id"] not in {n["agent_id"] for n in state["allocations"][-1]["nodes"]}

    lose_agent(settings, vanished["agent_id"])
    state = job(client, job_id)
    assert state["state"] == "SCHEDULED", "the loss of the old attempt's agent must not touch the new attempt"
    assert state["infra_restarts_used"] == 1 and state["restarts_used"] == 0
    old = state["allocations"][0]
    assert all(n["state"] == "EXITED" for n in old["nodes"]) and "lost" in old["end_reason"]


def test_a_presumed_vanished_peer_that_reports_its_own_crash_moves_the_charge_to_the_job(
    client: TestClient, settings: Settings
) -> None:
    """The peer was alive and its rank crashed (its report came second): the restart is the job's,
    and until that report its agent gets no new work."""
    for i in range(2):
        register_agent(client, name=f"a{i}", address="127.0.0.1", cpu_slots=2)
    spec = {"name": "ft", "entrypoint": "python train.py", "resources": {"nodes": 2}, "max_restarts": 1}
    response = client.post("/api/v1/jobs", files={"spec": (None, json.dumps(spec))}, headers=USER)
    job_id = response.json()["id"]
    schedule(settings)
    allocation = start_all(client, job_id)
    exit_node(client, allocation, 0, 1, BROKEN_COLLECTIVE)
    assert job(client, job_id)["state"] == "QUEUED"
    schedule(settings)
    state = job(client, job_id)
    assert state["state"] == "QUEUED", "the silent node's agent must get no new work while it may be dead"

    exit_node(client, allocation, 1, 1, OWN_CRASH)
    state = job(client, job_id)
    assert state["restarts_used"] == 1 and state["infra_restarts_used"] == 0
    assert state["allocations"][-1]["end_reason"].startswith("node 1 on agent a1 exited with code 1: rank 1")
    schedule(settings)
    assert job(client, job_id)["state"] == "SCHEDULED"


def test_without_a_restart_left_in_the_jobs_budget_the_gang_waits_for_its_peers(
    client: TestClient, settings: Settings
) -> None:
    """The charge may yet be the job's: with max_restarts 0 the attempt waits for the silent node's
    outcome, as before."""
    job_id = setup_job(client, settings, agents=2)
    allocation = start_all(client, job_id)
    exit_node(client, allocation, 0, 1, BROKEN_COLLECTIVE)
    state = job(client, job_id)
    assert state["state"] == "RESTARTING" and state["allocations"][-1]["active"]


def test_the_reaper_commits_each_lost_agent_on_its_own(client: TestClient, settings: Settings) -> None:
    """An agent whose job's row another transaction holds does not keep the other lost agents'
    jobs waiting: each agent is declared lost, and its attempts ended, in a transaction of its own."""
    from scheduler.service import reap_pass
    from server.models import Agent, ControlPlane, Job

    for name in ("a0", "a1"):
        register_agent(client, name=name, address="127.0.0.1", cpu_slots=1)
    job_ids = []
    for _ in range(2):
        spec = {"name": "ft", "entrypoint": "python train.py", "resources": {"nodes": 1}}
        response = client.post("/api/v1/jobs", files={"spec": (None, json.dumps(spec))}, headers=USER)
        job_ids.append(response.json()["id"])
    schedule(settings)
    job_on = {start_all(client, job_id)["nodes"][0]["agent_id"]: job_id for job_id in job_ids}
    first_agent, last_agent = sorted(job_on)  # the reaper takes agents in id order
    hour_ago = func.timezone("utc", func.now()) - text("interval '1 hour'")
    with session_scope(settings.database_url) as session:
        session.execute(update(ControlPlane).values(time=hour_ago))
        session.execute(update(Agent).values(last_heartbeat=hour_ago))

    with session_scope(settings.database_url) as holder:
        holder.execute(select(Job).where(Job.id == job_on[last_agent]).with_for_update()).one()
        reaper = threading.Thread(
            target=reap_pass, args=(partial(session_scope, settings.database_url), settings.heartbeat_timeout)
        )
        reaper.start()
        deadline = time.monotonic() + 30
        while job(client, job_on[first_agent])["state"] != "QUEUED":  # a lone node's job queues again
            assert time.monotonic() < deadline, "the first lost agent's job was not restarted while a row was held"
            time.sleep(0.05)
        assert reaper.is_alive()  # it is waiting for the held row, having committed the first agent
        assert job(client, job_on[last_agent])["state"] == "RUNNING"
    reaper.join(timeout=30)
    assert not reaper.is_alive()
    assert job(client, job_on[last_agent])["state"] == "QUEUED"
