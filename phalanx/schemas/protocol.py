"""The agent <-> server wire: registration, work and assignments, node reports, and the log,
metric and checkpoint uploads of a running allocation.

`MetricRecord` has a dict twin in `phalanx.train._metrics` (the rank sends without pydantic);
`MetricBatchIn` is what the server validates those requests with.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from phalanx.schemas._base import NAME_PATTERN, StrictModel
from phalanx.schemas.enums import Precision, SlotType


class AgentRegistration(StrictModel):
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


class Rendezvous(StrictModel):
    master_port: int = Field(ge=1, le=65535)


class NodeStarted(StrictModel):
    node_rank: int = Field(ge=0)


class NodeExit(StrictModel):
    node_rank: int = Field(ge=0)
    exit_code: int
    reason: str = Field("", max_length=4000)


class LogLineIn(StrictModel):
    rank: int | None = None  # None: the launcher's own output
    stream: Literal["stdout", "stderr"] = "stdout"
    time: float
    line: str


class LogBatch(StrictModel):
    lines: list[LogLineIn]


class MetricRecord(StrictModel):
    """One `report()` call of one rank: several named values at one step."""

    rank: int = Field(ge=0)
    step: int
    time: float
    values: dict[str, float]


class MetricBatchIn(StrictModel):
    records: list[MetricRecord]
    batch_id: str | None = Field(None, max_length=64, description="Idempotency key: a retried batch is stored once.")


class CheckpointCommit(StrictModel):
    """Sent by rank 0 after the checkpoint's files were renamed into place."""

    step: int = Field(ge=0)
    path: Annotated[str, Field(min_length=1, max_length=4096)]
    size_bytes: int = Field(ge=0)
    metrics: dict[str, float] = Field(default_factory=dict)
