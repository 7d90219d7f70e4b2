"""Shared fixtures: a fresh PostgreSQL database per test session, Redis on loopback, settings."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import redis
from sqlalchemy import text

from server import tuning
from server.db import engine_for, upgrade
from server.settings import Settings

PG_ADMIN = os.environ.get("PHALANX_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("PHALANX_TEST_REDIS", "redis://127.0.0.1:6379/9")
ADMIN_TOKEN = "phx_u_test-admin-token"
AGENT_TOKEN = "phx_a_test-agent-token"
TABLES = (
    "tuning_trials, tuning_studies, slot_leases, log_lines, log_batches, metrics, metric_batches, checkpoints, "
    "allocation_nodes, "
    "allocations, job_events, jobs, agents, api_tokens, team_members, teams, users, control_plane, retention_marks, "
    "studies"  # Optuna's; CASCADE empties its trial tables (its version_info stays)
)


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A migrated database of its own, dropped at the end of the session."""
    name = f"phalanx_test_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    upgrade(url)
    yield url
    tuning.dispose_storages()
    engine_for(url).dispose()
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def redis_url() -> str:
    client = redis.Redis.from_url(REDIS_URL)
    client.ping()
    client.close()
    return REDIS_URL


@pytest.fixture
def clean_db(pg_url: str) -> str:
    with engine_for(pg_url).begin() as conn:
        conn.execute(text(f"TRUNCATE {TABLES} RESTART IDENTITY CASCADE"))
    return pg_url


@pytest.fixture
def clean_redis(redis_url: str) -> str:
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    client.close()
    return redis_url


@pytest.fixture
def settings(clean_db: str, clean_redis: str, tmp_path: Path) -> Settings:
    return Settings(
        data_dir=tmp_path / "data",
        database_url=clean_db,
        broker_url=clean_redis,
        admin_token=ADMIN_TOKEN,
        agent_token=AGENT_TOKEN,
        heartbeat_interval=0.5,
        heartbeat_timeout=3.0,
        queue_snapshot_seconds=0,  # each read sees the queue as it is; test_queue_snapshots.py keeps them
    )


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """Remember each phase's outcome on the item, so fixtures can tell that their test failed."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


def call_failed(request: pytest.FixtureRequest) -> bool:
    report = getattr(request.node, "report_call", None)
    return bool(report is not None and report.failed)
