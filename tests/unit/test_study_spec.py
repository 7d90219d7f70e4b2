"""Study files: what validates, what each mistake is called, and how a spec maps onto Optuna."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import optuna
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from pydantic import ValidationError

from phalanx.client import load_study_file
from phalanx.schemas import StudySpec
from server import tuning
from server.studies import trial_job_spec

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "digits" / "study.yaml"


def study(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": "s",
        "objective": {"metric": "loss"},
        "search_space": {"lr": {"type": "float", "low": 1e-4, "high": 1.0, "log": True}},
        "n_trials": 4,
        "trial": {"entrypoint": "python train.py"},
    }
    body.update(overrides)
    return body


def problem(body: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as caught:
        StudySpec.model_validate(body)
    return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in caught.value.errors())


def test_the_example_study_validates() -> None:
    spec, workdir = load_study_file(EXAMPLE)
    assert set(spec.search_space) == {"lr", "hidden", "optimizer"}
    assert spec.sampler.type == "tpe" and spec.pruner.type == "median" and spec.parallelism == 2
    assert (workdir / "train.py").exists()


def test_the_transformers_study_searches_trainingarguments_fields() -> None:
    from transformers import TrainingArguments  # the fields pxt.training_args() takes from a trial

    spec, _ = load_study_file(EXAMPLE.parents[1] / "hf_trainer" / "study.yaml")
    fields = {field.name for field in dataclasses.fields(TrainingArguments)}
    assert set(spec.search_space) <= fields


def test_defaults_and_shorthands() -> None:
    spec = StudySpec.model_validate(study(sampler="random", pruner="hyperband"))
    assert spec.sampler.type == "random" and spec.pruner.type == "hyperband"
    plain = StudySpec.model_validate(study())
    assert plain.sampler.type == "tpe" and plain.pruner.type == "none" and plain.parallelism == 1
    assert plain.objectives[0].direction.value == "minimize" and not plain.multi_objective


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"search_space": {}}, "search_space: Value error, the search space is empty"),
        ({"sampler": "bayes"}, "sampler: Input tag 'bayes'"),
        ({"pruner": {"type": "early"}}, "pruner: Input tag 'early'"),
        ({"parallelism": 0}, "parallelism: Input should be greater than or equal to 1"),
        ({"n_trials": 0}, "n_trials: Input should be greater than or equal to 1"),
        (
            {"search_space": {"lr": {"type": "float", "low": 1.0, "high": 0.1}}},
            "search_space.lr.float: Value error, low (1.0) is above high (0.1)",
        ),
        (
            {"search_space": {"lr": {"type": "float", "low": 0.0, "high": 1.0, "log": True}}},
            "search_space.lr.float: Value error, log needs low > 0",
        ),
        (
            {"search_space": {"n": {"type": "int", "low": 0, "high": 10, "step": 3}}},
            "search_space.n.int: Value error, high - low (10) is not a multiple of step (3)",
        ),
        ({"search_space": {"o": {"type": "categorical", "choices": []}}}, "search_space.o.categorical.choices"),
        (
            {"search_space": {"o": {"type": "categorical", "choices": ["a", "a"]}}},
            "choices must be distinct",
        ),
        ({"search_space": {"o": {"type": "normal"}}}, "search_space.o: Input tag 'normal'"),
        (
            {"objective": [{"metric": "loss"}, {"metric": "latency"}], "pruner": "median"},
            "pruner: median needs a single objective",
        ),
        (
            {"objective": [{"metric": "loss"}, {"metric": "latency"}], "sampler": "cmaes"},
            "sampler: cmaes handles a single objective",
        ),
        ({"objective": [{"metric": "loss"}, {"metric": "loss"}]}, "objective: a metric appears twice"),
        ({"sampler": "grid"}, "search_space.lr: the grid sampler needs a finite set of values"),
        (
            {"sampler": "grid", "search_space": {"n": {"type": "int", "low": 1, "high": 2}}},
            "n_trials (4) is above the grid's 2 combinations",
        ),
        ({"enqueue": [{"momentum": 0.9}]}, "enqueue[0].momentum is not in the search space"),
        ({"enqueue": [{"lr": 5.0}]}, "enqueue[0].lr: 5.0 is outside [0.0001, 1.0]"),
        ({"enqueue": [{}] * 5}, "enqueue: 5 configurations but n_trials is 4"),
        ({"trial": {"entrypoint": "python t.py", "name": "x"}}, "trial.name is not used"),
        ({"trial": {"entrypoint": "python t.py", "env": {"RANK": "1"}}}, "trial.env"),
        ({"target_value": 0.1, "objective": [{"metric": "a"}, {"metric": "b"}]}, "target_value needs a single"),
        ({"name": "has space"}, "name: String should match pattern"),
    ],
)
def test_each_mistake_names_its_field(overrides: dict[str, Any], named: str) -> None:
    assert named in problem(study(**overrides))


WIDE = {"type": "int", "low": 0, "high": 10**15}


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        # counted, never made: these grids would not fit in any memory
        (
            {"sampler": "grid", "search_space": {"a": WIDE, "b": WIDE}},
            "about 10^30 combinations, above the limit of 1,000,000",
        ),
        (
            {"sampler": "grid", "search_space": {"a": {"type": "float", "low": 0, "high": 1e6, "step": 1e-6}}},
            "above the limit of 1,000,000",
        ),
        ({"search_space": {"a": {"type": "float", "low": -1e308, "high": 1e308}}}, "past the largest float"),
        ({"search_space": {"a": {"type": "float", "low": float("nan"), "high": 1.0}}}, "finite number"),
        ({"search_space": {"a": {"type": "int", "low": 0, "high": 2**60}}}, "less than or equal to 9007199254740992"),
        (
            {"search_space": {f"p{i}": WIDE for i in range(101)}},
            "search_space: Dictionary should have at most 100 items",
        ),
        ({"search_space": {"p" * 129: WIDE}}, "at most 128 characters"),
        ({"search_space": {"c": {"type": "categorical", "choices": list(range(1001))}}}, "at most 1000 items"),
        ({"search_space": {"c": {"type": "categorical", "choices": ["x" * 257]}}}, "at most 256 characters"),
        ({"sampler": {"type": "random", "seed": -1}}, "sampler.random.seed"),
        ({"sampler": {"type": "random", "seed": 2**32}}, "less than or equal to 4294967295"),
        ({"pruner": {"type": "successive_halving", "min_early_stopping_rate": 10**9}}, "less than or equal to 64"),
        ({"objective": [{"metric": f"m{i}"} for i in range(17)]}, "at most 16 items"),
        ({"timeout": float("inf")}, "timeout: Input should be a finite number"),
        ({"target_value": float("nan")}, "target_value: Input should be a finite number"),
        (
            {
                "search_space": {f"p{i}": {"type": "categorical", "choices": ["x" * 250]} for i in range(100)},
                "trial": {"entrypoint": "python t.py", "hyperparameters": {f"h{i}": "y" * 16_000 for i in range(3)}},
            },
            "a trial's hyperparameters could take",
        ),
    ],
)
def test_every_bound_of_a_study_names_its_field_and_limit(overrides: dict[str, Any], named: str) -> None:
    assert named in problem(study(**overrides))


def test_a_trial_job_is_the_template_with_the_sampled_parameters() -> None:
    spec = StudySpec.model_validate(
        study(name="tune", trial={"entrypoint": "python t.py", "hyperparameters": {"lr": 0.1, "epochs": 3}})
    )
    job = trial_job_spec(spec, 7, {"lr": 0.01})
    assert job.name == "tune-t7" and job.hyperparameters == {"lr": 0.01, "epochs": 3}
    assert job.entrypoint == "python t.py"
    assert "name" not in spec.model_dump()["trial"]  # a dumped spec validates again
    assert StudySpec.model_validate(spec.model_dump()) == spec


finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(low=finite, span=st.floats(min_value=1e-3, max_value=1e6), log=st.booleans(), seed=st.integers(0, 2**31))
def test_float_parameters_sample_inside_their_range(low: float, span: float, log: bool, seed: int) -> None:
    if log:
        low = abs(low) + 1e-3
    high = low + span
    spec = StudySpec.model_validate(study(search_space={"p": {"type": "float", "low": low, "high": high, "log": log}}))
    (dist,) = tuning.distributions(spec).values()
    assert isinstance(dist, FloatDistribution) and dist.log is log and (dist.low, dist.high) == (low, high)
    value = optuna.samplers.RandomSampler(seed=seed).sample_independent(None, None, "p", dist)  # type: ignore[arg-type]
    assert low <= value <= high


@settings(max_examples=60, deadline=None)
@given(low=st.integers(-1000, 1000), steps=st.integers(0, 50), step=st.integers(1, 20))
def test_int_parameters_and_their_grid(low: int, steps: int, step: int) -> None:
    high = low + steps * step
    spec = StudySpec.model_validate(
        study(sampler="grid", n_trials=1, search_space={"n": {"type": "int", "low": low, "high": high, "step": step}})
    )
    (dist,) = tuning.distributions(spec).values()
    assert isinstance(dist, IntDistribution) and dist.step == step
    grid = spec.grid()["n"]
    assert len(grid) == steps + 1 and all(dist._contains(dist.to_internal_repr(v)) for v in grid)


@settings(max_examples=40, deadline=None)
@given(low=st.floats(-100, 100), count=st.integers(1, 40), step=st.sampled_from([0.1, 0.25, 0.5, 1.0, 2.5]))
def test_float_grids_hit_both_ends(low: float, count: int, step: float) -> None:
    high = low + count * step
    spec = StudySpec.model_validate(
        study(sampler="grid", n_trials=1, search_space={"x": {"type": "float", "low": low, "high": high, "step": step}})
    )
    grid = spec.grid()["x"]
    assert len(grid) == count + 1
    assert math.isclose(grid[0], low) and math.isclose(grid[-1], high, abs_tol=1e-9)


def test_categorical_parameters_map_to_their_choices() -> None:
    spec = StudySpec.model_validate(study(search_space={"o": {"type": "categorical", "choices": ["sgd", "adam", 3]}}))
    (dist,) = tuning.distributions(spec).values()
    assert isinstance(dist, CategoricalDistribution) and dist.choices == ("sgd", "adam", 3)


@pytest.mark.parametrize(
    ("sampler", "kind"),
    [
        ({"type": "tpe", "seed": 1}, optuna.samplers.TPESampler),
        ({"type": "random"}, optuna.samplers.RandomSampler),
        ({"type": "cmaes"}, optuna.samplers.CmaEsSampler),
        ({"type": "gp"}, optuna.samplers.GPSampler),
        ({"type": "nsga2", "population_size": 8}, optuna.samplers.NSGAIISampler),
    ],
)
def test_samplers(sampler: dict[str, Any], kind: type) -> None:
    assert isinstance(tuning.sampler(StudySpec.model_validate(study(sampler=sampler))), kind)


def test_the_grid_sampler_gets_every_combination() -> None:
    space = {"n": {"type": "int", "low": 1, "high": 3}, "o": {"type": "categorical", "choices": ["a", "b"]}}
    spec = StudySpec.model_validate(study(sampler="grid", n_trials=6, search_space=space))
    sampler = tuning.sampler(spec)
    assert isinstance(sampler, optuna.samplers.GridSampler)
    study_ = optuna.create_study(sampler=sampler)
    seen = set()
    for _ in range(6):
        trial = study_.ask(tuning.distributions(spec))
        seen.add((trial.params["n"], trial.params["o"]))
        study_.tell(trial, 1.0)
    assert seen == {(n, o) for n in (1, 2, 3) for o in ("a", "b")}


def test_seeded_samplers_draw_per_trial_number_not_per_pass() -> None:
    """Rebuilt for each ask (as the driver does), a seeded sampler draws a new point per trial
    number, and the same one again for the same number (a restarted driver repeats nothing)."""
    spec = StudySpec.model_validate(study(sampler={"type": "random", "seed": 3}))
    dist = tuning.distributions(spec)["lr"]

    def draw(number: int) -> float:
        return float(tuning.sampler(spec, trial_number=number).sample_independent(None, None, "lr", dist))  # type: ignore[arg-type]

    assert draw(0) == draw(0) and len({draw(n) for n in range(5)}) == 5


@pytest.mark.parametrize(
    ("pruner", "kind"),
    [
        ({"type": "median", "n_warmup_steps": 3}, optuna.pruners.MedianPruner),
        ({"type": "percentile", "percentile": 25}, optuna.pruners.PercentilePruner),
        ({"type": "successive_halving"}, optuna.pruners.SuccessiveHalvingPruner),
        ({"type": "hyperband", "max_resource": 30}, optuna.pruners.HyperbandPruner),
        ({"type": "none"}, optuna.pruners.NopPruner),
    ],
)
def test_pruners(pruner: dict[str, Any], kind: type) -> None:
    assert isinstance(tuning.pruner(StudySpec.model_validate(study(pruner=pruner))), kind)


def test_directions() -> None:
    spec = StudySpec.model_validate(
        study(objective=[{"metric": "acc", "direction": "maximize"}, {"metric": "latency"}], sampler="nsga2")
    )
    assert tuning.directions(spec) == [optuna.study.StudyDirection.MAXIMIZE, optuna.study.StudyDirection.MINIMIZE]
