"""The agent <-> server wire: registration, work and assignments, node reports, and the log,
metric and checkpoint uploads of a running allocation.

`MetricRecord` has a dict twin in `phalanx.train._metrics` (the rank sends without pydantic);
`MetricBatchIn` is what the server validates those requests with.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from phalanx.schemas._base import NAME_PATTERN, NUL_FREE, MetricValue, PrintedText, StrictModel, WireModel
from phalanx.schemas.enums import AgentState, Precision, SlotType
from phalanx.schemas.specs import DdpOptions, RuntimeEnv

# What the database stores (INTEGER, BIGINT, a timestamp before year 10000): a value past these is
# refused here (422) instead of failing the insert.
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
Count32 = Annotated[int, Field(ge=0, le=2**31 - 1)]
Step64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
UnixTime = Annotated[float, Field(ge=0, le=253_402_300_799, allow_inf_nan=False)]
MetricName = Annotated[str, Field(min_length=1, max_length=128, pattern=NUL_FREE)]
MAX_RECORDS_PER_BATCH = 100_000
MAX_VALUES_PER_RECORD = 1_000
MAX_LINES_PER_BATCH = 100_000
MAX_LOG_LINE_CHARS = 65_536
MAX_EXIT_REASON_CHARS = 4000


class AgentRegistration(StrictModel):
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    address: Annotated[str, Field(min_length=1, max_length=255, pattern=NUL_FREE)]
    cpu_slots: int = Field(ge=0, le=4096)
    gpu_slots: int = Field(0, ge=0, le=256)
    # The agent's own token from its first registration (kept in its data dir): proves that a
    # re-registration under a taken name is that agent restarting.
    agent_token: Annotated[str | None, Field(max_length=256)] = None


class AgentRegistered(WireModel):
    """The registration's answer: which agent this is, and the token it must use from now on."""

    id: int
    name: str
    state: AgentState
    agent_token: str  # `phx_n_<id>_<secret>`: acts for this agent only


class ResumePoint(WireModel):
    step: int
    path: str


class Assignment(WireModel):
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
    # Seconds between SIGTERM and SIGKILL for "stop"; None: the agent's own `--kill-grace`.
    stop_grace: float | None = None
    entrypoint: str
    launcher: Literal["torchrun", "plain"] = "torchrun"
    env: dict[str, str]
    hyperparameters: dict[str, Any]
    precision: Precision
    ddp: DdpOptions = Field(default_factory=DdpOptions)
    checkpoint_root: str = ""
    resume: ResumePoint | None = None
    pg_timeout: float = 120.0
    # The ranks' PHALANX_TOKEN: reports metrics and checkpoints for this allocation, nothing else
    credential: str = ""
    # The packages to install first; `env_lock` is their resolution, once node rank 0 (or an
    # earlier attempt, or a trial of the same study) made it: every node installs exactly that.
    runtime_env: RuntimeEnv | None = None
    env_lock: str | None = None


class AgentWork(WireModel):
    version: str  # opaque digest of `assignments`; passing it back makes the server wait for a change
    assignments: list[Assignment]


class Rendezvous(StrictModel):
    master_port: int = Field(ge=1, le=65535)


class NodeStarted(StrictModel):
    node_rank: Count32


class NodeExit(StrictModel):
    node_rank: Count32
    exit_code: Int32
    # ends with the rank's last stderr lines
    reason: Annotated[PrintedText, Field(max_length=MAX_EXIT_REASON_CHARS)] = ""
    # "environment": the node never started because its runtime environment could not be resolved
    # or built; restarting would fail the same way, so the job fails without using a restart.
    # "stopped": it ended because Phalanx asked it to stop (its code says nothing about the job).
    cause: Literal["run", "environment", "stopped"] = "run"


# An agent's reports of the nodes it starts or ends together travel in one call: at a cluster's
# fill each agent starts its nodes within a second, and one call per node was most of the
# server's work (`bench/bench_scale.py`).
MAX_REPORTS_PER_CALL = 64


class StartedReport(NodeStarted):
    kind: Literal["started"]
    allocation_id: Count32


class ExitReport(NodeExit):
    kind: Literal["exit"]
    allocation_id: Count32


class RendezvousReport(Rendezvous):
    kind: Literal["rendezvous"]
    allocation_id: Count32


NodeReport = Annotated[StartedReport | ExitReport | RendezvousReport, Field(discriminator="kind")]


class NodeReports(StrictModel):
    """Applied in the order given, each on its own: one refused (404, 409) changes nothing of the
    others, and its outcome says why."""

    reports: Annotated[list[NodeReport], Field(min_length=1, max_length=MAX_REPORTS_PER_CALL)]


class ReportOutcome(WireModel):
    """One report's answer, as its own call would have given it: 204, or the refusal's status and error."""

    status: int
    error: str | None = None


class ReportOutcomes(WireModel):
    results: list[ReportOutcome]  # one per report, in the order sent


# A lock lists every wheel's hash of every package: a large environment's runs to a few hundred KiB.
MAX_LOCK_CHARS = 4 * 1024 * 1024


class EnvironmentLock(StrictModel):
    """Node rank 0's resolution of the job's runtime environment: `uv pip compile` output, with hashes."""

    lock: Annotated[str, Field(min_length=1, max_length=MAX_LOCK_CHARS, pattern=NUL_FREE)]


class EnvironmentLocked(WireModel):
    """The job's lock: the one just reported, or the one another node or attempt reported first."""

    lock: str


class LogLineIn(StrictModel):
    rank: Count32 | None = None  # None: the launcher's own output
    stream: Literal["stdout", "stderr", "setup"] = "stdout"  # "setup": building the runtime environment
    time: UnixTime
    line: Annotated[PrintedText, Field(max_length=MAX_LOG_LINE_CHARS)]  # the agent splits longer ones


BatchId = Annotated[
    str,
    Field(
        min_length=1,
        max_length=64,
        pattern=NUL_FREE,
        description="Idempotency key: a batch sent again under the same id (its answer was lost) is stored "
        "once. Without one the server takes a digest of the body, so only a byte-identical resend is recognised.",
    ),
]


class LogBatch(StrictModel):
    lines: Annotated[list[LogLineIn], Field(max_length=MAX_LINES_PER_BATCH)]
    batch_id: BatchId | None = None  # the agent sends "<its stream>-<first line's number>"


class AllocationLogBatch(LogBatch):
    allocation_id: Count32


class AgentLogBatches(StrictModel):
    """Every allocation's pending lines on one agent, in one call; each batch is stored or refused
    on its own (`ReportOutcomes`). The lines of all batches together are capped as one batch's are."""

    batches: Annotated[list[AllocationLogBatch], Field(min_length=1, max_length=MAX_REPORTS_PER_CALL)]

    @model_validator(mode="after")
    def _lines_capped(self) -> AgentLogBatches:
        lines = sum(len(b.lines) for b in self.batches)
        if lines > MAX_LINES_PER_BATCH:
            raise ValueError(f"{lines:,} lines in one call; send at most {MAX_LINES_PER_BATCH:,}")
        return self


class MetricRecord(StrictModel):
    """One `report()` call of one rank: several named values at one step. A value may be NaN or
    ±Infinity, written as the string "NaN", "Infinity" or "-Infinity" (`MetricValue`)."""

    rank: Count32
    step: Step64
    time: UnixTime
    values: Annotated[dict[MetricName, MetricValue], Field(max_length=MAX_VALUES_PER_RECORD)]


class MetricBatchIn(StrictModel):
    records: Annotated[list[MetricRecord], Field(max_length=MAX_RECORDS_PER_BATCH)]
    batch_id: BatchId | None = None  # a rank sends "<its stream>-<first record's number>"


class ProfileOrder(WireModel):
    """In the answer to a metric batch while the attempt's ranks are asked to record a profile."""

    id: int
    steps: int


class MetricBatchAnswer(WireModel):
    profile: ProfileOrder | None = None


class ProfileFailure(StrictModel):
    """A rank that could not record or send its trace says why (the profiler was busy, the trace
    was over the cap)."""

    message: Annotated[str, Field(min_length=1, max_length=4000)]


class CheckpointCommit(StrictModel):
    """Sent by rank 0 after the checkpoint's files were renamed into place."""

    step: Annotated[int, Field(ge=0, le=2**63 - 1)]
    path: Annotated[str, Field(min_length=1, max_length=4096)]
    size_bytes: Annotated[int, Field(ge=0, le=2**63 - 1)]
    metrics: Annotated[dict[MetricName, MetricValue], Field(max_length=MAX_VALUES_PER_RECORD)] = Field(
        default_factory=dict
    )
