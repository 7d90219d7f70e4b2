"""What users write: a job file maps 1:1 onto `JobSpec`, a study file onto `StudySpec`.

Every inconsistency Optuna (or the launcher) would trip over later is refused here, naming the field.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from phalanx.schemas._base import NAME_PATTERN, StrictModel
from phalanx.schemas.enums import Direction, Precision, SlotType

ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Variables the platform itself sets for every rank; a job may not override them.
RESERVED_ENV_PREFIXES = ("PHALANX_", "MASTER_", "TORCHELASTIC_")
RESERVED_ENV_KEYS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"}


class Resources(StrictModel):
    nodes: int = Field(1, ge=1, le=1024, description="Number of nodes (agents) in the gang.")
    slots_per_node: int = Field(1, ge=1, le=256, description="Worker processes (ranks) per node.")
    slot_type: SlotType = SlotType.CPU

    @property
    def world_size(self) -> int:
        return self.nodes * self.slots_per_node


class CheckpointPolicy(StrictModel):
    keep_last: int = Field(2, ge=1, description="Keep the newest N checkpoints (at least 1: the resume point).")
    keep_best: int = Field(0, ge=0, description="Also keep the best K by `metric`.")
    metric: str | None = None
    mode: Literal["min", "max"] = "min"
    storage: str | None = Field(
        None, description="fsspec URI of the checkpoint root (default: the deployment's PHALANX_CHECKPOINT_URI)."
    )

    @model_validator(mode="after")
    def _best_needs_metric(self) -> CheckpointPolicy:
        if self.keep_best and not self.metric:
            raise ValueError("keep_best needs checkpoint.metric: the reported metric that ranks checkpoints")
        return self


class JobSpec(StrictModel):
    """A job file. Every field a user may write; nothing else is accepted."""

    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    entrypoint: Annotated[str, Field(min_length=1, max_length=4096)]
    workdir: str = "."
    resources: Resources = Field(default_factory=Resources)
    hyperparameters: dict[str, Any] = Field(default_factory=dict)
    precision: Precision = Precision.FP32
    max_restarts: int = Field(0, ge=0, le=1000, description="Restarts after the job's own failures.")
    max_infra_restarts: int = Field(
        10, ge=0, le=1000, description="Restarts after lost agents and preemptions (a separate budget)."
    )
    hang_timeout: float | None = Field(
        None, ge=5, description="Restart when no rank reports a step for this many seconds."
    )
    checkpoint: CheckpointPolicy = Field(default_factory=CheckpointPolicy)
    priority: int = Field(50, ge=0, le=100)
    env: dict[str, str] = Field(default_factory=dict)

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_is_command(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("entrypoint must be a command such as 'python train.py'")
        return value

    @field_validator("env")
    @classmethod
    def _env_keys(cls, env: dict[str, str]) -> dict[str, str]:
        for key in env:
            if not ENV_KEY.match(key):
                raise ValueError(f"env key {key!r} is not a valid variable name")
            if key in RESERVED_ENV_KEYS or key.startswith(RESERVED_ENV_PREFIXES):
                raise ValueError(f"env key {key!r} is set by Phalanx for every rank; choose another name")
        return env


# --- hyperparameter studies ------------------------------------------------------------------
# A study file (YAML) maps 1:1 onto `StudySpec`. Optuna is the engine; these models only say what
# a user may write, and every inconsistency is refused here, before anything is created.

STUDY_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,47}$"  # trial jobs are named "<study>-t<number>"
GridValue = str | int | float | bool | None


class Objective(StrictModel):
    metric: Annotated[str, Field(min_length=1, max_length=128, description="A metric the script reports.")]
    direction: Direction = Direction.MINIMIZE


def _is_multiple(span: float, step: float) -> bool:
    ratio = span / step
    if not math.isfinite(ratio):  # more steps than a float can count (1e308 in steps of 1e-308)
        return False
    return abs(ratio - round(ratio)) <= 1e-9 * max(1.0, abs(ratio))


class FloatParam(StrictModel):
    type: Literal["float"]
    low: float
    high: float
    log: bool = False
    step: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _consistent(self) -> FloatParam:
        if self.low > self.high:
            raise ValueError(f"low ({self.low}) is above high ({self.high})")
        if self.log and self.low <= 0:
            raise ValueError(f"log needs low > 0 (low is {self.low})")
        if self.log and self.step is not None:
            raise ValueError("step and log cannot be used together")
        if self.step is not None and not _is_multiple(self.high - self.low, self.step):
            raise ValueError(f"high - low ({self.high - self.low:g}) is not a multiple of step ({self.step:g})")
        return self

    def grid(self) -> list[GridValue] | None:
        if self.step is None:
            return None
        count = round((self.high - self.low) / self.step) + 1
        return [self.low + i * self.step for i in range(count)]


class IntParam(StrictModel):
    type: Literal["int"]
    low: int
    high: int
    step: int = Field(1, ge=1)
    log: bool = False

    @model_validator(mode="after")
    def _consistent(self) -> IntParam:
        if self.low > self.high:
            raise ValueError(f"low ({self.low}) is above high ({self.high})")
        if self.log and self.low < 1:
            raise ValueError(f"log needs low >= 1 (low is {self.low})")
        if self.log and self.step != 1:
            raise ValueError("step and log cannot be used together")
        if (self.high - self.low) % self.step:
            raise ValueError(f"high - low ({self.high - self.low}) is not a multiple of step ({self.step})")
        return self

    def grid(self) -> list[GridValue] | None:
        return list(range(self.low, self.high + 1, self.step))


class CategoricalParam(StrictModel):
    type: Literal["categorical"]
    choices: Annotated[list[GridValue], Field(min_length=1)]

    @field_validator("choices")
    @classmethod
    def _distinct(cls, choices: list[GridValue]) -> list[GridValue]:
        seen = [repr(c) for c in choices]
        if len(set(seen)) != len(seen):
            raise ValueError("choices must be distinct")
        return choices

    def grid(self) -> list[GridValue] | None:
        return list(self.choices)


Param = Annotated[FloatParam | IntParam | CategoricalParam, Field(discriminator="type")]


class _Seeded(StrictModel):
    seed: int | None = Field(None, description="Makes the sampling reproducible.")


class TpeSampler(_Seeded):
    type: Literal["tpe"]
    n_startup_trials: int = Field(10, ge=0)
    multivariate: bool = False
    # Parallel trials: pretend the running ones scored badly, so two workers don't sample one point.
    constant_liar: bool = True


class RandomSampler(_Seeded):
    type: Literal["random"]


class GridSampler(_Seeded):
    type: Literal["grid"]


class CmaEsSampler(_Seeded):
    type: Literal["cmaes"]
    n_startup_trials: int = Field(1, ge=0)
    sigma0: float | None = Field(None, gt=0)


class GpSampler(_Seeded):
    type: Literal["gp"]
    n_startup_trials: int = Field(10, ge=0)


class NsgaIISampler(_Seeded):
    type: Literal["nsga2"]
    population_size: int = Field(50, ge=2)


Sampler = Annotated[
    TpeSampler | RandomSampler | GridSampler | CmaEsSampler | GpSampler | NsgaIISampler, Field(discriminator="type")
]


class _Windowed(StrictModel):
    n_startup_trials: int = Field(5, ge=0, description="Prune nothing until this many trials completed.")
    n_warmup_steps: int = Field(0, ge=0, description="Prune no trial before this step.")
    interval_steps: int = Field(1, ge=1)


class MedianPruner(_Windowed):
    type: Literal["median"]


class PercentilePruner(_Windowed):
    type: Literal["percentile"]
    percentile: float = Field(ge=0, le=100)


class SuccessiveHalvingPruner(StrictModel):
    type: Literal["successive_halving"]
    min_resource: int | Literal["auto"] = "auto"
    reduction_factor: int = Field(4, ge=2)
    min_early_stopping_rate: int = Field(0, ge=0)


class HyperbandPruner(StrictModel):
    type: Literal["hyperband"]
    min_resource: int = Field(1, ge=1)
    max_resource: int | Literal["auto"] = "auto"
    reduction_factor: int = Field(3, ge=2)


class NoPruner(StrictModel):
    type: Literal["none"]


Pruner = Annotated[
    MedianPruner | PercentilePruner | SuccessiveHalvingPruner | HyperbandPruner | NoPruner,
    Field(discriminator="type"),
]


def _tagged(value: Any) -> Any:
    """`sampler: tpe` is short for `sampler: {type: tpe}` (likewise pruners)."""
    return {"type": value} if isinstance(value, str) else value


class TrialTemplate(JobSpec):
    """The job every trial runs: a job file without its name (trials are named after the study).
    The sampled parameters are merged over `hyperparameters`."""

    name: Annotated[str, Field(pattern=NAME_PATTERN, exclude=True)] = "trial"  # never written back

    @model_validator(mode="after")
    def _no_name(self) -> TrialTemplate:
        if "name" in self.model_fields_set:
            raise ValueError("trial.name is not used: trial jobs are named <study name>-t<trial number>")
        return self


class StudySpec(StrictModel):
    """A study file. Optuna drives the trials; each trial is a Phalanx job."""

    name: Annotated[str, Field(pattern=STUDY_NAME_PATTERN)]
    objective: Objective | Annotated[list[Objective], Field(min_length=1)] = Field(
        description="The metric to optimise, or a list of them (multi-objective)."
    )
    search_space: dict[str, Param]
    sampler: Sampler = Field(default_factory=lambda: TpeSampler(type="tpe"))
    pruner: Pruner = Field(default_factory=lambda: NoPruner(type="none"))
    n_trials: int = Field(ge=1, le=10_000, description="Trials to run in all, whatever their outcome.")
    parallelism: int = Field(1, ge=1, le=1000, description="Trials in flight at most (queued or running).")
    max_failed_trials: int | None = Field(None, ge=1, description="Fail the study after this many failed trials.")
    timeout: float | None = Field(None, gt=0, description="Start no trial after this many seconds of running.")
    target_value: float | None = Field(None, description="Stop once a trial reaches this value.")
    enqueue: list[dict[str, Any]] = Field(default_factory=list, description="Configurations to try first.")
    trial: TrialTemplate

    @field_validator("sampler", "pruner", mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return _tagged(value)

    @field_validator("search_space")
    @classmethod
    def _not_empty(cls, space: dict[str, Any]) -> dict[str, Any]:
        if not space:
            raise ValueError("the search space is empty: give at least one parameter, e.g. lr: {type: float, ...}")
        return space

    @property
    def objectives(self) -> list[Objective]:
        return self.objective if isinstance(self.objective, list) else [self.objective]

    @property
    def multi_objective(self) -> bool:
        return len(self.objectives) > 1

    def grid(self) -> dict[str, list[GridValue]]:
        """Every parameter's values for the grid sampler; raises naming a continuous parameter."""
        values = {}
        for name, param in self.search_space.items():
            points = param.grid()
            if points is None:
                raise ValueError(
                    f"search_space.{name}: the grid sampler needs a finite set of values; give it a step "
                    "or make it categorical"
                )
            values[name] = points
        return values

    @model_validator(mode="after")
    def _consistent(self) -> StudySpec:
        metrics = [o.metric for o in self.objectives]
        if len(set(metrics)) != len(metrics):
            raise ValueError(f"objective: a metric appears twice ({', '.join(metrics)})")
        if self.multi_objective:
            if self.pruner.type != "none":
                raise ValueError(
                    f"pruner: {self.pruner.type} needs a single objective; use pruner: none with several objectives"
                )
            if self.sampler.type == "cmaes":
                raise ValueError("sampler: cmaes handles a single objective; use nsga2, tpe or gp for several")
            if self.target_value is not None:
                raise ValueError("target_value needs a single objective")
        if self.sampler.type == "grid":
            size = 1
            for points in self.grid().values():
                size *= len(points)
            if self.n_trials > size:
                raise ValueError(f"n_trials ({self.n_trials}) is above the grid's {size} combinations; lower n_trials")
        if len(self.enqueue) > self.n_trials:
            raise ValueError(f"enqueue: {len(self.enqueue)} configurations but n_trials is {self.n_trials}")
        for index, params in enumerate(self.enqueue):
            for name, value in params.items():
                if name not in self.search_space:
                    raise ValueError(f"enqueue[{index}].{name} is not in the search space")
                problem = _outside(self.search_space[name], value)
                if problem:
                    raise ValueError(f"enqueue[{index}].{name}: {problem}")
        return self


def _outside(param: FloatParam | IntParam | CategoricalParam, value: Any) -> str | None:
    if isinstance(param, CategoricalParam):
        return None if value in param.choices else f"{value!r} is not one of the choices {param.choices}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"{value!r} is not a number"
    if isinstance(param, IntParam) and not float(value).is_integer():
        return f"{value!r} is not an integer"
    if not param.low <= value <= param.high:
        return f"{value!r} is outside [{param.low}, {param.high}]"
    return None
