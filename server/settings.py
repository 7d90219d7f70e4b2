"""Server-side configuration, read from the environment (prefix PHALANX_)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from phalanx.bundle_limits import DEFAULT_MAX_FILES, DEFAULT_MAX_UNPACKED_BYTES
from phalanx.schemas.specs import MAX_GRID_COMBINATIONS


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
    # How long an agent's long-poll for new work may hang before it returns unchanged (and the cap
    # on every other long-poll's wait).
    work_poll_seconds: float = Field(20.0, gt=0, le=300)
    # Requests held open (SSE streams, long-polls) per server process: by one holder (a user, an
    # agent), and in all; past either, 429 with Retry-After (`server/holds.py`).
    max_held_requests_per_holder: int = Field(16, ge=1)
    max_held_requests: int = Field(1024, ge=1)
    schedule_interval: float = Field(3.0, gt=0)
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
