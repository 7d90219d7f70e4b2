"""SQLAlchemy ORM classes. They never leave the server's data layer: routes return `phalanx.schemas`.

Times are naive UTC written by the database clock (`utcnow()`, inlined into each INSERT as a SQL
expression, not a server default, so one schema serves PostgreSQL and SQLite), so heartbeats never
depend on a host's clock.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    false,
)
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.sql.functions import FunctionElement

from server.float_columns import FloatsJSON, MetricFloat

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# SQLite has no BIGINT autoincrement; plain INTEGER PRIMARY KEY is its 64-bit rowid.
BigId = BigInteger().with_variant(Integer(), "sqlite")


class utcnow(FunctionElement[datetime]):
    """The database's current UTC time as a naive timestamp."""

    type = DateTime()
    inherit_cache = True


@compiles(utcnow, "postgresql")
def _pg_utcnow(element: utcnow, compiler: Any, **kw: Any) -> str:
    return "timezone('utc', clock_timestamp())"


@compiles(utcnow, "sqlite")
def _sqlite_utcnow(element: utcnow, compiler: Any, **kw: Any) -> str:
    return "strftime('%Y-%m-%d %H:%M:%f', 'now')"


class seconds_between(FunctionElement[float]):
    """`later` minus `earlier`, two naive timestamps, in seconds, computed by the database."""

    type = Float()
    inherit_cache = True


@compiles(seconds_between, "postgresql")
def _pg_seconds_between(element: seconds_between, compiler: Any, **kw: Any) -> str:
    earlier, later = (compiler.process(clause, **kw) for clause in element.clauses)
    # date_part gives double precision; EXTRACT gives numeric, with which fair sharing's sum over
    # 100,000 nodes took twice as long (EXPLAIN ANALYZE: 329 against 161 ms)
    return f"date_part('epoch', {later} - {earlier})"


@compiles(seconds_between, "sqlite")
def _sqlite_seconds_between(element: seconds_between, compiler: Any, **kw: Any) -> str:
    earlier, later = (compiler.process(clause, **kw) for clause in element.clauses)
    return f"((julianday({later}) - julianday({earlier})) * 86400.0)"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class User(Base):
    __tablename__ = "users"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow())


class Team(Base):
    """An account that jobs and studies belong to: its members read them, its admins manage them."""

    __tablename__ = "teams"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow())
    # Its share of the cluster (`server.placement.TeamQuota`): slots by slot type, {} for none.
    weight: Mapped[float] = mapped_column(Float, default=1.0, server_default="1")
    guarantee: Mapped[dict[str, int]] = mapped_column(JSON, default=dict, server_default="{}")
    slot_limit: Mapped[dict[str, int]] = mapped_column(JSON, default=dict, server_default="{}")
    user_limit: Mapped[dict[str, int]] = mapped_column(JSON, default=dict, server_default="{}")
    queue_held: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())

    members: Mapped[list[TeamMember]] = relationship(
        order_by="TeamMember.user_id", cascade="all, delete-orphan", back_populates="team"
    )


class TeamMember(Base):
    """One user's membership of one team; `role` is "member" or "admin" (manages the members and
    acts on every job and study of the team)."""

    __tablename__ = "team_members"

    team_id: Mapped[int] = mapped_column(ForeignKey("teams.id", ondelete="CASCADE"), primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), primary_key=True, index=True)
    role: Mapped[str] = mapped_column(String(8))

    team: Mapped[Team] = relationship(back_populates="members")
    user: Mapped[User] = relationship()


class ApiToken(Base):
    """A bearer token, stored as its SHA-256 only. `kind` separates users from agents."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))  # "user" | "agent"
    name: Mapped[str] = mapped_column(String(64))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    user_id: Mapped[int | None] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow())
    expires_at: Mapped[datetime | None] = mapped_column(DateTime)  # None: until revoked
    # Taken from PHALANX_ADMIN_TOKEN / PHALANX_AGENT_TOKEN: retired when the setting changes.
    configured: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())

    user: Mapped[User | None] = relationship()


class Agent(Base):
    __tablename__ = "agents"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    address: Mapped[str] = mapped_column(String(255))
    state: Mapped[str] = mapped_column(String(16), index=True)
    cpu_slots: Mapped[int] = mapped_column(Integer)
    gpu_slots: Mapped[int] = mapped_column(Integer, default=0)
    registered_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow())
    # SHA-256 of the agent's own secret, handed out at its first registration: every later call
    # (and a re-registration after a restart) proves it is this agent (`auth.agent_token`).
    credential_hash: Mapped[str | None] = mapped_column(String(64))
    last_heartbeat: Mapped[datetime] = mapped_column(DateTime, default=utcnow())


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(64))
    # indexed: a user's job lists read their own jobs and their teams' (`access.job_readable`)
    owner_id: Mapped[int] = mapped_column(ForeignKey("users.id"), index=True)
    team_id: Mapped[int | None] = mapped_column(ForeignKey("teams.id"), index=True)  # None: the owner's own
    state: Mapped[str] = mapped_column(String(16), index=True)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    priority: Mapped[int] = mapped_column(Integer)
    nodes: Mapped[int] = mapped_column(Integer)
    slots_per_node: Mapped[int] = mapped_column(Integer)
    slot_type: Mapped[str] = mapped_column(String(8))
    bundle_sha256: Mapped[str | None] = mapped_column(String(64))
    bundle_size: Mapped[int] = mapped_column(BigInteger, default=0)
    wait_reason: Mapped[str | None] = mapped_column(Text)
    failure_reason: Mapped[str | None] = mapped_column(Text)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # Restart budgets: failures of the job itself (crash, hang) vs. of the infrastructure.
    restarts_used: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    infra_restarts_used: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    submitted_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow())
    started_at: Mapped[datetime | None] = mapped_column(DateTime)
    ended_at: Mapped[datetime | None] = mapped_column(DateTime)
    held: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())  # by an admin
    # The job whose guarantee stopped this one's last attempt: it may never preempt that job back.
    preempted_by: Mapped[int | None] = mapped_column(Integer)
    # `runtime_env` resolved to exact versions with hashes (set once, by the first node to resolve
    # it): every node of every attempt installs this, so a restart a week later gets the same packages.
    env_lock: Mapped[str | None] = mapped_column(Text)

    owner: Mapped[User] = relationship()
    team: Mapped[Team | None] = relationship()
    events: Mapped[list[JobEvent]] = relationship(order_by="JobEvent.id", cascade="all, delete-orphan")
    allocations: Mapped[list[Allocation]] = relationship(
        order_by="Allocation.attempt", cascade="all, delete-orphan", back_populates="job"
    )


class JobEvent(Base):
    """Every state transition of a job, written only by `server.transitions`."""

    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    time: Mapped[datetime] = mapped_column(DateTime, default=utcnow())
    from_state: Mapped[str | None] = mapped_column(String(16))
    to_state: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(Text, default="")


class Allocation(Base):
    """One attempt of a job: which agent hosts which node rank, and where rank 0 listens."""

    __tablename__ = "allocations"
    __table_args__ = (UniqueConstraint("job_id", "attempt"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    master_addr: Mapped[str] = mapped_column(String(255))
    master_port: Mapped[int | None] = mapped_column(Integer)
    # active: some node has not exited yet. fenced: its workers may no longer write metrics or
    # checkpoints (it failed, was superseded, or its job ended); logs are still taken until exit.
    active: Mapped[bool] = mapped_column(Boolean, default=True, index=True)
    fenced: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    end_reason: Mapped[str | None] = mapped_column(Text)
    # whose failure: "job" | "infra" | "none" (preempted) | "vanished" (attempts.VANISHED)
    end_budget: Mapped[str | None] = mapped_column(String(8))
    resume_step: Mapped[int | None] = mapped_column(BigInteger)
    # Seconds its ranks get between SIGTERM and SIGKILL when stopped; None: the agent's own grace.
    stop_grace: Mapped[float | None] = mapped_column(Float)
    # The secret of the attempt's own token (`auth.rank_token`): its ranks report with it, and it
    # reaches nothing else. Never returned by a user-facing view.
    credential: Mapped[str | None] = mapped_column(String(64))
    last_progress_at: Mapped[datetime | None] = mapped_column(DateTime)
    # The profile (`Profile.id`) its ranks are asked to record, until every rank has sent its trace
    # or it is deleted: read with each metric batch, so the request reaches the ranks in their answer.
    profile_request: Mapped[int | None] = mapped_column(Integer)
    # The newest value of each metric name any rank reported, and the newest step: kept up to date
    # by the metrics route so that showing or listing jobs never scans the metrics table.
    # (JSONB on PostgreSQL: plain json has no equality, and allocations are selected DISTINCT)
    latest_metrics: Mapped[dict[str, float] | None] = mapped_column(FloatsJSON(binary=True))
    latest_step: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow())
    ended_at: Mapped[datetime | None] = mapped_column(DateTime)

    job: Mapped[Job] = relationship(back_populates="allocations")
    nodes: Mapped[list[AllocationNode]] = relationship(
        order_by="AllocationNode.node_rank", cascade="all, delete-orphan", back_populates="allocation"
    )


class AllocationNode(Base):
    __tablename__ = "allocation_nodes"
    __table_args__ = (UniqueConstraint("allocation_id", "node_rank"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    allocation_id: Mapped[int] = mapped_column(ForeignKey("allocations.id", ondelete="CASCADE"), index=True)
    node_rank: Mapped[int] = mapped_column(Integer)
    agent_id: Mapped[int] = mapped_column(ForeignKey("agents.id"), index=True)
    slot_type: Mapped[str] = mapped_column(String(8))
    slot_indices: Mapped[list[int]] = mapped_column(JSON)
    state: Mapped[str] = mapped_column(String(16))
    desired: Mapped[str] = mapped_column(String(8), default="run")  # "run" | "stop"
    exit_code: Mapped[int | None] = mapped_column(Integer)
    reason: Mapped[str | None] = mapped_column(Text)
    started_at: Mapped[datetime | None] = mapped_column(DateTime)
    ended_at: Mapped[datetime | None] = mapped_column(DateTime, index=True)  # usage accounting reads it

    allocation: Mapped[Allocation] = relationship(back_populates="nodes")
    agent: Mapped[Agent] = relationship()


class SlotLease(Base):
    """A slot held by a node that has not exited. The primary key makes double-booking impossible."""

    __tablename__ = "slot_leases"

    agent_id: Mapped[int] = mapped_column(ForeignKey("agents.id"), primary_key=True)
    slot_type: Mapped[str] = mapped_column(String(8), primary_key=True)
    slot_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    node_id: Mapped[int] = mapped_column(ForeignKey("allocation_nodes.id", ondelete="CASCADE"), index=True)


class Metric(Base):
    __tablename__ = "metrics"
    __table_args__ = (
        Index("ix_metrics_job_name_rank_step", "job_id", "name", "rank", "step"),
        # Retention reads points by age. BRIN on PostgreSQL: rows arrive in time order, so a few
        # kilobytes summarise 100 M of them, at almost no cost to each insert (a B-tree here cost
        # ingest a third of its rate); SQLite has no BRIN and gets a B-tree.
        Index("ix_metrics_time", "time", postgresql_using="brin", postgresql_with={"autosummarize": "on"}),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    allocation_id: Mapped[int] = mapped_column(ForeignKey("allocations.id", ondelete="CASCADE"))
    rank: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(BigInteger)
    name: Mapped[str] = mapped_column(String(128))
    value: Mapped[float] = mapped_column(MetricFloat)  # NaN and infinities included
    time: Mapped[datetime] = mapped_column(DateTime)
    # A resumed attempt re-does the steps after its checkpoint; the failed attempt's points for
    # those steps are kept but marked, and reads skip them unless asked for every attempt.
    superseded: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())


class MetricBatch(Base):
    """Batches already stored, so a sender retrying after a lost answer stores nothing twice."""

    __tablename__ = "metric_batches"

    allocation_id: Mapped[int] = mapped_column(ForeignKey("allocations.id", ondelete="CASCADE"), primary_key=True)
    batch_id: Mapped[str] = mapped_column(String(64), primary_key=True)


class LogBatch(Base):
    """Log batches already stored (`MetricBatch`'s twin for an agent's log shipping)."""

    __tablename__ = "log_batches"

    allocation_id: Mapped[int] = mapped_column(ForeignKey("allocations.id", ondelete="CASCADE"), primary_key=True)
    batch_id: Mapped[str] = mapped_column(String(64), primary_key=True)


class Checkpoint(Base):
    """A checkpoint whose files are complete. Rows appear only after the files were renamed into
    place; DELETING rows are removed only once their files are gone."""

    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("job_id", "path"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    allocation_id: Mapped[int] = mapped_column(ForeignKey("allocations.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(BigInteger)
    metrics: Mapped[dict[str, float]] = mapped_column(FloatsJSON)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    path: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(16))  # COMMITTED | DELETING
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow())


class Profile(Base):
    """An on-demand torch.profiler recording of `steps` optimizer steps on every rank of one
    attempt (`phalanx jobs profile`). Its traces arrive one per rank (`ProfileTrace`)."""

    __tablename__ = "profiles"

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    allocation_id: Mapped[int] = mapped_column(ForeignKey("allocations.id", ondelete="CASCADE"))
    steps: Mapped[int] = mapped_column(Integer)
    world_size: Mapped[int] = mapped_column(Integer)
    requested_by: Mapped[int | None] = mapped_column(ForeignKey("users.id", ondelete="SET NULL"))
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow())

    traces: Mapped[list[ProfileTrace]] = relationship(
        order_by="ProfileTrace.rank", cascade="all, delete-orphan", passive_deletes=True
    )


class ProfileTrace(Base):
    """One rank's part of a profile: its gzipped Chrome trace under the data dir and the server's
    summary of it, or why the rank could not record one."""

    __tablename__ = "profile_traces"

    profile_id: Mapped[int] = mapped_column(ForeignKey("profiles.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    path: Mapped[str | None] = mapped_column(Text)  # relative to the data dir
    size_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    summary: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow())


class ScalingRun(Base):
    """`phalanx jobs scaling`: one job spec run at several sizes in turn, each until rank 0 has
    reported `warmup + steps` steps, then killed and measured (`server.scaling`; its state changes
    only through `server.transitions`)."""

    __tablename__ = "scaling_runs"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(64))
    owner_id: Mapped[int] = mapped_column(ForeignKey("users.id"))
    team_id: Mapped[int | None] = mapped_column(ForeignKey("teams.id"))
    state: Mapped[str] = mapped_column(String(16), index=True)
    reason: Mapped[str | None] = mapped_column(Text)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    bundle_sha256: Mapped[str | None] = mapped_column(String(64))
    bundle_size: Mapped[int] = mapped_column(BigInteger, default=0)
    nodes: Mapped[list[int]] = mapped_column(JSON)  # the sizes, smallest first
    steps: Mapped[int] = mapped_column(Integer)
    warmup: Mapped[int] = mapped_column(Integer)
    job_ids: Mapped[list[int]] = mapped_column(JSON, default=list)  # one per size started so far
    measured: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)  # `phalanx.scaling.Measured`
    size_started_at: Mapped[datetime | None] = mapped_column(DateTime)  # for the per-size timeout
    reached_at: Mapped[datetime | None] = mapped_column(DateTime)  # rank 0 reached the last step
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow())
    ended_at: Mapped[datetime | None] = mapped_column(DateTime)

    owner: Mapped[User] = relationship()


class ControlPlane(Base):
    """Facts about the control plane itself, e.g. when a server last started (the reaper gives
    agents a heartbeat timeout's grace after that: they could not report while it was down)."""

    __tablename__ = "control_plane"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    time: Mapped[datetime] = mapped_column(DateTime)


class LogLine(Base):
    __tablename__ = "log_lines"
    __table_args__ = (
        Index("ix_log_lines_job_id_id", "job_id", "id"),
        # retention, as `Metric`'s
        Index("ix_log_lines_time", "time", postgresql_using="brin", postgresql_with={"autosummarize": "on"}),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    allocation_id: Mapped[int] = mapped_column(ForeignKey("allocations.id", ondelete="CASCADE"))
    rank: Mapped[int | None] = mapped_column(Integer)
    stream: Mapped[str] = mapped_column(String(8))
    time: Mapped[datetime] = mapped_column(DateTime)
    line: Mapped[str] = mapped_column(Text)


class RetentionMark(Base):
    """How far one retention task (`server.retention`) has gone, for every job of its kind: each
    metric point older than `until` was thinned to buckets of the task's width
    ("job:metrics/40"), or each log line older than it deleted ("trial:logs")."""

    __tablename__ = "retention_marks"

    what: Mapped[str] = mapped_column(String(32), primary_key=True)
    until: Mapped[datetime] = mapped_column(DateTime)


class TuningStudy(Base):
    """A hyperparameter study. Optuna's own tables (`studies`, `trials`, ...) in the same database
    hold its trials' parameters and values; this row holds what Phalanx adds: who, the spec, the
    code bundle of its trials, and the study's lifecycle (changed only by `server.transitions`)."""

    __tablename__ = "tuning_studies"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(64))
    owner_id: Mapped[int] = mapped_column(ForeignKey("users.id"))
    team_id: Mapped[int | None] = mapped_column(ForeignKey("teams.id"), index=True)  # its trials' team too
    optuna_name: Mapped[str] = mapped_column(String(128), unique=True)
    state: Mapped[str] = mapped_column(String(16), index=True)
    reason: Mapped[str | None] = mapped_column(Text)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    bundle_sha256: Mapped[str | None] = mapped_column(String(64))
    bundle_size: Mapped[int] = mapped_column(BigInteger, default=0)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow())
    ended_at: Mapped[datetime | None] = mapped_column(DateTime)
    # The study's running time (for `timeout`) without the time it spent STOPPED.
    running_since: Mapped[datetime | None] = mapped_column(DateTime)
    running_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    # The lock the first trial's nodes resolved `trial.runtime_env` to: later trials start with it,
    # so all trials share one environment (built once per node).
    env_lock: Mapped[str | None] = mapped_column(Text)

    owner: Mapped[User] = relationship()
    team: Mapped[Team | None] = relationship()
    trials: Mapped[list[TuningTrial]] = relationship(
        order_by="TuningTrial.number", cascade="all, delete-orphan", back_populates="study"
    )


class TuningTrial(Base):
    """One Optuna trial and the job that runs it. `state` is what Phalanx last told Optuna
    (RUNNING until the job ends); `reported_step` is the newest intermediate value reported."""

    __tablename__ = "tuning_trials"
    __table_args__ = (UniqueConstraint("study_id", "number"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    study_id: Mapped[int] = mapped_column(ForeignKey("tuning_studies.id", ondelete="CASCADE"), index=True)
    number: Mapped[int] = mapped_column(Integer)
    optuna_trial_id: Mapped[int] = mapped_column(Integer, unique=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), unique=True)
    params: Mapped[dict[str, Any]] = mapped_column(JSON)
    state: Mapped[str] = mapped_column(String(16))
    values: Mapped[list[float] | None] = mapped_column(FloatsJSON)
    reported_step: Mapped[int | None] = mapped_column(BigInteger)
    reason: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow())
    ended_at: Mapped[datetime | None] = mapped_column(DateTime)

    study: Mapped[TuningStudy] = relationship(back_populates="trials")
    job: Mapped[Job] = relationship()
