"""Scaling runs through the REST API on the real database, driven by the scheduler's step
(`server.scaling.advance`, what the periodic `phalanx.advance_scaling` task runs): one size after
another, each job killed once rank 0 reported its last measured step, its rate taken from the
rank's own timestamps; a size that fails fails the run, saying why; a cancel kills the size being
measured; someone else's run answers 404."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from fastapi.testclient import TestClient

from scheduler.service import schedule_pass
from server import scaling
from server.db import session_scope
from server.settings import Settings
from tests.agent_tokens import as_agent
from tests.integration.test_access import new_user
from tests.integration.test_api import USER, register
from tests.integration.test_dashboard import sign_in

pytestmark = pytest.mark.integration

T0 = time.time()
SPEC = {"name": "wide", "entrypoint": "python train.py", "resources": {"nodes": 1, "slots_per_node": 1}}


def start(client: TestClient, request: dict[str, Any], headers: dict[str, str] = USER) -> Any:
    files = {
        "spec": (None, json.dumps(SPEC), "application/json"),
        "request": (None, json.dumps(request), "application/json"),
    }
    return client.post("/api/v1/scaling", files=files, headers=headers)


def advance(settings: Settings, run_id: int) -> None:
    """One scheduling pass and one step of the run's driver, as the scheduler's passes do."""
    with session_scope(settings.database_url) as session:
        schedule_pass(session)
    with session_scope(settings.database_url) as session:
        run = scaling.lock_running(session, run_id)
        if run is not None:
            scaling.advance(session, run)


def credential(client: TestClient, allocation_id: int) -> dict[str, str]:
    for agent in client.get("/api/v1/agents", headers=USER).json():
        for a in client.get(f"/api/v1/agents/{agent['id']}/work", headers=as_agent(agent["id"])).json()["assignments"]:
            if a["allocation_id"] == allocation_id:
                return {"Authorization": f"Bearer {a['credential']}"}
    raise AssertionError(f"no assignment of allocation {allocation_id}")


def report_steps(client: TestClient, job_id: int, steps: range, seconds_per_step: float, figures: bool = False) -> None:
    """Rank 0 of the job's attempt reports `steps`, stamped `seconds_per_step` apart; with
    `figures`, every rank also reports its communication figures."""
    (allocation,) = client.get(f"/api/v1/jobs/{job_id}", headers=USER).json()["allocations"]
    start_time = T0  # the rank's own clock: the same origin for every batch of a job
    records: list[dict[str, Any]] = [
        {"rank": 0, "step": step, "time": start_time + step * seconds_per_step, "values": {"loss": 1.0}}
        for step in steps
    ]
    if figures:
        values = {
            "phalanx/step_time_s": seconds_per_step,
            "phalanx/data_time_s": 0.0,
            "phalanx/compute_time_s": 0.7 * seconds_per_step,
            "phalanx/comm_exposed_s": 0.2 * seconds_per_step,
            "phalanx/comm_time_s": 0.3 * seconds_per_step,
            "phalanx/comm_bytes_per_step": 4000.0,
        }
        when = start_time + steps[-1] * seconds_per_step
        records += [{"rank": rank, "step": steps[-1], "time": when, "values": values} for rank in (0, 1)]
    url = f"/api/v1/allocations/{allocation['id']}/metrics"
    posted = client.post(url, json={"records": records}, headers=credential(client, allocation["id"]))
    assert posted.status_code == 204, posted.text


def test_a_run_measures_each_size_in_turn_and_compares_it_with_the_smallest(
    client: TestClient, settings: Settings
) -> None:
    register(client, "n1", slots=1)
    register(client, "n2", slots=1)
    created = start(client, {"nodes": [2, 1], "steps": 10, "warmup": 2})
    assert created.status_code == 201, created.text
    run = created.json()
    assert (run["state"], run["nodes"], run["measuring"], len(run["job_ids"])) == ("RUNNING", [1, 2], 1, 1)
    first_job = run["job_ids"][0]
    assert client.get(f"/api/v1/jobs/{first_job}", headers=USER).json()["name"] == "wide-scaling-n1"

    advance(settings, run["id"])  # placed; no step yet: nothing to measure
    report_steps(client, first_job, range(0, 8), 0.1)
    advance(settings, run["id"])
    assert client.get(f"/api/v1/scaling/{run['id']}", headers=USER).json()["points"] == []  # step 12 not reached
    report_steps(client, first_job, range(8, 13), 0.1)
    advance(settings, run["id"])
    shown = client.get(f"/api/v1/scaling/{run['id']}", headers=USER).json()
    assert client.get(f"/api/v1/jobs/{first_job}", headers=USER).json()["state"] == "CANCELLED"
    assert shown["measuring"] == 2 and len(shown["job_ids"]) == 2
    (one,) = shown["points"]
    assert one["nodes"] == 1 and one["steps_per_second"] == pytest.approx(10.0, rel=1e-3)

    second_job = shown["job_ids"][1]
    advance(settings, run["id"])
    report_steps(client, second_job, range(0, 13), 0.125, figures=True)
    advance(settings, run["id"])
    done = client.get(f"/api/v1/scaling/{run['id']}", headers=USER).json()
    assert done["state"] == "COMPLETED" and done["measuring"] is None, done["reason"]
    one, two = done["points"]
    assert two["world_size"] == 2 and two["steps_per_second"] == pytest.approx(8.0, rel=1e-3)
    assert two["throughput"] == pytest.approx(16.0, rel=1e-3)
    assert two["efficiency"] == pytest.approx(0.8, rel=1e-3)  # 16 per-rank batches/s against 2 x 10
    assert two["comm_fraction"] == pytest.approx(0.2) and two["bytes_per_step"] == 4000.0
    assert client.get(f"/api/v1/jobs/{second_job}", headers=USER).json()["state"] == "CANCELLED"
    assert client.post(f"/api/v1/scaling/{run['id']}/cancel", headers=USER).status_code == 409

    sign_in(client)  # the dashboard draws the same table, with a bar per size
    page = client.get(f"/scaling/{run['id']}").text
    assert "COMPLETED" in page and 'title="efficiency 80 %"' in page and f'href="/jobs/{second_job}"' in page
    assert f'href="/scaling/{run["id"]}"' in client.get("/scaling").text


def test_a_size_whose_job_fails_fails_the_run_saying_why(client: TestClient, settings: Settings) -> None:
    register(client, "n1", slots=1)
    run = start(client, {"nodes": [1], "steps": 10, "warmup": 0}).json()
    job_id = run["job_ids"][0]
    assert client.post(f"/api/v1/jobs/{job_id}/kill", headers=USER).status_code == 200
    advance(settings, run["id"])
    failed = client.get(f"/api/v1/scaling/{run['id']}", headers=USER).json()
    assert failed["state"] == "FAILED" and f"1 node(s): job {job_id} ended CANCELLED" in failed["reason"]


def test_a_cancel_kills_the_size_being_measured_and_others_see_nothing(client: TestClient, settings: Settings) -> None:
    register(client, "n1", slots=1)
    run = start(client, {"nodes": [1], "steps": 10}).json()
    bob = new_user(client, "bob")
    for method, path in [("GET", f"/api/v1/scaling/{run['id']}"), ("POST", f"/api/v1/scaling/{run['id']}/cancel")]:
        answer = client.request(method, path, headers=bob)
        assert answer.status_code == 404 and "no scaling run" in answer.json()["error"]
    assert client.get("/api/v1/scaling", headers=bob).json() == []
    cancelled = client.post(f"/api/v1/scaling/{run['id']}/cancel", headers=USER)
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "CANCELLED"
    assert client.get(f"/api/v1/jobs/{run['job_ids'][0]}", headers=USER).json()["state"] == "CANCELLED"


@pytest.mark.parametrize(
    ("request_body", "says"),
    [
        ({"nodes": [1, 1]}, "give each size once"),
        ({"nodes": []}, "nodes"),
        ({"nodes": list(range(1, 10))}, "nodes"),
        ({"nodes": [0]}, "nodes"),
        ({"nodes": [1], "steps": 0}, "steps"),
        ({"nodes": [1], "surprise": 1}, "surprise"),
        ({"nodes": [64]}, "can never"),
    ],
)
def test_a_bad_request_is_refused_and_creates_nothing(
    client: TestClient, request_body: dict[str, Any], says: str
) -> None:
    register(client, "n1", slots=1)
    refused = start(client, request_body)
    assert refused.status_code == 422 and says in refused.text, refused.text
    assert client.get("/api/v1/scaling", headers=USER).json() == []
    assert client.get("/api/v1/jobs", headers=USER).json() == []
