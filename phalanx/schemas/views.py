"""What `/api/v1` answers (and the one small body a user posts besides spec files, `TokenRequest`).

Built by the server from its ORM rows; ORM classes never leave its data layer.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from phalanx.schemas._base import NAME_PATTERN, MetricValue, StrictModel, WireModel
from phalanx.schemas.enums import (
    AgentState,
    Direction,
    JobState,
    NodeState,
    ScalingState,
    SlotType,
    StudyState,
    TrialState,
)
from phalanx.schemas.specs import JobSpec, StudySpec


class JobEventView(WireModel):
    time: datetime
    from_state: JobState | None
    to_state: JobState
    reason: str


class NodeView(WireModel):
    node_rank: int
    agent_id: int
    agent_name: str
    slot_indices: list[int]
    state: NodeState
    exit_code: int | None


class AllocationView(WireModel):
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


class QueuePlace(WireModel):
    """Where a QUEUED job stands: its place in line (1 is next), and when it may start."""

    position: int | None  # in the whole queue, in placement order; None: held, or it can never run
    team_position: int | None  # among its team's queued jobs
    queued: int  # jobs in line in all
    reason: str  # why it waits now
    estimated_start: datetime | None  # from the running jobs' progress; None: no estimate
    estimate: str  # how the estimate was made, or why there is none


class JobView(WireModel):
    id: int
    name: str
    state: JobState
    spec: JobSpec
    owner: str
    team: str | None = None  # None: the owner's own job
    priority: int
    wait_reason: str | None
    failure_reason: str | None
    submitted_at: datetime
    started_at: datetime | None
    ended_at: datetime | None
    attempts: int
    restarts_used: int = 0
    infra_restarts_used: int = 0
    latest_metrics: dict[str, MetricValue] = Field(default_factory=dict)
    latest_step: int | None = None
    study_id: int | None = None  # set for a trial job of a hyperparameter study
    trial_number: int | None = None
    held: bool = False  # held by an admin: it waits until released
    queue: QueuePlace | None = None  # QUEUED jobs only


class RankCommunication(WireModel):
    """Where one rank's steps went lately (per optimizer step, seconds; `ctx.prepare_model`'s
    always-on figures, reported every few seconds)."""

    rank: int
    step: int  # the script's step when this rank last reported them
    step_time_s: float
    data_time_s: float  # waiting for batches from `ctx.prepare_data_loader`
    compute_time_s: float  # forward + backward (DDP's sampled timing)
    comm_exposed_s: float  # all-reduce time not hidden behind the backward pass
    comm_time_s: float  # all-reduce time in all, hidden or not
    other_s: float  # the rest: optimizer step, logging, the script's own work
    bytes_per_step: float  # gradient bytes this rank all-reduced per step


class Communication(WireModel):
    """The job's communication at a glance, from its ranks' latest figures (the latest attempt)."""

    step_time_s: float  # median over the ranks
    comm_fraction: float  # exposed communication / step time (medians): 0 = hidden, 1 = all waiting
    bytes_per_step: float  # gradient bytes each rank all-reduces per step
    # The slowest rank's own work (step time less its exposed communication: the others wait for
    # it in theirs) over the median rank's; 1.0 = balanced.
    straggler_ratio: float
    slowest_rank: int
    ranks: list[RankCommunication]


MAX_PROFILE_STEPS = 200  # a trace of more steps is rarely read, and only costs the job and the server


class ProfileRequest(StrictModel):
    """`POST /jobs/{id}/profiles`: record the next `steps` optimizer steps on every rank."""

    steps: Annotated[int, Field(ge=1, le=MAX_PROFILE_STEPS)] = 20


class TraceSummary(WireModel):
    """Where one rank's recorded steps went, per step (seconds), from its trace. On a GPU the
    device's kernels count (NCCL kernels as communication, the rest as compute); on a CPU the
    training thread's operators count as compute and the collectives (gloo's own threads
    included) as communication. Compute and communication may overlap; idle is neither."""

    device: Literal["cuda", "cpu"]
    steps: int
    step_time_s: float
    compute_s: float
    comm_s: float
    overlap_s: float  # communication while compute ran: hidden
    exposed_comm_s: float  # communication alone: the step waited for it
    idle_s: float  # neither: data loading, the host, waiting for a slower peer


class RankProfile(WireModel):
    rank: int
    size_bytes: int  # the gzipped trace
    summary: TraceSummary | None = None
    error: str | None = None  # why this rank sent no trace


ProfileState = Literal["recording", "complete", "incomplete"]


class ProfileView(WireModel):
    """An on-demand profile (`phalanx jobs profile`). `recording` until every rank has sent its
    trace; `incomplete` when the attempt ended (or the profile was replaced) before they all did."""

    id: int
    job_id: int
    allocation_id: int
    attempt: int
    steps: int
    world_size: int
    state: ProfileState
    requested_by: str | None
    created_at: datetime
    ranks: list[RankProfile]  # the ranks that answered so far, by rank
    # Over the ranks' summaries: the median step, exposed communication / step, and the rank
    # whose step took longest (None until a summary arrived).
    step_time_s: float | None = None
    comm_fraction: float | None = None
    slowest_rank: int | None = None


MAX_SCALING_SIZES = 8


class ScalingRequest(StrictModel):
    """`POST /scaling` beside the job spec: the sizes to run and how many steps to measure."""

    nodes: Annotated[list[Annotated[int, Field(ge=1, le=1024)]], Field(min_length=1, max_length=MAX_SCALING_SIZES)]
    steps: Annotated[int, Field(ge=1, le=1_000_000)] = 100
    warmup: Annotated[int, Field(ge=0, le=1_000_000)] = 10

    @field_validator("nodes")
    @classmethod
    def _distinct_sizes(cls, nodes: list[int]) -> list[int]:
        if len(set(nodes)) != len(nodes):
            raise ValueError(f"nodes {nodes}: give each size once, such as [1, 2, 4]")
        return sorted(nodes)


class ScalingPoint(WireModel):
    """One size of a scaling run (`phalanx jobs scaling`)."""

    nodes: int
    world_size: int
    job_id: int
    steps_per_second: float  # rank 0's, after the warm-up steps
    throughput: float  # steps/s x world size: per-rank batches a second
    efficiency: float  # throughput / (the smallest size's, scaled by the node count): 1.0 is linear
    comm_fraction: float | None  # the job's exposed communication / step time (None: no figures)
    bytes_per_step: float | None


class ScalingRunView(WireModel):
    """A scaling run: its sizes, the one being measured, and each measured size's point (against
    the smallest size, recomputed as sizes are added)."""

    id: int
    name: str
    owner: str
    team: str | None
    state: ScalingState
    reason: str | None
    nodes: list[int]
    steps: int
    warmup: int
    measuring: int | None  # the size being measured now (nodes)
    job_ids: list[int]  # one per size started, in the order of `nodes`
    points: list[ScalingPoint]
    created_at: datetime
    ended_at: datetime | None
    version: str  # changes whenever anything above does (long-polls compare it)


class JobDetail(JobView):
    events: list[JobEventView]
    allocations: list[AllocationView]
    # What `spec.runtime_env` resolved to (exact versions with hashes); None until a node resolved it.
    env_lock: str | None = None
    # Per-rank step time split (data, compute, exposed communication) for DDP models prepared by
    # `ctx.prepare_model`; None until the ranks first report it.
    communication: Communication | None = None
    profiles: list[ProfileView] = Field(default_factory=list)  # newest first


class AgentView(WireModel):
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


class LogRecord(WireModel):
    id: int
    allocation_id: int
    rank: int | None
    stream: str  # "stdout", "stderr", or "setup" (the build of the job's runtime environment)
    time: datetime
    line: str

    @property
    def source(self) -> str:
        """Who wrote the line: "rank N", "launcher" (torchrun itself) or "setup"."""
        if self.stream == "setup":
            return "setup"
        return "launcher" if self.rank is None else f"rank {self.rank}"


class CheckpointView(WireModel):
    id: int
    job_id: int
    attempt: int
    step: int
    metrics: dict[str, MetricValue]
    size_bytes: int
    path: str
    state: str
    created_at: datetime


class MetricPoint(WireModel):
    id: int  # the order points were stored in: the next page starts after the last one's
    allocation_id: int
    rank: int
    step: int
    name: str
    value: MetricValue
    time: datetime


class TokenCreated(WireModel):
    id: int
    kind: Literal["user", "agent"]
    name: str
    token: str  # shown once
    expires_at: datetime | None = None


class TokenView(WireModel):
    """A token as `tokens list` shows it: never its value."""

    id: int
    kind: Literal["user", "agent"]
    name: str
    created_at: datetime
    expires_at: datetime | None  # None: until revoked
    configured: bool  # taken from PHALANX_ADMIN_TOKEN / PHALANX_AGENT_TOKEN


MAX_TOKEN_LIFETIME_S = 10 * 365 * 86400

TeamRole = Literal["member", "admin"]


class TeamRequest(StrictModel):
    name: Annotated[str, Field(pattern=NAME_PATTERN)]


class MembershipRequest(StrictModel):
    role: TeamRole = "member"


SlotCount = Annotated[int, Field(ge=0, le=1_000_000)]


def parse_slot_counts(text: str) -> dict[SlotType, int | None]:
    """ "cpu=8, gpu=2" as {cpu: 8, gpu: 2}; "gpu=none" as {gpu: None} (drop that value). Raises
    ValueError naming the expected form; the counts' bounds are `TeamPolicyRequest`'s."""
    slots: dict[SlotType, int | None] = {}
    for part in filter(None, (piece.strip() for piece in text.split(","))):
        kind, _, count = (piece.strip() for piece in part.partition("="))
        known = kind in SlotType.__members__.values()
        if not known or not (count == "none" or (count.isascii() and count.isdigit())) or len(count) > 9:
            kinds = ", ".join(k.value for k in SlotType)
            raise ValueError(f"write SLOT_TYPE=N pairs such as cpu=8,gpu=2 (slot types: {kinds}; N or none)")
        slots[SlotType(kind)] = None if count == "none" else int(count)
    return slots


class TeamPolicyRequest(StrictModel):
    """What `phalanx teams set` changes; a field left out stays as it is. In each mapping a slot type
    set to null drops that guarantee or limit."""

    weight: Annotated[float, Field(ge=0.001, le=1000)] | None = None
    guarantee: dict[SlotType, SlotCount | None] | None = None
    limit: dict[SlotType, SlotCount | None] | None = None
    user_limit: dict[SlotType, SlotCount | None] | None = None


class TeamMemberView(WireModel):
    user: str
    role: TeamRole


class TeamView(WireModel):
    """A team as its members see it (and cluster admins, every team)."""

    id: int
    name: str
    created_at: datetime
    members: list[TeamMemberView]
    your_role: TeamRole | None  # None: you are a cluster admin outside the team
    weight: float = 1.0
    guarantee: dict[str, int] = Field(default_factory=dict)  # slot type -> slots it can reclaim
    limit: dict[str, int] = Field(default_factory=dict)  # slot type -> the most it may hold
    user_limit: dict[str, int] = Field(default_factory=dict)  # slot type -> the most one member may hold
    queue_held: bool = False
    holding: dict[str, int] = Field(default_factory=dict)  # slot type -> slots its jobs hold now
    queued: int = 0  # its jobs waiting in line


class QueueEntry(WireModel):
    """One job in line, in placement order. Jobs you may not read show no name, owner or id."""

    position: int | None  # None: held (it is not in line until released)
    team_position: int | None
    job_id: int | None
    name: str | None
    owner: str | None
    team: str | None
    priority: int
    nodes: int
    slots_per_node: int
    slot_type: SlotType
    held: bool
    reason: str
    estimated_start: datetime | None
    submitted_at: datetime


class QueueView(WireModel):
    entries: list[QueueEntry]
    queued: int  # all jobs in line, including those not shown
    estimated_at: datetime  # the database clock when the queue was read


class UsageRow(WireModel):
    user: str
    team: str | None  # None: the user's own jobs
    slot_type: SlotType
    slot_hours: float
    jobs: int  # jobs that held slots in the period


class UsageReport(WireModel):
    since: datetime
    until: datetime
    rows: list[UsageRow]  # ordered by team, user, slot type
    by_team: dict[str, float]  # team name ("" for no team) -> slot-hours, all slot types
    by_slot_type: dict[str, float]


class TokenRequest(StrictModel):
    kind: Literal["user", "agent"] = "user"
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    expires_in_s: Annotated[int | None, Field(ge=60, le=MAX_TOKEN_LIFETIME_S)] = None


class TrialView(WireModel):
    number: int
    job_id: int
    job_state: JobState
    state: TrialState
    params: dict[str, Any]
    values: list[MetricValue] | None  # one per objective, once COMPLETE (PRUNED: the last intermediate value)
    last_step: int | None  # the newest intermediate value reported to Optuna
    reason: str | None
    best: bool = False  # the best trial, or on the Pareto front of a multi-objective study
    best_so_far: MetricValue | None = None  # single objective: the best COMPLETE value up to this trial
    created_at: datetime
    ended_at: datetime | None


class Study(WireModel):
    id: int
    name: str
    state: StudyState
    reason: str | None
    owner: str
    team: str | None = None
    spec: StudySpec
    optuna_study_name: str
    created_at: datetime
    ended_at: datetime | None
    trial_counts: dict[str, int]  # by TrialState
    best_values: list[MetricValue] | None
    best_trial: int | None


class StudyDetail(Study):
    version: str  # changes whenever a trial or the study changes: pass it back to long-poll
    trials: list[TrialView]


class StudyBest(WireModel):
    study_id: int
    directions: list[Direction]
    trials: list[TrialView]  # the best one; every trial on the Pareto front when multi-objective


class ParamImportances(WireModel):
    study_id: int
    method: str
    importances: dict[str, float]
    note: str | None = None
