"""Hyperparameter studies on the whole stack: Optuna drives real trial jobs through real agents."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import optuna
import pytest
import yaml

from phalanx.client import Client, load_job_file, load_study_file
from phalanx.schemas import JobState, StudyDetail, StudySpec, StudyState, TrialState
from stack.embedded import EmbeddedStack
from tests.processes import REPO, Stack, cli, free_port, wait_for

pytestmark = pytest.mark.e2e
DIGITS_STUDY = REPO / "examples" / "digits" / "study.yaml"
SCRIPTED = REPO / "examples" / "scripted" / "job.yaml"


def optuna_trials(stack: Stack, study: StudyDetail) -> list[optuna.trial.FrozenTrial]:
    """The study as optuna-dashboard sees it: Optuna's own API on the platform's database."""
    storage = optuna.storages.RDBStorage(stack.env["PHALANX_DATABASE_URL"], skip_table_creation=True)
    try:
        return optuna.load_study(study_name=study.optuna_study_name, storage=storage).get_trials()
    finally:
        storage.engine.dispose()


def dashboard_trials(stack: Stack, study: StudyDetail, tmp_path: Path) -> list[dict[str, Any]]:
    """The study's trials as optuna-dashboard, pointed at the platform's database, serves them."""
    port = free_port()
    argv = [str(Path(sys.executable).parent / "optuna-dashboard"), stack.env["PHALANX_DATABASE_URL"]]
    with open(tmp_path / "optuna-dashboard.log", "wb") as out:
        proc = subprocess.Popen([*argv, "--port", str(port), "--server", "wsgiref"], stdout=out, stderr=out)
    try:
        url = f"http://127.0.0.1:{port}"

        def studies() -> Any:
            try:
                return httpx.get(f"{url}/api/studies", timeout=5).json()["study_summaries"]
            except httpx.TransportError:
                assert proc.poll() is None, (tmp_path / "optuna-dashboard.log").read_text()
                return None

        listed = wait_for(studies, 60, "optuna-dashboard to answer")
        (summary,) = [s for s in listed if s["study_name"] == study.optuna_study_name]
        detail = httpx.get(f"{url}/api/studies/{summary['study_id']}", timeout=30).json()
        return list(detail["trials"])
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def assert_parallelism_kept(client: Client, study: StudyDetail) -> None:
    """Never more trial jobs in flight (queued to ended, by the database clock) than allowed."""
    spans = []
    for trial in study.trials:
        job = client.get_job(trial.job_id)
        assert job.ended_at is not None
        spans.append((job.submitted_at, job.ended_at))
    for start, _ in spans:
        in_flight = sum(1 for s, e in spans if s <= start < e)
        assert in_flight <= study.spec.parallelism, spans


def scripted_study(**overrides: Any) -> tuple[StudySpec, Any]:
    """A study over the scripted workload: x in [0, 1], loss = (x - 0.3)^2 + 1/(step + 1)."""
    job, workdir = load_job_file(SCRIPTED)
    trial = job.model_dump(mode="json", exclude={"name"})
    trial["resources"] = {"nodes": 1, "slots_per_node": 1}
    trial["hyperparameters"] = {"steps": 10, "step_seconds": 0.05}
    body = {
        "name": "scripted-study",
        "objective": {"metric": "loss", "direction": "minimize"},
        "search_space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
        "sampler": {"type": "random", "seed": 1},
        "n_trials": 6,
        "parallelism": 2,
        "trial": trial,
        **overrides,
    }
    return StudySpec.model_validate(body), workdir


def test_tpe_study_with_median_pruning_on_the_digits_example(stack: Stack, tmp_path: Path) -> None:
    spec, workdir = load_study_file(DIGITS_STUDY)
    trial = spec.trial.model_copy(update={"entrypoint": "python train.py --epochs 40"})
    # Two good configurations complete first, so the median pruner has its two startup trials
    # when the deliberately bad ones (a learning rate that barely moves) report.
    good = {"lr": 0.05, "hidden": 64, "optimizer": "sgd"}
    bad = {"lr": 0.0001, "hidden": 16, "optimizer": "sgd"}
    spec = spec.model_copy(update={"trial": trial, "enqueue": [good, {**good, "hidden": 32}, bad, bad]})
    spec = StudySpec.model_validate(spec.model_dump())
    with stack.client() as client:
        created = client.create_study(spec, workdir)
        study = client.wait_study(created.id, timeout=600)
        assert study.state is StudyState.COMPLETED, study.reason
        assert len(study.trials) == spec.n_trials == 8
        states = [t.state for t in study.trials]
        assert TrialState.PRUNED in states, [(t.number, t.state, t.values, t.last_step) for t in study.trials]
        for t in study.trials:
            job = client.get_job(t.job_id)
            assert (job.study_id, job.trial_number) == (study.id, t.number)
            assert job.spec.hyperparameters["lr"] == t.params["lr"]
            assert {TrialState.PRUNED: JobState.PRUNED, TrialState.COMPLETE: JobState.COMPLETED}.get(
                t.state, job.state
            ) is job.state
        complete = [t for t in study.trials if t.state is TrialState.COMPLETE]
        best_value = max(t.values[0] for t in complete if t.values)
        assert study.best_values == [best_value]
        best = client.best_trials(study.id)
        assert [(t.number, t.values) for t in best.trials] == [(study.best_trial, [best_value])]
        assert_parallelism_kept(client, study)
        importance = client.param_importances(study.id)
        assert set(importance.importances) == {"lr", "hidden", "optimizer"}, importance.note

    trials = optuna_trials(stack, study)
    assert len(trials) == 8
    unfinished = (optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.WAITING)
    assert not [t.number for t in trials if t.state in unfinished]
    assert {t.number: t.state.name for t in trials} == {t.number: t.state.value for t in study.trials}
    assert all(t.user_attrs["phalanx_job_id"] == s.job_id for t, s in zip(trials, study.trials, strict=True))
    pruned = [t for t in trials if t.state is optuna.trial.TrialState.PRUNED]
    assert all(t.intermediate_values for t in pruned)
    shown = dashboard_trials(stack, study, tmp_path)
    assert [(t["number"], t["state"].upper()) for t in shown] == [(t.number, t.state.value) for t in study.trials]


def test_a_trial_that_always_crashes_fails_and_max_failed_trials_stops_the_study(stack: Stack) -> None:
    spec, workdir = scripted_study(
        n_trials=10,
        parallelism=1,
        max_failed_trials=2,
        search_space={"crash_step": {"type": "int", "low": 2, "high": 4}},
    )
    spec.trial.hyperparameters.update({"crash_rank": 0, "exit_code": 3})
    with stack.client() as client:
        created = client.create_study(spec, workdir)
        study = client.wait_study(created.id, timeout=300)
    assert study.state is StudyState.FAILED and "max_failed_trials is 2" in (study.reason or "")
    assert [t.state for t in study.trials] == [TrialState.FAIL, TrialState.FAIL]
    assert all("exited with code 3" in (t.reason or "") for t in study.trials)
    trials = optuna_trials(stack, study)
    assert [t.state for t in trials] == [optuna.trial.TrialState.FAIL] * 2
    assert all("exited with code 3" in t.system_attrs["fail_reason"] for t in trials)


def test_control_plane_killed_mid_study_completes_with_exactly_n_trials(stack: Stack) -> None:
    """kill -9 the scheduler (the driver) and the server while trials run; once they are back the
    study completes with exactly n_trials trials, each told once."""
    spec, workdir = scripted_study(n_trials=6, parallelism=2)
    with stack.client() as client:
        created = client.create_study(spec, workdir)
        wait_for(
            lambda: sum(t.state is TrialState.COMPLETE for t in client.get_study(created.id).trials) >= 2,
            180,
            "two complete trials",
        )
        stack.stop("scheduler", signal.SIGKILL)
        stack.stop("server", signal.SIGKILL)
        stack.start_server()
        stack.start_scheduler()
        study = client.wait_study(created.id, timeout=300)
        assert study.state is StudyState.COMPLETED, study.reason
        assert [t.number for t in study.trials] == list(range(6))
        assert all(t.state is TrialState.COMPLETE for t in study.trials)
        assert len({t.job_id for t in study.trials}) == 6
        assert_parallelism_kept(client, study)
    assert len(optuna_trials(stack, study)) == 6


def expected_intermediate_values(x: float, steps: int) -> dict[int, float]:
    return {step: (x - 0.3) ** 2 + 1 / (step + 1) for step in range(steps)}


def test_a_restarted_trial_stays_one_trial_and_reports_each_step_once(stack: Stack) -> None:
    """Rank 0 crashes in the first attempt; the job restarts from its checkpoint. The study still
    has n_trials trials, and Optuna holds each step's intermediate value once, as reported."""
    steps = 40
    spec, workdir = scripted_study(n_trials=2, parallelism=2)
    spec.trial.hyperparameters.update(
        {
            "steps": steps,
            "crash_rank": 0,
            "crash_step": 25,
            "crash_attempt": 1,
            "crash_exit_code": 9,
            "checkpoint_every": 10,
        }
    )
    spec = spec.model_copy(update={"trial": spec.trial.model_copy(update={"max_restarts": 1})})
    with stack.client() as client:
        created = client.create_study(spec, workdir)
        study = client.wait_study(created.id, timeout=300)
        assert study.state is StudyState.COMPLETED, study.reason
        assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
        for trial in study.trials:
            job = client.get_job(trial.job_id)
            assert job.attempts == 2 and job.restarts_used == 1 and job.allocations[1].resume_step == 20
        for frozen, trial in zip(optuna_trials(stack, study), study.trials, strict=True):
            # Optuna holds exactly the points Phalanx shows: each step once. (The crash may lose the
            # steps its rank had not sent yet: os._exit, like a real crash.)
            points = {p.step: p.value for p in client.metrics(trial.job_id, name="loss") if p.rank == 0}
            assert frozen.intermediate_values == points
            x = float(trial.params["x"])
            assert set(range(21, steps)) <= set(points)  # the resumed attempt's steps
            assert points == pytest.approx(
                {s: v for s, v in expected_intermediate_values(x, steps).items() if s in points}
            )
            assert frozen.value == pytest.approx((x - 0.3) ** 2 + 1 / steps)


def test_stop_pauses_the_running_trials_and_resume_carries_on_from_their_checkpoints(stack: Stack) -> None:
    steps = 100
    spec, workdir = scripted_study(n_trials=3, parallelism=2)
    spec.trial.hyperparameters.update({"steps": steps, "checkpoint_every": 10})
    with stack.client() as client:
        created = client.create_study(spec, workdir)

        def two_trials_training() -> bool:
            trials = client.get_study(created.id).trials
            return len(trials) == 2 and all((client.get_job(t.job_id).latest_step or 0) >= 20 for t in trials)

        wait_for(two_trials_training, 120, "two trials past step 20")
        assert client.stop_study(created.id).state is StudyState.STOPPED
        paused = client.get_study(created.id).trials
        assert [t.job_state for t in paused] == [JobState.PAUSED] * 2
        wait_for(
            lambda: all(
                n.state.value == "EXITED" for t in paused for n in client.get_job(t.job_id).allocations[-1].nodes
            ),
            60,
            "the paused trials' workers to leave",
        )
        assert len(client.get_study(created.id).trials) == 2  # a stopped study starts no trial
        assert {t.state for t in optuna_trials(stack, client.get_study(created.id))} == {
            optuna.trial.TrialState.RUNNING
        }

        assert client.resume_study(created.id).state is StudyState.RUNNING
        study = client.wait_study(created.id, timeout=300)
        assert study.state is StudyState.COMPLETED, study.reason
        assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 3
        for trial in study.trials[:2]:
            job = client.get_job(trial.job_id)
            assert job.attempts == 2 and job.allocations[1].resume_step is not None
    for frozen, trial in zip(optuna_trials(stack, study), study.trials, strict=True):
        assert frozen.intermediate_values == pytest.approx(
            expected_intermediate_values(float(trial.params["x"]), steps)
        )


def test_cli_studies(stack: Stack, tmp_path: Path) -> None:
    spec, _ = scripted_study(n_trials=3)
    body = spec.model_dump(mode="json")
    body["trial"]["workdir"] = str(SCRIPTED.parent)
    study_file = tmp_path / "study.yaml"
    study_file.write_text(yaml.safe_dump(body))
    finished = json.loads(cli(stack, "studies", "create", str(study_file), "--wait", "--json").stdout)
    assert finished["state"] == "COMPLETED"
    shown = json.loads(cli(stack, "studies", "show", str(finished["id"]), "--json").stdout)
    assert len(shown["trials"]) == 3 and set(shown["importance"]) >= {"method", "importances"}
    best = json.loads(cli(stack, "studies", "best", str(finished["id"]), "--json").stdout)
    assert best["trials"][0]["number"] == shown["best_trial"]
    listed = json.loads(cli(stack, "studies", "list", "--json").stdout)
    assert [s["id"] for s in listed] == [finished["id"]]
    table = cli(stack, "studies", "show", str(finished["id"])).stdout
    assert "★" in table and "best so far" in table
    assert "3/3" in cli(stack, "studies", "list").stdout

    created = json.loads(cli(stack, "studies", "create", str(study_file), "--json").stdout)
    assert json.loads(cli(stack, "studies", "stop", str(created["id"]), "--json").stdout)["state"] == "STOPPED"
    assert json.loads(cli(stack, "studies", "resume", str(created["id"]), "--json").stdout)["state"] == "RUNNING"

    study_file.write_text(yaml.safe_dump({**body, "sampler": "simulated-annealing"}))
    refused = cli(stack, "studies", "create", str(study_file), ok=False)
    assert refused.returncode == 2 and "sampler" in refused.stderr and "simulated-annealing" in refused.stderr
    missing = cli(stack, "studies", "show", "4242", ok=False)
    assert missing.returncode == 1 and "does not exist" in missing.stderr


def test_a_study_on_the_embedded_stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`phalanx up`'s stack: SQLite holds Optuna's tables too, the driver's lock is an flock."""
    for name in [k for k in os.environ if k.startswith("PHALANX_")]:
        monkeypatch.delenv(name)
    data = tmp_path / "data"
    spec, workdir = scripted_study(n_trials=4, parallelism=2, pruner={"type": "median", "n_startup_trials": 1})
    with EmbeddedStack(port=free_port(), data_dir=data, agents=2, cpu_slots=1) as embedded, embedded.client() as client:
        created = client.create_study(spec, workdir)
        study = client.wait_study(created.id, timeout=300)
        assert study.state is StudyState.COMPLETED, study.reason
        assert len(study.trials) == 4 and all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in study.trials)
    storage = optuna.storages.RDBStorage(f"sqlite:///{data / 'phalanx.db'}", skip_table_creation=True)
    try:
        frozen = optuna.load_study(study_name=study.optuna_study_name, storage=storage).get_trials()
    finally:
        storage.engine.dispose()
    assert [(t.number, t.state.name) for t in frozen] == [(t.number, t.state.value) for t in study.trials]
