"""Server-side configuration, read from the environment (prefix PHALANX_)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from phalanx.bundle_limits import DEFAULT_MAX_FILES, DEFAULT_MAX_UNPACKED_BYTES
from phalanx.schemas.specs import MAX_GRID_COMBINATIONS


class MetricTier(BaseModel):
    """Metric points older than `after_days` are thinned, per series, to the first, last, lowest
    and highest point of each bucket of `bucket_steps` steps (`server.retention`)."""

    model_config = ConfigDict(extra="forbid")

    after_days: float = Field(gt=0, le=36_500)
    bucket_steps: int = Field(ge=4, le=1_000_000_000)


class RetentionPolicy(BaseModel):
    """What retention keeps of one kind of job's metrics and logs."""

    model_config = ConfigDict(extra="forbid")

    # Oldest last: each tier's age and bucket are above the one before it, and each bucket a
    # multiple of the one before (a coarser bucket is then a union of finer ones, and thinning it
    # again keeps exactly what thinning every point at once would).
    metric_tiers: list[MetricTier] = Field(default_factory=list, max_length=8)
    # Log lines older than this are deleted; None keeps them for the job's lifetime.
    log_days: float | None = Field(None, gt=0, le=36_500)

    @model_validator(mode="after")
    def _tiers_nest(self) -> RetentionPolicy:
        for finer, coarser in zip(self.metric_tiers, self.metric_tiers[1:], strict=False):
            if coarser.after_days <= finer.after_days or coarser.bucket_steps % finer.bucket_steps:
                raise ValueError(
                    "each metric tier must come after the one before it (larger after_days) and its "
                    f"bucket_steps must be a multiple of the one before ({finer.bucket_steps}); "
                    f"got after_days={coarser.after_days:g}, bucket_steps={coarser.bucket_steps}"
                )
        return self


def _job_retention() -> RetentionPolicy:
    # A week at full resolution, then ≤ 4 points per 40 steps, and after 30 days per 400: a
    # weeks-long job's 2,000-point chart looks the same (its envelope is kept) from ~10 and
    # then ~100 times fewer rows.
    return RetentionPolicy(
        metric_tiers=[MetricTier(after_days=7, bucket_steps=40), MetricTier(after_days=30, bucket_steps=400)]
    )


def _trial_retention() -> RetentionPolicy:
    # A study compares its trials by their reported values (kept on the trial), so their curves
    # thin sooner.
    return RetentionPolicy(
        metric_tiers=[MetricTier(after_days=2, bucket_steps=40), MetricTier(after_days=14, bucket_steps=400)]
    )


class Retention(BaseModel):
    """Per kind of job: `trial` for a study's trials, `job` for every other job."""

    model_config = ConfigDict(extra="forbid")

    job: RetentionPolicy = Field(default_factory=_job_retention)
    trial: RetentionPolicy = Field(default_factory=_trial_retention)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PHALANX_", extra="ignore")

    data_dir: Path = Field(default_factory=lambda: Path.home() / ".phalanx")
    # Empty means the embedded default: SQLite and a filesystem broker under data_dir.
    database_url: str = ""
    broker_url: str = ""
    heartbeat_interval: float = Field(2.0, gt=0)
    heartbeat_timeout: float = Field(10.0, gt=0)
    admin_token: str | None = None
    agent_token: str | None = None
    max_bundle_bytes: int = 64 * 1024 * 1024
    # What a bundle may unpack to (checked at upload, and again by the agents while unpacking).
    max_bundle_files: int = Field(DEFAULT_MAX_FILES, ge=1)
    max_bundle_unpacked_bytes: int = Field(DEFAULT_MAX_UNPACKED_BYTES, ge=1)
    max_metric_batch_bytes: int = 32 * 1024 * 1024
    max_log_batch_bytes: int = 8 * 1024 * 1024
    # One rank's gzipped profile trace (`phalanx jobs profile`); it may unpack to 16 times as much.
    max_profile_trace_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    # Threads that run the routes' blocking work (their database reads and writes). A server process
    # is one core (the GIL): past a handful, more threads add no throughput, only make each request
    # wait longer for the GIL and starve the event loop that answers heartbeats and long-polls
    # (at 1,000 agents with 40 threads, heartbeats waited 14 s; bench/bench_scale.py).
    worker_threads: int = Field(8, ge=1, le=256)
    # Threads of their own for the agents' and ranks' calls (work reads, node reports, logs,
    # metrics): at a cluster's fill a thousand work reads and the nodes' reports queued for the
    # worker threads, and a person's jobs list waited 10-26 s behind them (bench/bench_scale.py).
    agent_threads: int = Field(4, ge=1, le=256)
    # The agents' and ranks' calls waiting for or running on the agents' threads in one server
    # process; past it, their reports, lines and metric batches are refused 429 at the door
    # (`server/api/admission.py`): queued behind those threads, they timed out, came back, and
    # crowded the heartbeats out. At least what those threads store in the refusal's Retry-After
    # (1 s; ~150-250 calls at 1,000 agents): with 64, the queue drained while the refused waited,
    # and the node-start storm lasted 135 s where it lasted 40 s with 256.
    max_node_calls_in_flight: int = Field(256, ge=1, le=100_000)
    # How long an agent's long-poll for new work may hang before it returns unchanged (and the cap
    # on every other long-poll's wait).
    work_poll_seconds: float = Field(20.0, gt=0, le=300)
    # Requests held open (SSE streams, long-polls) per server process: by one holder (a user, an
    # agent), and in all; past either, 429 with Retry-After (`server/holds.py`).
    max_held_requests_per_holder: int = Field(16, ge=1)
    max_held_requests: int = Field(1024, ge=1)
    schedule_interval: float = Field(3.0, gt=0)
    # After a scheduling pass that took t seconds, the next one waits `schedule_rest_ratio` x t
    # (at most 2 s): passes asked for back to back take at most 1 / (1 + ratio) of the
    # scheduler's core and as much of PostgreSQL's (`scheduler/pacing.py`).
    schedule_rest_ratio: float = Field(1.0, ge=0, le=100)
    # A queue snapshot (places in line, reasons, start estimates: one placement pass over the whole
    # queue) serves every request of the next this-many seconds that shows no job newer than it
    # (`server.queue_status.queue_snapshot`); 0 computes one per request. Kueue's pending-workloads
    # view refreshes every 5 s.
    queue_snapshot_seconds: float = Field(5.0, ge=0, le=300)
    # Fair sharing (`server/placement.py`): how fast past usage is forgiven (Slurm's
    # PriorityDecayHalfLife), what a preempted job gets between SIGTERM and SIGKILL to checkpoint,
    # and how long a job runs before it may be preempted at all.
    fair_share_half_life: float = Field(3600.0, gt=0, le=365 * 86400)
    # How much that usage counts beside what a team holds now (`placement.Sharing.history_weight`).
    fair_share_history_weight: float = Field(0.25, ge=0, le=100)
    preemption_grace: float = Field(30.0, ge=0, le=3600)
    preemption_min_runtime: float = Field(60.0, ge=0, le=7 * 86400)
    # Where checkpoints live: any fsspec URI every node and the server can reach (file:// on a
    # shared filesystem, s3://, ...). Empty means <data_dir>/checkpoints.
    checkpoint_uri: str = ""
    # A grid study walking more combinations than this is refused at submit (422).
    max_grid_combinations: int = Field(10_000, ge=1, le=MAX_GRID_COMBINATIONS)
    # Parameter importance is computed from a study's newest COMPLETE trials, at most this many.
    max_importance_trials: int = Field(1000, ge=2, le=100_000)
    # Other roots a job's `checkpoint.storage` may name (it may also name a sub-path of any root),
    # comma-separated URIs. Nothing else is accepted: no other protocol, no other place.
    checkpoint_roots: str = ""
    # Old metric points thinned and old log lines deleted, per kind of job, as JSON, e.g.
    # PHALANX_RETENTION='{"job": {"metric_tiers": [{"after_days": 7, "bucket_steps": 40}], "log_days": 90}}'
    # (`server.retention`). A pass every `retention_interval` seconds stops starting slices after
    # `retention_pass_seconds`; the rest waits for the next pass. Short: the pass runs on the
    # scheduler's one worker, between placement and reaping passes.
    retention: Retention = Field(default_factory=Retention)
    retention_interval: float = Field(10.0, gt=0)
    retention_pass_seconds: float = Field(1.0, gt=0, le=3600)

    @model_validator(mode="after")
    def _embedded_defaults(self) -> Settings:
        if not self.database_url:
            self.database_url = f"sqlite:///{self.data_dir / 'phalanx.db'}"
        if not self.broker_url:
            self.broker_url = "filesystem://"
        if not self.checkpoint_uri:
            self.checkpoint_uri = f"file://{self.data_dir / 'checkpoints'}"
        return self

    @property
    def allowed_checkpoint_roots(self) -> list[str]:
        extra = [root.strip() for root in self.checkpoint_roots.split(",") if root.strip()]
        return [self.checkpoint_uri, *extra]

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")

    @property
    def redis_url(self) -> str | None:
        """Redis for wake-ups: the broker itself when it is Redis, else none (poll instead)."""
        return self.broker_url if self.broker_url.startswith(("redis://", "rediss://")) else None

    @property
    def bundle_dir(self) -> Path:
        return self.data_dir / "bundles"

    @property
    def wake_dir(self) -> Path:
        """Embedded mode's wake-up files (with Redis, wake-ups go through pub/sub instead)."""
        return self.data_dir / "wake"

    @property
    def broker_dir(self) -> Path:
        return self.data_dir / "broker"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
