"""Wire schemas shared by the server, the SDK, the CLI and the agent.

A job file (YAML) maps 1:1 onto `JobSpec`. Response models (`JobView`, `AgentView`, ...) are what the
REST API returns; ORM classes never leave the server's data layer.
"""

from __future__ import annotations

import enum
import re
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Variables the platform itself sets for every rank; a job may not override them.
RESERVED_ENV_PREFIXES = ("PHALANX_", "MASTER_", "TORCHELASTIC_")
RESERVED_ENV_KEYS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SlotType(enum.StrEnum):
    CPU = "cpu"
    GPU = "gpu"


class Precision(enum.StrEnum):
    FP32 = "32"
    BF16_MIXED = "bf16-mixed"
    FP16_MIXED = "fp16-mixed"


class JobState(enum.StrEnum):
    QUEUED = "QUEUED"
    SCHEDULED = "SCHEDULED"
    RUNNING = "RUNNING"
    RESTARTING = "RESTARTING"
    PAUSED = "PAUSED"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    PRUNED = "PRUNED"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_JOB_STATES


TERMINAL_JOB_STATES = frozenset({JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED, JobState.PRUNED})


class AgentState(enum.StrEnum):
    ACTIVE = "ACTIVE"
    DRAINING = "DRAINING"
    LOST = "LOST"


class NodeState(enum.StrEnum):
    """One node of an allocation, as its agent sees it."""

    ASSIGNED = "ASSIGNED"  # placed; the agent has not launched torchrun yet
    RUNNING = "RUNNING"  # torchrun is up on that agent
    EXITED = "EXITED"  # torchrun ended (exit code recorded); its slots are free again


class Resources(_Strict):
    nodes: int = Field(1, ge=1, le=1024, description="Number of nodes (agents) in the gang.")
    slots_per_node: int = Field(1, ge=1, le=256, description="Worker processes (ranks) per node.")
    slot_type: SlotType = SlotType.CPU

    @property
    def world_size(self) -> int:
        return self.nodes * self.slots_per_node


class CheckpointPolicy(_Strict):
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


class JobSpec(_Strict):
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


class JobEventView(BaseModel):
    time: datetime
    from_state: JobState | None
    to_state: JobState
    reason: str


class NodeView(BaseModel):
    node_rank: int
    agent_id: int
    agent_name: str
    slot_indices: list[int]
    state: NodeState
    exit_code: int | None


class AllocationView(BaseModel):
    id: int
    attempt: int
    master_addr: str
    master_port: int | None
    active: bool
    fenced: bool
    end_reason: str | None
    resume_step: int | None
    created_at: datetime
    ended_at: datetime | None
    nodes: list[NodeView]


class JobView(BaseModel):
    id: int
    name: str
    state: JobState
    spec: JobSpec
    owner: str
    priority: int
    wait_reason: str | None
    failure_reason: str | None
    submitted_at: datetime
    started_at: datetime | None
    ended_at: datetime | None
    attempts: int
    restarts_used: int = 0
    infra_restarts_used: int = 0
    latest_metrics: dict[str, float] = Field(default_factory=dict)
    latest_step: int | None = None
    study_id: int | None = None  # set for a trial job of a hyperparameter study
    trial_number: int | None = None


class JobDetail(JobView):
    events: list[JobEventView]
    allocations: list[AllocationView]


class AgentView(BaseModel):
    id: int
    name: str
    address: str
    state: AgentState
    cpu_slots: int
    gpu_slots: int
    used_cpu_slots: int
    used_gpu_slots: int
    registered_at: datetime
    last_heartbeat: datetime


# --- agent protocol --------------------------------------------------------------------------


class AgentRegistration(_Strict):
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    address: Annotated[str, Field(min_length=1, max_length=255)]
    cpu_slots: int = Field(ge=0, le=4096)
    gpu_slots: int = Field(0, ge=0, le=256)


class ResumePoint(BaseModel):
    step: int
    path: str


class Assignment(BaseModel):
    """What an agent must do for one node of one allocation.

    desired: "run"; "stop" (SIGTERM, the script may checkpoint, SIGKILL after the grace period);
    "kill" (SIGKILL at once: the attempt failed and its state is worthless past the checkpoint).
    """

    allocation_id: int
    job_id: int
    attempt: int
    node_rank: int
    nnodes: int
    nproc_per_node: int
    slot_type: SlotType
    slot_indices: list[int]
    master_addr: str
    master_port: int | None
    desired: Literal["run", "stop", "kill"]
    entrypoint: str
    env: dict[str, str]
    hyperparameters: dict[str, Any]
    precision: Precision
    checkpoint_root: str = ""
    resume: ResumePoint | None = None
    pg_timeout: float = 120.0


class AgentWork(BaseModel):
    version: str  # opaque digest of `assignments`; passing it back makes the server wait for a change
    assignments: list[Assignment]


class Rendezvous(_Strict):
    master_port: int = Field(ge=1, le=65535)


class NodeStarted(_Strict):
    node_rank: int = Field(ge=0)


class NodeExit(_Strict):
    node_rank: int = Field(ge=0)
    exit_code: int
    reason: str = Field("", max_length=4000)


class LogLineIn(_Strict):
    rank: int | None = None  # None: the launcher's own output
    stream: Literal["stdout", "stderr"] = "stdout"
    time: float
    line: str


class LogBatch(_Strict):
    lines: list[LogLineIn]


class LogRecord(BaseModel):
    id: int
    allocation_id: int
    rank: int | None
    stream: str
    time: datetime
    line: str


class MetricRecord(_Strict):
    """One `report()` call of one rank: several named values at one step."""

    rank: int = Field(ge=0)
    step: int
    time: float
    values: dict[str, float]


class MetricBatchIn(_Strict):
    records: list[MetricRecord]
    batch_id: str | None = Field(None, max_length=64, description="Idempotency key: a retried batch is stored once.")


class CheckpointCommit(_Strict):
    """Sent by rank 0 after the checkpoint's files were renamed into place."""

    step: int = Field(ge=0)
    path: Annotated[str, Field(min_length=1, max_length=4096)]
    size_bytes: int = Field(ge=0)
    metrics: dict[str, float] = Field(default_factory=dict)


class CheckpointView(BaseModel):
    id: int
    job_id: int
    attempt: int
    step: int
    metrics: dict[str, float]
    size_bytes: int
    path: str
    state: str
    created_at: datetime


class MetricPoint(BaseModel):
    allocation_id: int
    rank: int
    step: int
    name: str
    value: float
    time: datetime


class TokenCreated(BaseModel):
    id: int
    kind: Literal["user", "agent"]
    name: str
    token: str  # shown once


class TokenRequest(_Strict):
    kind: Literal["user", "agent"] = "user"
    name: Annotated[str, Field(pattern=NAME_PATTERN)]


class ErrorBody(BaseModel):
    error: str
    detail: Any = None


# --- hyperparameter studies ------------------------------------------------------------------
# A study file (YAML) maps 1:1 onto `StudySpec`. Optuna is the engine; these models only say what
# a user may write, and every inconsistency is refused here, before anything is created.

STUDY_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,47}$"  # trial jobs are named "<study>-t<number>"
GridValue = str | int | float | bool | None


class StudyState(enum.StrEnum):
    RUNNING = "RUNNING"  # the driver asks for trials and tells their results
    STOPPED = "STOPPED"  # by a user: its running trials were paused (checkpoint and leave); resumable
    COMPLETED = "COMPLETED"  # n_trials done, timeout, or target value reached
    FAILED = "FAILED"  # max_failed_trials reached

    @property
    def is_terminal(self) -> bool:
        return self in (StudyState.COMPLETED, StudyState.FAILED)


class TrialState(enum.StrEnum):
    """An Optuna trial's state as Phalanx last told it (Optuna's own names)."""

    RUNNING = "RUNNING"
    COMPLETE = "COMPLETE"
    PRUNED = "PRUNED"
    FAIL = "FAIL"


class Direction(enum.StrEnum):
    MINIMIZE = "minimize"
    MAXIMIZE = "maximize"


class Objective(_Strict):
    metric: Annotated[str, Field(min_length=1, max_length=128, description="A metric the script reports.")]
    direction: Direction = Direction.MINIMIZE


def _is_multiple(span: float, step: float) -> bool:
    ratio = span / step
    return abs(ratio - round(ratio)) <= 1e-9 * max(1.0, abs(ratio))


class FloatParam(_Strict):
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


class IntParam(_Strict):
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


class CategoricalParam(_Strict):
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


class _Seeded(_Strict):
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


class _Windowed(_Strict):
    n_startup_trials: int = Field(5, ge=0, description="Prune nothing until this many trials completed.")
    n_warmup_steps: int = Field(0, ge=0, description="Prune no trial before this step.")
    interval_steps: int = Field(1, ge=1)


class MedianPruner(_Windowed):
    type: Literal["median"]


class PercentilePruner(_Windowed):
    type: Literal["percentile"]
    percentile: float = Field(ge=0, le=100)


class SuccessiveHalvingPruner(_Strict):
    type: Literal["successive_halving"]
    min_resource: int | Literal["auto"] = "auto"
    reduction_factor: int = Field(4, ge=2)
    min_early_stopping_rate: int = Field(0, ge=0)


class HyperbandPruner(_Strict):
    type: Literal["hyperband"]
    min_resource: int = Field(1, ge=1)
    max_resource: int | Literal["auto"] = "auto"
    reduction_factor: int = Field(3, ge=2)


class NoPruner(_Strict):
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


class StudySpec(_Strict):
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


class TrialView(BaseModel):
    number: int
    job_id: int
    job_state: JobState
    state: TrialState
    params: dict[str, Any]
    values: list[float] | None  # one per objective, once COMPLETE (PRUNED: the last intermediate value)
    last_step: int | None  # the newest intermediate value reported to Optuna
    reason: str | None
    best: bool = False  # the best trial, or on the Pareto front of a multi-objective study
    best_so_far: float | None = None  # single objective: the best COMPLETE value up to this trial
    created_at: datetime
    ended_at: datetime | None


class Study(BaseModel):
    id: int
    name: str
    state: StudyState
    reason: str | None
    owner: str
    spec: StudySpec
    optuna_study_name: str
    created_at: datetime
    ended_at: datetime | None
    trial_counts: dict[str, int]  # by TrialState
    best_values: list[float] | None
    best_trial: int | None


class StudyDetail(Study):
    version: str  # changes whenever a trial or the study changes: pass it back to long-poll
    trials: list[TrialView]


class StudyBest(BaseModel):
    study_id: int
    directions: list[Direction]
    trials: list[TrialView]  # the best one; every trial on the Pareto front when multi-objective


class ParamImportances(BaseModel):
    study_id: int
    method: str
    importances: dict[str, float]
    note: str | None = None
