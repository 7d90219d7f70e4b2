"""Studies through the REST API and the driver's passes, on a real PostgreSQL (agents are API
calls here; tests/e2e/test_studies.py runs real trial jobs)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import optuna
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from phalanx.schemas import StudySpec, StudyState
from scheduler.study_driver import Driver
from server import lifecycle, tuning
from server.app import create_app
from server.db import session_factory, session_scope
from server.models import Job, TuningStudy, TuningTrial
from server.settings import Settings
from tests.conftest import ADMIN_TOKEN, AGENT_TOKEN

pytestmark = pytest.mark.integration
USER = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
AGENT = {"Authorization": f"Bearer {AGENT_TOKEN}"}


@pytest.fixture
def enqueued() -> list[tuple[str, tuple[int, ...]]]:
    return []


@pytest.fixture
def client(settings: Settings, enqueued: list[tuple[str, tuple[int, ...]]]) -> Iterator[TestClient]:
    app = create_app(settings, enqueue=lambda task, *args: enqueued.append((task, args)))
    with TestClient(app) as test_client:
        for name in ("a0", "a1"):
            body = {"name": name, "address": "127.0.0.1", "cpu_slots": 1}
            assert test_client.post("/api/v1/agents/register", json=body, headers=AGENT).status_code == 200
        enqueued.clear()  # their scheduling passes
        yield test_client


def study_body(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": "tune",
        "objective": {"metric": "loss"},
        "search_space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
        "sampler": {"type": "random", "seed": 0},
        "n_trials": 4,
        "parallelism": 2,
        "trial": {"entrypoint": "python t.py", "hyperparameters": {"steps": 5}},
    }
    body.update(overrides)
    return body


def create(client: TestClient, body: dict[str, Any]) -> Any:
    return client.post("/api/v1/studies", files={"spec": (None, json.dumps(body), "application/json")}, headers=USER)


def count(settings: Settings, model: type[Any]) -> int:
    with session_scope(settings.database_url) as session:
        return int(session.execute(select(func.count()).select_from(model)).scalar_one())


def optuna_study_count(settings: Settings) -> int:
    return len(optuna.get_all_study_summaries(tuning.storage(settings.database_url)))


def driver(settings: Settings) -> Driver:
    return Driver(settings, session_factory(settings.database_url))


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"search_space": {}}, "search_space"),
        ({"sampler": "annealing"}, "sampler"),
        ({"pruner": "early-stop"}, "pruner"),
        ({"parallelism": 0}, "parallelism"),
        ({"objective": [{"metric": "a"}, {"metric": "b"}], "pruner": "median"}, "pruner"),
        ({"sampler": "grid"}, "search_space.x"),
        ({"search_space": {"x": {"type": "float", "low": 2, "high": 1}}}, "search_space.x"),
    ],
)
def test_bad_input_is_a_422_naming_the_field_and_creates_nothing(
    client: TestClient, settings: Settings, enqueued: list[Any], overrides: dict[str, Any], field: str
) -> None:
    response = create(client, study_body(**overrides))
    assert response.status_code == 422
    body = response.json()
    assert body["error"].startswith("invalid study spec") and field in body["error"]
    assert body["detail"] and all({"field", "problem"} <= set(p) for p in body["detail"])
    assert count(settings, TuningStudy) == 0 and count(settings, Job) == 0
    assert optuna_study_count(settings) == 0 and not enqueued


def test_a_study_whose_trials_never_fit_is_refused(client: TestClient, settings: Settings) -> None:
    response = create(client, study_body(trial={"entrypoint": "python t.py", "resources": {"nodes": 3}}))
    assert response.status_code == 422 and "the trials of study 'tune' can never be placed" in response.json()["error"]
    assert count(settings, TuningStudy) == 0


def test_unknown_studies_and_wrong_states(client: TestClient) -> None:
    for method, path in [("GET", "/studies/99"), ("POST", "/studies/99/stop"), ("GET", "/studies/99/best")]:
        response = client.request(method, f"/api/v1{path}", headers=USER)
        assert response.status_code == 404 and "studies list" in response.json()["error"]
    study = create(client, study_body()).json()
    resumed = client.post(f"/api/v1/studies/{study['id']}/resume", headers=USER)
    assert resumed.status_code == 409 and "not STOPPED" in resumed.json()["error"]
    no_best = client.get(f"/api/v1/studies/{study['id']}/best", headers=USER)
    assert no_best.status_code == 409 and "no COMPLETE trial" in no_best.json()["error"]
    bad_method = client.get(f"/api/v1/studies/{study['id']}/importance?method=shap", headers=USER)
    assert bad_method.status_code == 422


def test_the_driver_launches_up_to_parallelism_and_is_idempotent(
    client: TestClient, settings: Settings, enqueued: list[Any]
) -> None:
    study = create(client, study_body()).json()
    assert study["state"] == "RUNNING" and ("phalanx.advance_study", (study["id"],)) in enqueued
    assert driver(settings).advance(study["id"]).launched == 2
    assert driver(settings).advance(study["id"]).launched == 0  # a second pass changes nothing
    shown = client.get(f"/api/v1/studies/{study['id']}", headers=USER).json()
    assert [(t["number"], t["state"], t["job_state"]) for t in shown["trials"]] == [
        (0, "RUNNING", "QUEUED"),
        (1, "RUNNING", "QUEUED"),
    ]
    for trial in shown["trials"]:
        job = client.get(f"/api/v1/jobs/{trial['job_id']}", headers=USER).json()
        assert job["name"] == f"tune-t{trial['number']}" and job["study_id"] == study["id"]
        assert job["spec"]["hyperparameters"] == {"steps": 5, "x": trial["params"]["x"]}
    frozen = optuna.load_study(study_name=shown["optuna_study_name"], storage=tuning.storage(settings.database_url))
    assert [t.state for t in frozen.trials] == [optuna.trial.TrialState.RUNNING] * 2
    assert [t.user_attrs["phalanx_job_id"] for t in frozen.trials] == [t["job_id"] for t in shown["trials"]]


def test_two_drivers_at_once_never_exceed_parallelism(client: TestClient, settings: Settings) -> None:
    study = create(client, study_body(parallelism=3, n_trials=8)).json()
    with ThreadPoolExecutor(4) as pool:
        launched = list(pool.map(lambda _: driver(settings).advance(study["id"]).launched, range(4)))
    assert sum(launched) == 3 and count(settings, TuningTrial) == 3


def test_an_ended_trial_job_is_told_and_the_next_trial_starts(client: TestClient, settings: Settings) -> None:
    study = create(client, study_body(max_failed_trials=2)).json()
    driver(settings).advance(study["id"])
    with session_scope(settings.database_url) as session:
        first = session.scalars(select(Job).order_by(Job.id)).first()
        assert first is not None
        lifecycle.kill_job(session, first)  # a user cancels a trial: FAIL, not a failed configuration
    assert driver(settings).advance(study["id"]).launched == 1
    shown = client.get(f"/api/v1/studies/{study['id']}", headers=USER).json()
    assert [t["state"] for t in shown["trials"]] == ["FAIL", "RUNNING", "RUNNING"]
    assert shown["trials"][0]["reason"] == "its job was cancelled" and shown["state"] == "RUNNING"


def test_an_orphan_trial_is_adopted_not_duplicated(client: TestClient, settings: Settings) -> None:
    """A driver that died between Optuna's ask and its own commit leaves a RUNNING Optuna trial
    with no job (here, one whose parameters were not even sampled): the next pass gives it a job."""
    body = study_body(n_trials=3)
    study = create(client, body).json()
    with session_scope(settings.database_url) as session:
        row = session.get(TuningStudy, study["id"])
        assert row is not None
        name = row.optuna_name
    spec = StudySpec.model_validate(body)
    asked = tuning.create(settings.database_url, name, spec)
    half_asked = asked._storage.create_new_trial(asked._study_id)  # died before sampling
    assert driver(settings).advance(study["id"]).launched == 1  # adopted trial 0, launched trial 1
    shown = client.get(f"/api/v1/studies/{study['id']}", headers=USER).json()
    assert [t["number"] for t in shown["trials"]] == [0, 1]
    adopted = asked._storage.get_trial(half_asked)
    assert adopted.number == 0 and set(adopted.params) == {"x"} and shown["trials"][0]["params"] == adopted.params
    assert len(tuning.load(settings.database_url, name, spec).trials) == 2


def test_stop_pauses_trials_and_resume_requeues_them(
    client: TestClient, settings: Settings, enqueued: list[Any]
) -> None:
    study = create(client, study_body()).json()
    driver(settings).advance(study["id"])
    stopped = client.post(f"/api/v1/studies/{study['id']}/stop", headers=USER)
    assert stopped.status_code == 200 and stopped.json()["state"] == "STOPPED"
    assert driver(settings).advance(study["id"]).launched == 0
    trials = client.get(f"/api/v1/studies/{study['id']}", headers=USER).json()["trials"]
    assert [t["job_state"] for t in trials] == ["PAUSED", "PAUSED"]
    again = client.post(f"/api/v1/studies/{study['id']}/stop", headers=USER)
    assert again.status_code == 409
    enqueued.clear()
    assert client.post(f"/api/v1/studies/{study['id']}/resume", headers=USER).json()["state"] == "RUNNING"
    assert ("phalanx.advance_study", (study["id"],)) in enqueued
    trials = client.get(f"/api/v1/studies/{study['id']}", headers=USER).json()["trials"]
    assert [t["job_state"] for t in trials] == ["QUEUED", "QUEUED"]


def test_study_long_poll_answers_when_a_trial_changes(client: TestClient, settings: Settings) -> None:
    study = create(client, study_body()).json()
    shown = client.get(f"/api/v1/studies/{study['id']}", headers=USER).json()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(
            client.get, f"/api/v1/studies/{study['id']}?version={shown['version']}&wait=30", headers=USER
        )
        driver(settings).advance(study["id"])  # publishes study:<id> after its commits
        changed = waiting.result(timeout=30).json()
    assert changed["version"] != shown["version"] and changed["trials"]


def test_list_studies(client: TestClient) -> None:
    first = create(client, study_body()).json()
    second = create(client, study_body(name="other")).json()
    listed = client.get("/api/v1/studies", headers=USER).json()
    assert [s["id"] for s in listed] == [second["id"], first["id"]]
    assert client.get("/api/v1/studies?state=COMPLETED", headers=USER).json() == []
    assert StudyState(listed[0]["state"]) is StudyState.RUNNING and listed[0]["trial_counts"] == {}
