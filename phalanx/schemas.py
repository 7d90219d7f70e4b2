"""Wire schemas shared by the server, the SDK, the CLI and the agent.

A job file (YAML) maps 1:1 onto `JobSpec`. Response models (`Job`, `Agent`, ...) are what the
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


class JobEvent(BaseModel):
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


class Job(BaseModel):
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


class JobDetail(Job):
    events: list[JobEvent]
    allocations: list[AllocationView]


class Agent(BaseModel):
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


class LogLine(_Strict):
    rank: int | None = None  # None: the launcher's own output
    stream: Literal["stdout", "stderr"] = "stdout"
    time: float
    line: str


class LogBatch(_Strict):
    lines: list[LogLine]


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


class MetricBatch(_Strict):
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
