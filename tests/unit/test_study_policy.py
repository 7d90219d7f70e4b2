"""The study driver's policy (`plan`): pure, so every case is a table row."""

from __future__ import annotations

from typing import Any

import pytest

from phalanx.schemas import JobState, StudySpec, StudyState, TrialState
from scheduler.study_driver import Plan, StudySnapshot, TrialSnapshot, plan

S, J = TrialState, JobState


def spec(**overrides: Any) -> StudySpec:
    body: dict[str, Any] = {
        "name": "s",
        "objective": {"metric": "acc", "direction": "maximize"},
        "search_space": {"x": {"type": "float", "low": 0, "high": 1}},
        "n_trials": 6,
        "parallelism": 2,
        "trial": {"entrypoint": "python t.py"},
    }
    return StudySpec.model_validate({**body, **overrides})


def trial(number: int, state: TrialState, job: JobState, value: float | None = None) -> TrialSnapshot:
    return TrialSnapshot(
        row_id=number,
        number=number,
        optuna_trial_id=100 + number,
        job_id=200 + number,
        job_state=job,
        job_failure=None,
        state=state,
        values=None if value is None else (value,),
        reported_step=None,
    )


def snapshot(
    *trials: TrialSnapshot, state: StudyState = StudyState.RUNNING, seconds: float = 0, **kw: Any
) -> StudySnapshot:
    return StudySnapshot(1, state, spec(**kw), "phalanx-1-s", seconds, tuple(trials))


def test_a_new_study_launches_up_to_its_parallelism() -> None:
    assert plan(snapshot()) == Plan(launch=2)
    assert plan(snapshot(parallelism=10)) == Plan(launch=6)  # never past n_trials


def test_running_and_queued_trials_count_against_parallelism() -> None:
    assert plan(snapshot(trial(0, S.RUNNING, J.QUEUED), trial(1, S.RUNNING, J.RUNNING))) == Plan(launch=0)
    assert plan(snapshot(trial(0, S.COMPLETE, J.COMPLETED, 0.5), trial(1, S.RUNNING, J.RUNNING))) == Plan(launch=1)


def test_a_paused_trial_still_holds_its_place() -> None:
    assert plan(snapshot(trial(0, S.RUNNING, J.PAUSED), trial(1, S.RUNNING, J.RUNNING))) == Plan(launch=0)


def test_a_trial_whose_job_ended_but_is_not_told_yet_frees_its_place() -> None:
    assert plan(snapshot(trial(0, S.RUNNING, J.COMPLETED), trial(1, S.RUNNING, J.RUNNING))) == Plan(launch=1)


def test_after_n_trials_the_last_ones_finish_then_the_study_completes() -> None:
    done = [trial(i, S.COMPLETE, J.COMPLETED, 0.1 * i) for i in range(5)]
    assert plan(snapshot(*done, trial(5, S.RUNNING, J.RUNNING))) == Plan()
    finished = plan(snapshot(*done, trial(5, S.PRUNED, J.PRUNED)))
    assert finished.end is StudyState.COMPLETED and "all 6 trials ran" in finished.reason and not finished.cancel


def test_the_study_ends_only_once_every_trial_is_told() -> None:
    done = [trial(i, S.COMPLETE, J.COMPLETED, 0.1 * i) for i in range(5)]
    assert plan(snapshot(*done, trial(5, S.RUNNING, J.COMPLETED))) == Plan()  # ended, not told yet


def test_max_failed_trials_fails_the_study_and_cancels_what_runs() -> None:
    failed = [trial(0, S.FAIL, J.FAILED), trial(1, S.FAIL, J.COMPLETED)]  # a crash; no objective reported
    decided = plan(snapshot(*failed, trial(2, S.RUNNING, J.RUNNING), max_failed_trials=2))
    assert decided.end is StudyState.FAILED and decided.cancel and "max_failed_trials is 2" in decided.reason


def test_a_cancelled_trial_is_not_a_failed_configuration() -> None:
    cancelled = [trial(0, S.FAIL, J.CANCELLED), trial(1, S.FAIL, J.CANCELLED)]
    assert plan(snapshot(*cancelled, max_failed_trials=2)) == Plan(launch=2)


@pytest.mark.parametrize(
    ("direction", "value", "reached"), [("maximize", 0.95, True), ("maximize", 0.8, False), ("minimize", 0.8, True)]
)
def test_the_target_value_completes_the_study(direction: str, value: float, reached: bool) -> None:
    objective = {"metric": "acc", "direction": direction}
    decided = plan(
        snapshot(
            trial(0, S.COMPLETE, J.COMPLETED, value),
            trial(1, S.RUNNING, J.RUNNING),
            target_value=0.9,
            objective=objective,
        )
    )
    if reached:
        assert (
            decided.end is StudyState.COMPLETED and decided.cancel and "reached the target value 0.9" in decided.reason
        )
    else:
        assert decided == Plan(launch=1)


def test_the_timeout_starts_no_trial_and_lets_the_running_ones_finish() -> None:
    assert plan(snapshot(trial(0, S.RUNNING, J.RUNNING), timeout=60, seconds=61)) == Plan()
    decided = plan(snapshot(trial(0, S.COMPLETE, J.COMPLETED, 0.5), timeout=60, seconds=61))
    assert decided.end is StudyState.COMPLETED and "timeout of 60 s" in decided.reason


@pytest.mark.parametrize("state", [StudyState.STOPPED, StudyState.COMPLETED, StudyState.FAILED])
def test_only_a_running_study_does_anything(state: StudyState) -> None:
    assert plan(snapshot(state=state)) == Plan()
