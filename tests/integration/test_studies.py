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
from server import jobs, tuning
from server.app import create_app
from server.db import session_factory, session_scope
from server.models import Job, TuningStudy, TuningTrial
from server.settings import Settings
from server.task_names import ADVANCE_STUDY_TASK
from tests.agent_tokens import as_agent, as_rank, register_agent
from tests.conftest import ADMIN_TOKEN

pytestmark = pytest.mark.integration
USER = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture
def enqueued() -> list[tuple[str, tuple[int, ...]]]:
    return []


@pytest.fixture
def client(settings: Settings, enqueued: list[tuple[str, tuple[int, ...]]]) -> Iterator[TestClient]:
    app = create_app(settings, enqueue=lambda task, *args, **_: enqueued.append((task, args)))
    with TestClient(app) as test_client:
        for name in ("a0", "a1"):
            body = {"name": name, "address": "127.0.0.1", "cpu_slots": 1}
            register_agent(test_client, **body)
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
    assert study["state"] == "RUNNING" and (ADVANCE_STUDY_TASK, (study["id"],)) in enqueued
    assert driver(settings).advance(study["id"]) == 2
    assert driver(settings).advance(study["id"]) == 0  # a second pass changes nothing
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
        launched = list(pool.map(lambda _: driver(settings).advance(study["id"]), range(4)))
    assert sum(launched) == 3 and count(settings, TuningTrial) == 3


def test_an_ended_trial_job_is_told_and_the_next_trial_starts(client: TestClient, settings: Settings) -> None:
    study = create(client, study_body(max_failed_trials=2)).json()
    driver(settings).advance(study["id"])
    with session_scope(settings.database_url) as session:
        first = session.scalars(select(Job).order_by(Job.id)).first()
        assert first is not None
        jobs.kill_job(session, first)  # a user cancels a trial: FAIL, not a failed configuration
    assert driver(settings).advance(study["id"]) == 1
    shown = client.get(f"/api/v1/studies/{study['id']}", headers=USER).json()
    assert [t["state"] for t in shown["trials"]] == ["FAIL", "RUNNING", "RUNNING"]
    assert shown["trials"][0]["reason"] == "its job was cancelled by user" and shown["state"] == "RUNNING"


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
    assert driver(settings).advance(study["id"]) == 1  # adopted trial 0, launched trial 1
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
    assert driver(settings).advance(study["id"]) == 0
    trials = client.get(f"/api/v1/studies/{study['id']}", headers=USER).json()["trials"]
    assert [t["job_state"] for t in trials] == ["PAUSED", "PAUSED"]
    again = client.post(f"/api/v1/studies/{study['id']}/stop", headers=USER)
    assert again.status_code == 409
    enqueued.clear()
    assert client.post(f"/api/v1/studies/{study['id']}/resume", headers=USER).json()["state"] == "RUNNING"
    assert (ADVANCE_STUDY_TASK, (study["id"],)) in enqueued
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


def start_trial(client: TestClient, settings: Settings, job_id: int) -> tuple[int, int]:
    """Place the (one-node) trial job and report it started, as its agent would: (allocation, agent)."""
    from scheduler.service import schedule_pass

    with session_scope(settings.database_url) as session:
        schedule_pass(session)
    (allocation,) = client.get(f"/api/v1/jobs/{job_id}", headers=USER).json()["allocations"]
    (node,) = allocation["nodes"]
    started = client.post(
        f"/api/v1/agents/{node['agent_id']}/allocations/{allocation['id']}/started",
        json={"node_rank": 0},
        headers=as_agent(node["agent_id"]),
    )
    assert started.status_code == 204
    return allocation["id"], node["agent_id"]


def report(client: TestClient, allocation_id: int, points: dict[int, dict[str, float]]) -> None:
    records = [{"rank": 0, "step": step, "time": 0.0, "values": values} for step, values in points.items()]
    posted = client.post(
        f"/api/v1/allocations/{allocation_id}/metrics",
        json={"records": records},
        headers=as_rank(client, allocation_id),
    )
    assert posted.status_code == 204


def finish(client: TestClient, allocation_id: int, agent_id: int, exit_code: int = 0) -> None:
    body = {"node_rank": 0, "exit_code": exit_code}
    done = client.post(
        f"/api/v1/agents/{agent_id}/allocations/{allocation_id}/exit", json=body, headers=as_agent(agent_id)
    )
    assert done.status_code == 204


def trials(client: TestClient, study_id: int) -> list[dict[str, Any]]:
    return list(client.get(f"/api/v1/studies/{study_id}", headers=USER).json()["trials"])


def test_the_pruner_prunes_a_trial_worse_than_the_median(
    client: TestClient, settings: Settings, enqueued: list[Any]
) -> None:
    pruner = {"type": "median", "n_startup_trials": 1, "n_warmup_steps": 0}
    study = create(client, study_body(pruner=pruner, n_trials=2, parallelism=1)).json()
    driver(settings).advance(study["id"])
    (first,) = trials(client, study["id"])
    allocation, agent = start_trial(client, settings, first["job_id"])
    enqueued.clear()
    report(client, allocation, {0: {"loss": 1.0}, 1: {"loss": 0.5}, 2: {"loss": 0.2, "other": 3.0}})
    assert (ADVANCE_STUDY_TASK, (study["id"],)) in enqueued  # the batch carries the objective
    enqueued.clear()
    report(client, allocation, {3: {"other": 1.0}})
    assert not enqueued  # this one does not
    finish(client, allocation, agent)
    assert (ADVANCE_STUDY_TASK, (study["id"],)) in enqueued  # a trial job ended
    driver(settings).advance(study["id"])  # tells COMPLETE (loss 0.2, the last value), starts trial 1

    second = trials(client, study["id"])[1]
    allocation, agent = start_trial(client, settings, second["job_id"])
    report(client, allocation, {0: {"loss": 5.0}, 1: {"loss": 4.0}})
    driver(settings).advance(study["id"])  # prunes it: its agent is told to stop (SIGTERM), below
    job = client.get(f"/api/v1/jobs/{second['job_id']}", headers=USER).json()
    assert job["state"] == "PRUNED"
    work = client.get(f"/api/v1/agents/{agent}/work", headers=as_agent(agent)).json()
    assert [a["desired"] for a in work["assignments"]] == ["stop"]
    shown = trials(client, study["id"])
    assert [(t["state"], t["values"]) for t in shown] == [("COMPLETE", [0.2]), ("PRUNED", [4.0])]
    assert shown[1]["reason"] == "pruned by the median pruner at step 1 (loss 4)" and shown[1]["last_step"] == 1
    finish(client, allocation, agent, exit_code=143)  # its workers leave after checkpointing
    driver(settings).advance(study["id"])
    final = client.get(f"/api/v1/studies/{study['id']}", headers=USER).json()
    assert final["state"] == "COMPLETED" and final["best_trial"] == 0 and final["best_values"] == [0.2]
    assert [t["best_so_far"] for t in final["trials"]] == [0.2, 0.2]


def test_a_completed_trial_without_its_objective_fails(client: TestClient, settings: Settings) -> None:
    study = create(client, study_body(n_trials=1)).json()
    driver(settings).advance(study["id"])
    (trial,) = trials(client, study["id"])
    allocation, agent = start_trial(client, settings, trial["job_id"])
    report(client, allocation, {0: {"accuracy": 0.5}})
    finish(client, allocation, agent)
    driver(settings).advance(study["id"])
    (trial,) = trials(client, study["id"])
    assert trial["state"] == "FAIL" and trial["reason"] == "its job completed without reporting loss"


def test_the_target_value_completes_the_study_and_cancels_the_rest(client: TestClient, settings: Settings) -> None:
    study = create(client, study_body(target_value=0.1, n_trials=5)).json()
    driver(settings).advance(study["id"])
    first, _ = trials(client, study["id"])
    allocation, agent = start_trial(client, settings, first["job_id"])
    report(client, allocation, {0: {"loss": 0.05}})
    finish(client, allocation, agent)
    driver(settings).advance(study["id"])
    shown = client.get(f"/api/v1/studies/{study['id']}", headers=USER).json()
    assert shown["state"] == "COMPLETED" and "trial 0 reached the target value 0.1" in shown["reason"]
    assert [(t["state"], t["job_state"]) for t in shown["trials"]] == [("COMPLETE", "COMPLETED"), ("FAIL", "CANCELLED")]
    frozen = optuna.load_study(study_name=shown["optuna_study_name"], storage=tuning.storage(settings.database_url))
    assert [t.state.name for t in frozen.trials] == ["COMPLETE", "FAIL"]
    assert "reached the target value" in frozen.trials[1].system_attrs["fail_reason"]


def test_a_multi_objective_study_has_a_pareto_front(client: TestClient, settings: Settings) -> None:
    body = study_body(
        objective=[{"metric": "acc", "direction": "maximize"}, {"metric": "latency", "direction": "minimize"}],
        sampler={"type": "nsga2", "seed": 0, "population_size": 4},
        n_trials=4,
        parallelism=4,
    )
    study = create(client, body).json()
    driver(settings).advance(study["id"])
    outcomes = [(0.9, 10.0), (0.8, 5.0), (0.7, 7.0), (0.95, 20.0)]  # trial 2 is dominated by trial 1
    for trial, (acc, latency) in zip(trials(client, study["id"]), outcomes, strict=True):
        allocation, agent = start_trial(client, settings, trial["job_id"])
        report(client, allocation, {0: {"acc": acc, "latency": latency}})
        finish(client, allocation, agent)
    driver(settings).advance(study["id"])
    shown = client.get(f"/api/v1/studies/{study['id']}", headers=USER).json()
    assert shown["state"] == "COMPLETED" and shown["best_trial"] is None
    assert [t["number"] for t in shown["trials"] if t["best"]] == [0, 1, 3]
    best = client.get(f"/api/v1/studies/{study['id']}/best", headers=USER).json()
    assert [t["number"] for t in best["trials"]] == [0, 1, 3] and best["directions"] == ["maximize", "minimize"]
    assert client.get(f"/api/v1/studies/{study['id']}/importance", headers=USER).status_code == 422


def test_a_nan_objective_fails_its_trial_or_gets_it_pruned_and_infinity_completes(
    client: TestClient, settings: Settings
) -> None:
    pruner = {"type": "median", "n_startup_trials": 1, "n_warmup_steps": 0}
    study = create(client, study_body(pruner=pruner, n_trials=3, parallelism=1)).json()
    driver(settings).advance(study["id"])
    (first,) = trials(client, study["id"])
    allocation, agent = start_trial(client, settings, first["job_id"])
    report(client, allocation, {0: {"loss": "NaN"}})  # type: ignore[dict-item]
    driver(settings).advance(study["id"])  # an intermediate NaN is reported (nothing to compare it with yet)
    report(client, allocation, {1: {"loss": "NaN"}})  # type: ignore[dict-item]
    finish(client, allocation, agent)
    driver(settings).advance(study["id"])  # Optuna completes no trial on NaN: it fails, and trial 1 starts
    failed = trials(client, study["id"])[0]
    assert failed["state"] == "FAIL" and failed["reason"] == "its job's last loss was NaN"

    second = trials(client, study["id"])[1]
    allocation, agent = start_trial(client, settings, second["job_id"])
    report(client, allocation, {0: {"loss": "Infinity"}})  # type: ignore[dict-item]
    finish(client, allocation, agent)
    driver(settings).advance(study["id"])
    third = trials(client, study["id"])[2]
    allocation, agent = start_trial(client, settings, third["job_id"])
    report(client, allocation, {0: {"loss": "NaN"}})  # type: ignore[dict-item]
    driver(settings).advance(study["id"])  # the median pruner prunes a trial gone NaN
    assert client.get(f"/api/v1/jobs/{third['job_id']}", headers=USER).json()["state"] == "PRUNED"
    finish(client, allocation, agent, exit_code=143)
    driver(settings).advance(study["id"])

    final = client.get(f"/api/v1/studies/{study['id']}", headers=USER).json()
    assert final["state"] == "COMPLETED" and final["best_trial"] == 1 and final["best_values"] == ["Infinity"]
    assert [(t["state"], t["values"]) for t in final["trials"]] == [
        ("FAIL", None),
        ("COMPLETE", ["Infinity"]),
        ("PRUNED", None),  # Optuna keeps no NaN as a pruned trial's value
    ]
    assert final["trials"][2]["reason"] == "pruned by the median pruner at step 0 (loss nan)"
    client.cookies.update({"phalanx_session": ADMIN_TOKEN})
    assert client.get(f"/studies/{study['id']}").status_code == 200  # its charts leave the NaN out


def test_a_grid_above_the_servers_limit_is_refused_naming_its_size(client: TestClient, settings: Settings) -> None:
    space = {"a": {"type": "int", "low": 1, "high": 200}, "b": {"type": "categorical", "choices": list(range(60))}}
    response = create(client, study_body(sampler="grid", search_space=space))
    body = response.json()
    assert response.status_code == 422, body
    assert (
        "sampler: grid: the search space has 12,000 combinations, above this server's limit of 10,000" in body["error"]
    )
    assert "PHALANX_MAX_GRID_COMBINATIONS" in body["error"] and body["detail"][0]["field"] == "sampler"
    assert count(settings, TuningStudy) == 0 and optuna_study_count(settings) == 0


def test_importance_uses_the_newest_trials_up_to_its_limit(client: TestClient, settings: Settings) -> None:
    space = {"x": {"type": "float", "low": 0.0, "high": 1.0}, "y": {"type": "float", "low": 0.0, "high": 1.0}}
    study = create(client, study_body(search_space=space, n_trials=4, parallelism=4)).json()
    driver(settings).advance(study["id"])
    for trial in trials(client, study["id"]):
        allocation, agent = start_trial(client, settings, trial["job_id"])
        report(client, allocation, {0: {"loss": trial["params"]["x"]}})
        finish(client, allocation, agent)
    driver(settings).advance(study["id"])
    url = f"/api/v1/studies/{study['id']}/importance"
    everything = client.get(url, headers=USER).json()
    assert set(everything["importances"]) == {"x", "y"} and everything["note"] is None
    settings.max_importance_trials = 3  # the app holds this settings object
    newest = client.get(url, headers=USER).json()
    assert set(newest["importances"]) == {"x", "y"} and newest["note"] == "from the newest 3 of 4 COMPLETE trials"


def test_every_trial_installs_the_lock_the_first_trial_resolved(client: TestClient, settings: Settings) -> None:
    body = study_body(parallelism=1, n_trials=3)
    body["trial"]["runtime_env"] = {"pip": ["phx-probe==1.0"]}
    study = create(client, body).json()
    driver(settings).advance(study["id"])
    (first,) = trials(client, study["id"])
    allocation, agent = start_trial(client, settings, first["job_id"])
    lock = "phx-probe==1.0 \\\n    --hash=sha256:aa\n"
    url = f"/api/v1/agents/{agent}/allocations/{allocation}/environment"
    assert client.post(url, json={"lock": lock}, headers=as_agent(agent)).json() == {"lock": lock}
    report(client, allocation, {1: {"loss": 0.5}})
    finish(client, allocation, agent)
    assert driver(settings).advance(study["id"]) == 1
    second = trials(client, study["id"])[1]
    assert client.get(f"/api/v1/jobs/{second['job_id']}", headers=USER).json()["env_lock"] == lock
    work = client.get(f"/api/v1/agents/{agent}/work", headers=as_agent(agent)).json()["assignments"]
    with session_scope(settings.database_url) as session:
        from scheduler.service import schedule_pass

        schedule_pass(session)
    assigned = [
        a
        for agent_id in [a["id"] for a in client.get("/api/v1/agents", headers=USER).json()]
        for a in client.get(f"/api/v1/agents/{agent_id}/work", headers=as_agent(agent_id)).json()["assignments"]
    ]
    assert work == [] and [a["env_lock"] for a in assigned] == [lock]  # no node of it resolves again
