"""What users write: a job file maps 1:1 onto `JobSpec`, a study file onto `StudySpec`.

Every inconsistency Optuna (or the launcher) would trip over later is refused here, naming the field.
Every string, list and map is bounded and every number finite, so that a spec costs a known amount
to store, to launch and to hand to Optuna; each refusal names the field and the limit.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Literal

from packaging.requirements import InvalidRequirement, Requirement
from pydantic import ConfigDict, Field, field_validator, model_validator

from phalanx.schemas._base import NAME_PATTERN, StrictModel
from phalanx.schemas.enums import Direction, Precision, SlotType

ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Variables the platform itself sets for every rank; a job may not override them.
RESERVED_ENV_PREFIXES = ("PHALANX_", "MASTER_", "TORCHELASTIC_")
RESERVED_ENV_KEYS = {
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
}

# Hyperparameters reach the ranks as one environment variable (PHALANX_HPARAMS, JSON), and Linux
# refuses to start a process with a variable over 128 KiB; env and hyperparameters together stay
# well inside the few MiB a process's whole environment may hold.
MAX_ENV_VARS = 256
MAX_ENV_KEY_CHARS = 128
MAX_ENV_VALUE_CHARS = 16_384
MAX_ENV_TOTAL_CHARS = 65_536
MAX_HYPERPARAMETERS = 256
MAX_HYPERPARAMETER_KEY_CHARS = 128
MAX_HYPERPARAMETER_JSON_CHARS = 16_384  # one value, written as JSON
MAX_HYPERPARAMETERS_JSON_CHARS = 65_536  # all of them, as PHALANX_HPARAMS
MAX_PATH_CHARS = 4096
MAX_RETAINED_CHECKPOINTS = 1000
# Studies: what Optuna is handed stays small enough to sample from and to evaluate importance on.
MAX_OBJECTIVES = 16
MAX_SEARCH_SPACE = 100  # parameters
MAX_CHOICES = 1000
MAX_CHOICE_CHARS = 256
MAX_GRID_COMBINATIONS = 1_000_000  # the ceiling; a server may set a lower one (PHALANX_MAX_GRID_COMBINATIONS)
MAX_SEED = 2**32 - 1  # numpy's seeds
MAX_EXACT_INT = 2**53  # Optuna keeps parameters as floats: past this an integer is not kept exactly
MAX_TRIALS = 10_000

Count = Annotated[int, Field(ge=0, le=2**31 - 1)]
Steps = Annotated[int, Field(ge=0, le=2**63 - 1)]
ExactInt = Annotated[int, Field(ge=-MAX_EXACT_INT, le=MAX_EXACT_INT)]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
ParamName = Annotated[str, Field(min_length=1, max_length=MAX_HYPERPARAMETER_KEY_CHARS)]


class SpecModel(StrictModel):
    """A file a person writes: unknown fields refused, and every number finite (NaN and infinity
    are no setting's value)."""

    model_config = ConfigDict(allow_inf_nan=False)


def _json_chars(value: Any) -> int:
    """Characters of `value` as JSON; ValueError naming the problem when JSON cannot write it."""
    try:
        return len(json.dumps(value, allow_nan=False, separators=(",", ":")))
    except ValueError:
        raise ValueError("NaN and Infinity are not allowed (JSON has no such number)") from None
    except (TypeError, RecursionError):
        raise ValueError("not a JSON value") from None


class Resources(SpecModel):
    nodes: int = Field(1, ge=1, le=1024, description="Number of nodes (agents) in the gang.")
    slots_per_node: int = Field(1, ge=1, le=256, description="Worker processes (ranks) per node.")
    slot_type: SlotType = SlotType.CPU

    @property
    def world_size(self) -> int:
        return self.nodes * self.slots_per_node


class CheckpointPolicy(SpecModel):
    keep_last: int = Field(
        2,
        ge=1,
        le=MAX_RETAINED_CHECKPOINTS,
        description="Keep the newest N checkpoints (at least 1: the resume point).",
    )
    keep_best: int = Field(0, ge=0, le=MAX_RETAINED_CHECKPOINTS, description="Also keep the best K by `metric`.")
    metric: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    mode: Literal["min", "max"] = "min"
    storage: Annotated[str, Field(max_length=MAX_PATH_CHARS)] | None = Field(
        None, description="fsspec URI of the checkpoint root (default: the deployment's PHALANX_CHECKPOINT_URI)."
    )

    @model_validator(mode="after")
    def _best_needs_metric(self) -> CheckpointPolicy:
        if self.keep_best and not self.metric:
            raise ValueError("keep_best needs checkpoint.metric: the reported metric that ranks checkpoints")
        return self


# A runtime environment: what a job installs on top of the agents' interpreter (worker_agent/
# environments.py builds it). Requirements are plain names with version specifiers: a URL, a local
# path or a pip option would let a job point every node's installer somewhere the operator did not.
MAX_PIP_REQUIREMENTS = 200
MAX_REQUIREMENT_CHARS = 256


def check_requirement(text: str) -> str:
    """`text` if it is one requirement as a job may give it ("numpy", "six==1.16.0", "attrs>=23;
    python_version>'3.8'"), else ValueError saying what is allowed."""
    stripped = text.strip()
    try:
        parsed = Requirement(stripped)
    except InvalidRequirement:
        parsed = None
    if parsed is None or parsed.url is not None or "\n" in stripped:
        raise ValueError(
            f"{text[:80]!r} is not a requirement this platform installs: give a package name with optional "
            "extras, version specifiers and marker (e.g. 'six==1.16.0'); URLs, paths and pip options are not "
            "accepted (the agents' operator configures the package index)"
        )
    return stripped


class RuntimeEnv(SpecModel):
    """Python packages a job needs beyond the agents' interpreter, installed on every node it runs on."""

    pip: Annotated[
        list[Annotated[str, Field(max_length=MAX_REQUIREMENT_CHARS)]], Field(max_length=MAX_PIP_REQUIREMENTS)
    ] = Field(default_factory=list, description="Requirements such as 'six==1.16.0'.")
    requirements: Annotated[str, Field(min_length=1, max_length=MAX_PATH_CHARS)] | None = Field(
        None, description="A requirements file, relative to the workdir (uploaded with it)."
    )

    @field_validator("pip")
    @classmethod
    def _requirements(cls, values: list[str]) -> list[str]:
        return [check_requirement(value) for value in values]

    @field_validator("requirements")
    @classmethod
    def _relative(cls, path: str | None) -> str | None:
        if path is None:
            return None
        parts = path.replace("\\", "/").split("/")
        if path.startswith("/") or ".." in parts or "\x00" in path:
            raise ValueError(f"{path!r} must be a path inside the workdir, such as 'requirements.txt'")
        return path

    @model_validator(mode="after")
    def _something(self) -> RuntimeEnv:
        if not self.pip and self.requirements is None:
            raise ValueError("runtime_env needs `pip` (a list of requirements) or `requirements` (a file)")
        return self


COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")
DDP_PARAM_PREFIX = "ddp."  # a study's parameter named ddp.<option> sets the trial's `ddp.<option>`


class DdpOptions(SpecModel):
    """How `ctx.prepare_model` builds DistributedDataParallel: DDP's own arguments, and a
    communication hook from torch.distributed.algorithms.ddp_comm_hooks. Arguments the script
    passes to `prepare_model` itself win over these."""

    comm_hook: Literal["none", "fp16", "bf16", "powersgd"] = Field(
        "none",
        description="Compress gradients before the all-reduce: fp16 or bf16 (half the bytes), or PowerSGD "
        "(low-rank, with error feedback; its state is saved with every checkpoint).",
    )
    powersgd_rank: int = Field(1, ge=1, le=1024, description="PowerSGD's matrix approximation rank.")
    powersgd_start_iter: int = Field(
        10, ge=2, le=10**9, description="Steps of plain all-reduce before PowerSGD compresses (its warm-up)."
    )
    bucket_cap_mb: float | None = Field(
        None, gt=0, le=1024, description="Gradient bucket size in MiB (DDP's default: 25)."
    )
    gradient_as_bucket_view: bool = Field(False, description="Gradients as views into the buckets (less memory).")
    static_graph: bool = Field(False, description="The model uses the same parameters every step (DDP's static_graph).")
    timing: bool = Field(
        True, description="Report where each rank's step time goes (data, compute, exposed communication)."
    )


class JobSpec(SpecModel):
    """A job file. Every field a user may write; nothing else is accepted."""

    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    team: Annotated[str | None, Field(pattern=NAME_PATTERN)] = Field(
        None, description="The team the job belongs to (default: your only team; none if you have none)."
    )
    entrypoint: Annotated[str, Field(min_length=1, max_length=4096)]
    launcher: Literal["torchrun", "plain"] = Field(
        "torchrun",
        description="torchrun (default), or plain: the entrypoint once per slot with RANK, LOCAL_RANK, "
        "WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR and MASTER_PORT set, for scripts that "
        "set up their own process group (env://), JAX, or anything following that convention.",
    )
    workdir: Annotated[str, Field(max_length=MAX_PATH_CHARS)] = "."
    resources: Resources = Field(default_factory=Resources)
    hyperparameters: Annotated[
        dict[Annotated[str, Field(min_length=1, max_length=MAX_HYPERPARAMETER_KEY_CHARS)], Any],
        Field(max_length=MAX_HYPERPARAMETERS),
    ] = Field(default_factory=dict)
    precision: Precision = Precision.FP32
    ddp: DdpOptions = Field(
        default_factory=DdpOptions, description="DistributedDataParallel's options for `ctx.prepare_model`."
    )
    max_restarts: int = Field(0, ge=0, le=1000, description="Restarts after the job's own failures.")
    max_infra_restarts: int = Field(
        10,
        ge=0,
        le=1000,
        description="Restarts after lost agents and drains (a budget of its own); preemption costs none.",
    )
    hang_timeout: float | None = Field(
        None, ge=5, description="Restart when no rank reports a step for this many seconds."
    )
    checkpoint: CheckpointPolicy = Field(default_factory=CheckpointPolicy)
    priority: int = Field(50, ge=0, le=100, description="Orders the jobs of one team: higher first.")
    total_steps: int | None = Field(
        None,
        ge=1,
        le=10**15,
        description="The steps the job runs in all: lets the queue estimate when the jobs behind it start.",
    )
    env: Annotated[
        dict[
            Annotated[str, Field(max_length=MAX_ENV_KEY_CHARS)],
            Annotated[str, Field(max_length=MAX_ENV_VALUE_CHARS)],
        ],
        Field(max_length=MAX_ENV_VARS),
    ] = Field(default_factory=dict)
    runtime_env: RuntimeEnv | None = Field(
        None, description="Python packages to install on every node, resolved once into a lock."
    )

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
        total = sum(len(key) + len(value) + 2 for key, value in env.items())
        if total > MAX_ENV_TOTAL_CHARS:
            raise ValueError(f"the variables take {total:,} characters, above the limit of {MAX_ENV_TOTAL_CHARS:,}")
        return env

    @field_validator("hyperparameters")
    @classmethod
    def _hyperparameters_fit(cls, values: dict[str, Any]) -> dict[str, Any]:
        total = 2
        for key, value in values.items():
            try:
                chars = _json_chars(value)
            except ValueError as exc:
                raise ValueError(f"{key}: {exc}") from None
            if chars > MAX_HYPERPARAMETER_JSON_CHARS:
                raise ValueError(
                    f"{key}: its value takes {chars:,} characters as JSON, above the limit of "
                    f"{MAX_HYPERPARAMETER_JSON_CHARS:,}; pass large inputs as files in the workdir"
                )
            total += len(json.dumps(key)) + chars + 2
        if total > MAX_HYPERPARAMETERS_JSON_CHARS:
            raise ValueError(
                f"they take {total:,} characters as JSON (PHALANX_HPARAMS), above the limit of "
                f"{MAX_HYPERPARAMETERS_JSON_CHARS:,}"
            )
        return values


# --- hyperparameter studies ------------------------------------------------------------------
# A study file (YAML) maps 1:1 onto `StudySpec`. Optuna is the engine; these models only say what
# a user may write, and every inconsistency is refused here, before anything is created.

STUDY_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,47}$"  # trial jobs are named "<study>-t<number>"
GridValue = str | int | float | bool | None


class Objective(SpecModel):
    metric: Annotated[str, Field(min_length=1, max_length=128, description="A metric the script reports.")]
    direction: Direction = Direction.MINIMIZE


def _is_multiple(span: float, step: float) -> bool:
    ratio = span / step
    if not math.isfinite(ratio):  # more steps than a float can count (1e308 in steps of 1e-308)
        return False
    return abs(ratio - round(ratio)) <= 1e-9 * max(1.0, abs(ratio))


class FloatParam(SpecModel):
    type: Literal["float"]
    low: float
    high: float
    log: bool = False
    step: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _consistent(self) -> FloatParam:
        if self.low > self.high:
            raise ValueError(f"low ({self.low}) is above high ({self.high})")
        if not math.isfinite(self.high - self.low):
            raise ValueError(f"high - low ({self.high} - {self.low}) is past the largest float")
        if self.log and self.low <= 0:
            raise ValueError(f"log needs low > 0 (low is {self.low})")
        if self.log and self.step is not None:
            raise ValueError("step and log cannot be used together")
        if self.step is not None and not _is_multiple(self.high - self.low, self.step):
            raise ValueError(f"high - low ({self.high - self.low:g}) is not a multiple of step ({self.step:g})")
        return self

    def grid_size(self) -> int | None:
        """How many values `grid()` holds, without making them (None: continuous)."""
        return None if self.step is None else round((self.high - self.low) / self.step) + 1

    def grid(self) -> list[GridValue] | None:
        count = self.grid_size()
        if self.step is None or count is None:
            return None
        return [self.low + i * self.step for i in range(count)]


class IntParam(SpecModel):
    type: Literal["int"]
    low: ExactInt
    high: ExactInt
    step: int = Field(1, ge=1, le=MAX_EXACT_INT)
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

    def grid_size(self) -> int:
        return (self.high - self.low) // self.step + 1

    def grid(self) -> list[GridValue] | None:
        return list(range(self.low, self.high + 1, self.step))


Choice = Annotated[str, Field(max_length=MAX_CHOICE_CHARS)] | ExactInt | float | bool | None


class CategoricalParam(SpecModel):
    type: Literal["categorical"]
    choices: Annotated[list[Choice], Field(min_length=1, max_length=MAX_CHOICES)]

    @field_validator("choices")
    @classmethod
    def _distinct(cls, choices: list[GridValue]) -> list[GridValue]:
        seen = [repr(c) for c in choices]
        if len(set(seen)) != len(seen):
            raise ValueError("choices must be distinct")
        return choices

    def grid_size(self) -> int:
        return len(self.choices)

    def grid(self) -> list[GridValue] | None:
        return list(self.choices)


Param = Annotated[FloatParam | IntParam | CategoricalParam, Field(discriminator="type")]


class _Seeded(SpecModel):
    seed: Seed | None = Field(None, description="Makes the sampling reproducible.")


class TpeSampler(_Seeded):
    type: Literal["tpe"]
    n_startup_trials: int = Field(10, ge=0, le=MAX_TRIALS)
    multivariate: bool = False
    # Parallel trials: pretend the running ones scored badly, so two workers don't sample one point.
    constant_liar: bool = True


class RandomSampler(_Seeded):
    type: Literal["random"]


class GridSampler(_Seeded):
    type: Literal["grid"]


class CmaEsSampler(_Seeded):
    type: Literal["cmaes"]
    n_startup_trials: int = Field(1, ge=0, le=MAX_TRIALS)
    sigma0: float | None = Field(None, gt=0)


class GpSampler(_Seeded):
    type: Literal["gp"]
    n_startup_trials: int = Field(10, ge=0, le=MAX_TRIALS)


class NsgaIISampler(_Seeded):
    type: Literal["nsga2"]
    population_size: int = Field(50, ge=2, le=MAX_TRIALS)


Sampler = Annotated[
    TpeSampler | RandomSampler | GridSampler | CmaEsSampler | GpSampler | NsgaIISampler, Field(discriminator="type")
]


class _Windowed(SpecModel):
    n_startup_trials: int = Field(5, ge=0, le=MAX_TRIALS, description="Prune nothing until this many trials completed.")
    n_warmup_steps: Steps = Field(0, description="Prune no trial before this step.")
    interval_steps: int = Field(1, ge=1, le=2**63 - 1)


class MedianPruner(_Windowed):
    type: Literal["median"]


class PercentilePruner(_Windowed):
    type: Literal["percentile"]
    percentile: float = Field(ge=0, le=100)


# (the halving pruners raise reduction_factor to powers: small bounds keep that arithmetic cheap)
class SuccessiveHalvingPruner(SpecModel):
    type: Literal["successive_halving"]
    min_resource: Annotated[int, Field(ge=1, le=2**62)] | Literal["auto"] = "auto"
    reduction_factor: int = Field(4, ge=2, le=100)
    min_early_stopping_rate: int = Field(0, ge=0, le=64)


class HyperbandPruner(SpecModel):
    type: Literal["hyperband"]
    min_resource: int = Field(1, ge=1, le=2**62)
    max_resource: Annotated[int, Field(ge=1, le=2**62)] | Literal["auto"] = "auto"
    reduction_factor: int = Field(3, ge=2, le=100)


class NoPruner(SpecModel):
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
    team: Annotated[str | None, Field(exclude=True)] = None  # the study's

    @model_validator(mode="after")
    def _no_name(self) -> TrialTemplate:
        if "name" in self.model_fields_set:
            raise ValueError("trial.name is not used: trial jobs are named <study name>-t<trial number>")
        if self.team is not None:
            raise ValueError("trial.team is not used: trials run in the study's team (give `team` at the top)")
        return self


class StudySpec(SpecModel):
    """A study file. Optuna drives the trials; each trial is a Phalanx job."""

    name: Annotated[str, Field(pattern=STUDY_NAME_PATTERN)]
    team: Annotated[str | None, Field(pattern=NAME_PATTERN)] = Field(
        None, description="The team the study and its trials belong to (default: your only team)."
    )
    objective: Objective | Annotated[list[Objective], Field(min_length=1, max_length=MAX_OBJECTIVES)] = Field(
        description="The metric to optimise, or a list of them (multi-objective)."
    )
    search_space: Annotated[dict[ParamName, Param], Field(max_length=MAX_SEARCH_SPACE)]
    sampler: Sampler = Field(default_factory=lambda: TpeSampler(type="tpe"))
    pruner: Pruner = Field(default_factory=lambda: NoPruner(type="none"))
    n_trials: int = Field(ge=1, le=MAX_TRIALS, description="Trials to run in all, whatever their outcome.")
    parallelism: int = Field(1, ge=1, le=1000, description="Trials in flight at most (queued or running).")
    max_failed_trials: int | None = Field(
        None, ge=1, le=MAX_TRIALS, description="Fail the study after this many failed trials."
    )
    timeout: float | None = Field(None, gt=0, description="Start no trial after this many seconds of running.")
    target_value: float | None = Field(None, description="Stop once a trial reaches this value.")
    enqueue: Annotated[list[dict[ParamName, Any]], Field(max_length=MAX_TRIALS)] = Field(
        default_factory=list, description="Configurations to try first."
    )
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

    def grid_size(self) -> int:
        """How many combinations the grid sampler would walk, counted without making them (a
        product of counts: a handful of wide integer ranges is already more than memory holds);
        raises naming a continuous parameter."""
        size = 1
        for name, param in self.search_space.items():
            count = param.grid_size()
            if count is None:
                raise ValueError(
                    f"search_space.{name}: the grid sampler needs a finite set of values; give it a step "
                    "or make it categorical"
                )
            size *= count
        return size

    def grid(self) -> dict[str, list[GridValue]]:
        """Every parameter's values for the grid sampler (`grid_size()` first: this makes them)."""
        self.grid_size()
        return {name: param.grid() or [] for name, param in self.search_space.items()}

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
            size = self.grid_size()
            if size > MAX_GRID_COMBINATIONS:
                raise ValueError(
                    f"sampler: grid: the search space has {_count(size)} combinations, above the limit of "
                    f"{MAX_GRID_COMBINATIONS:,}; give fewer values (coarser steps, fewer choices) or another sampler"
                )
            if self.n_trials > size:
                raise ValueError(f"n_trials ({self.n_trials}) is above the grid's {size} combinations; lower n_trials")
        self._ddp_params_valid()
        self._trial_hyperparameters_fit()
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

    def _ddp_params_valid(self) -> None:
        """A parameter named `ddp.<option>` is searched like any other, and lands in the trial's
        `ddp` options instead of its hyperparameters: every value it can take must be one the
        option accepts."""
        for name, param in self.search_space.items():
            if not name.startswith(DDP_PARAM_PREFIX):
                continue
            option = name[len(DDP_PARAM_PREFIX) :]
            if option not in DdpOptions.model_fields:
                known = ", ".join(DdpOptions.model_fields)
                raise ValueError(f"search_space.{name}: ddp has no option {option!r}; use one of {known}")
            values = param.choices if isinstance(param, CategoricalParam) else [param.low, param.high]
            for value in values:
                try:
                    DdpOptions.model_validate({option: value})
                except ValueError as exc:
                    problem = str(exc).splitlines()[-1].strip()
                    raise ValueError(f"search_space.{name}: {value!r} is not a valid ddp.{option}: {problem}") from None

    def _trial_hyperparameters_fit(self) -> None:
        """A trial's hyperparameters are the template's with the sampled parameters over them:
        refuse a study whose trials could outgrow the bounds of a job's hyperparameters."""
        kept = {k: v for k, v in self.trial.hyperparameters.items() if k not in self.search_space}
        searched = {n: p for n, p in self.search_space.items() if not n.startswith(DDP_PARAM_PREFIX)}
        count = len(kept) + len(searched)
        if count > MAX_HYPERPARAMETERS:
            raise ValueError(
                f"trial.hyperparameters: with the search space's parameters a trial has {count} hyperparameters, "
                f"above the limit of {MAX_HYPERPARAMETERS}"
            )
        chars = _json_chars(kept) + sum(len(json.dumps(n)) + 2 + _widest(p) for n, p in searched.items())
        if chars > MAX_HYPERPARAMETERS_JSON_CHARS:
            raise ValueError(
                f"trial.hyperparameters: with the search space's parameters a trial's hyperparameters could take "
                f"{chars:,} characters as JSON, above the limit of {MAX_HYPERPARAMETERS_JSON_CHARS:,}"
            )


def _widest(param: FloatParam | IntParam | CategoricalParam) -> int:
    """The most characters a sampled value of `param` takes as JSON."""
    if isinstance(param, CategoricalParam):
        return max(_json_chars(choice) for choice in param.choices)
    if isinstance(param, IntParam):
        return max(len(str(param.low)), len(str(param.high)))
    return len(repr(-2.2250738585072014e-308))  # the longest a float's repr gets


def _count(number: int) -> str:
    """A count for a message: its digits, or its magnitude when it is past reading."""
    return f"{number:,}" if number < 10**15 else f"about 10^{len(str(number)) - 1}"


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
