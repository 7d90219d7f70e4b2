"""Metric storage at 100 M points: ingest and chart reads against an empty table, and what
retention (`server.retention`) does to a weeks-long job's rows and chart.

    python bench/bench_metric_growth.py [--points 100000000 --jobs 160 --database phalanx_growth]

1. Fill (skipped when `--database` already holds the points): one RUNNING job that reported 4
   metrics every step for 28 days (a fifth of the points, 5 M steps a metric at 100 M) and
   `--jobs` finished jobs one after another sharing the rest, stored roughly in time order as
   ingest stores them. Rows go in by INSERT ... SELECT generate_series with the foreign-key
   triggers off (session_replication_role): ~10 minutes and ~25 GB at 100 M points. The database
   is dropped at the end unless `--keep`; a rerun on a kept one skips the fill.
2. Ingest: bench_ingest's API-vs-COPY round against the full database, then one against a fresh
   empty one, alternating `--ingest-repeat` times: what 100 M stored points cost each new point.
3. Chart read: the server's chart data for the long job (its 4 series read and LTTB'd to 2,000
   points each), median of `--repeat`, against the same job alone in a fresh database.
4. Retention with the default policy (7 days at full resolution, then M4 buckets of 40 steps;
   after 30 days of 400): passes of the default budget back to back until one finishes, the rows
   they deleted per second, then the chart read again and the rows left.

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psycopg

from bench import bench_ingest
from bench._common import PG_ADMIN, fresh_database, log, median
from server import retention
from server.dashboard.metric_series import load_series
from server.db import session_factory, upgrade
from server.settings import Retention, Settings

NAMES = ("loss", "lr", "grad_norm", "throughput")
DAYS = 28
CHUNK = 4_000_000  # rows a statement: progress, and no statement runs for minutes


def conninfo(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def database_url(name: str) -> str:
    return f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"


def ensure_database(name: str) -> str:
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is None:
            conn.execute(f'CREATE DATABASE "{name}"')
    url = database_url(name)
    upgrade(url)
    return url


def create_job(
    conn: psycopg.Connection[Any], owner: int, name: str, state: str, started: datetime, ended: datetime | None
) -> tuple[int, int]:
    spec = json.dumps({"name": name, "entrypoint": "python train.py"})
    row = conn.execute(
        "INSERT INTO jobs (name, owner_id, state, spec, priority, nodes, slots_per_node, slot_type, bundle_size,"
        " attempts, restarts_used, infra_restarts_used, submitted_at, started_at, ended_at, held)"
        " VALUES (%s, %s, %s, %s, 0, 1, 1, 'cpu', 0, 1, 0, 0, %s, %s, %s, false) RETURNING id",
        (name, owner, state, spec, started, started, ended),
    ).fetchone()
    assert row is not None
    job_id = int(row[0])
    latest = json.dumps({n: 0.5 for n in NAMES})
    row = conn.execute(
        "INSERT INTO allocations (job_id, attempt, master_addr, active, fenced, latest_metrics, created_at)"
        " VALUES (%s, 1, '127.0.0.1', %s, false, %s, %s) RETURNING id",
        (job_id, state == "RUNNING", latest, started),
    ).fetchone()
    assert row is not None
    return job_id, int(row[0])


def fill_points(
    conn: psycopg.Connection[Any],
    job: tuple[int, int],
    steps: range,
    start: datetime,
    per_step: float,
) -> None:
    """Steps `steps` of every metric in NAMES at rank 0, step s at `start + s * per_step` seconds."""
    job_id, allocation_id = job
    per_statement = max(1, CHUNK // len(NAMES))
    for low in range(steps.start, steps.stop, per_statement):
        high = min(steps.stop, low + per_statement) - 1
        conn.execute(
            "INSERT INTO metrics (job_id, allocation_id, rank, step, name, value, time, superseded)"
            " SELECT %s, %s, 0, s, n, 2.0 / (1 + s / 10000.0) + random() * 0.05,"
            " %s + s * %s * interval '1 second', false"
            " FROM generate_series(%s::bigint, %s::bigint) AS s, unnest(%s::text[]) AS n",
            (job_id, allocation_id, start, per_step, low, high, list(NAMES)),
        )
        conn.commit()


def fill(url: str, points: int, jobs: int) -> int:
    """The long job's id (a fifth of `points`, the rest shared by `jobs` finished jobs); fills
    only a database that holds none of it yet. Rows go in roughly in time order, as ingest
    stores them (the BRIN index on `time` depends on it): each finished job's points after the
    long job's points up to that job's end."""
    now = datetime.now(UTC).replace(tzinfo=None)
    start, span = now - timedelta(days=DAYS), timedelta(days=DAYS)
    long_steps = points // 5 // len(NAMES)
    long_per_step = span.total_seconds() / long_steps
    with psycopg.connect(conninfo(url)) as conn:
        found = conn.execute("SELECT id FROM jobs WHERE name = 'growth-long'").fetchone()
        if found is not None:
            return int(found[0])
        conn.execute("SET session_replication_role = replica")
        owner_row = conn.execute(
            "INSERT INTO users (name, is_admin, created_at) VALUES ('growth', true, %s) RETURNING id", (now,)
        ).fetchone()
        assert owner_row is not None
        owner = int(owner_row[0])
        long_job = create_job(conn, owner, "growth-long", "RUNNING", start, None)
        conn.commit()
        began = time.perf_counter()
        rest = points - long_steps * len(NAMES)
        steps_each = rest // max(jobs, 1) // len(NAMES)
        long_done = 1
        for index in range(jobs):
            # finished jobs one after another over the 28 days
            job_start = start + span * index / jobs
            job_end = job_start + span / jobs
            long_upto = min(long_steps + 1, int((job_end - start).total_seconds() / long_per_step) + 1)
            fill_points(conn, long_job, range(long_done, long_upto), start, long_per_step)
            long_done = long_upto
            job = create_job(conn, owner, f"growth-{index}", "COMPLETED", job_start, job_end)
            per_step = (job_end - job_start).total_seconds() / steps_each
            fill_points(conn, job, range(1, steps_each + 1), job_start, per_step)
            if index % 10 == 9:
                log(f"growth: {index + 1}/{jobs} finished jobs filled ({time.perf_counter() - began:.0f} s)")
        fill_points(conn, long_job, range(long_done, long_steps + 1), start, long_per_step)
        conn.execute("ANALYZE metrics")
        conn.commit()
    return long_job[0]


def chart_reads(url: str, job_id: int, repeat: int) -> list[float]:
    """Milliseconds to build the job's chart data (every series, LTTB to 2,000 points each), as
    `GET /jobs/{id}/chart-data` does."""
    sessions = session_factory(url)
    times = []
    for _ in range(repeat):
        with sessions() as session, session.begin():
            began = time.perf_counter()
            series, _ = load_series(session, job_id)
            times.append((time.perf_counter() - began) * 1000)
        if len(series) != len(NAMES):
            raise SystemExit(f"job {job_id} charted {len(series)} series, expected {len(NAMES)}")
    return times


def count(url: str, sql: str, *args: object) -> int:
    with psycopg.connect(conninfo(url)) as conn:
        row = conn.execute(sql, args).fetchone()
    return int(row[0]) if row else 0


def apply_retention(url: str) -> dict[str, Any]:
    """Passes of the default policy until none has work left: slices, rows deleted, seconds."""
    sessions = session_factory(url)
    began = time.perf_counter()
    passes = slices = deleted = 0
    while True:
        report = retention.retention_pass(sessions.begin, Retention(), budget_s=Settings().retention_pass_seconds)
        passes, slices, deleted = passes + 1, slices + report.slices, deleted + report.deleted
        if passes % 50 == 0:
            log(f"growth: retention {passes} passes, {deleted:,} rows deleted ({time.perf_counter() - began:.0f} s)")
        if report.finished:
            break
    seconds = time.perf_counter() - began
    return {"passes": passes, "slices": slices, "deleted": deleted, "seconds": round(seconds, 1),
            "deleted_per_s": round(deleted / seconds)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", type=int, default=100_000_000)
    parser.add_argument("--jobs", type=int, default=160)
    parser.add_argument("--database", default="phalanx_growth", help="kept between runs: the fill takes minutes")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--ingest-repeat", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep the database thinned (default: drop it at the end)")
    args = parser.parse_args(argv)

    url = ensure_database(args.database)
    began = time.perf_counter()
    long_job = fill(url, args.points, args.jobs)
    stored = count(url, "SELECT count(*) FROM metrics")
    log(f"growth: {stored:,} points stored (fill {time.perf_counter() - began:.0f} s)")
    long_points = count(url, "SELECT count(*) FROM metrics WHERE job_id = %s", long_job)

    # alternating, one round each, so the machine's drift lands on both sides alike
    full_runs: list[dict[str, Any]] = []
    empty_runs: list[dict[str, Any]] = []
    for _ in range(args.ingest_repeat):
        full_runs.append(bench_ingest.run(repeat=1, database_url=url))
        empty_runs.append(bench_ingest.run(repeat=1))
    full_rate = round(median([float(run["api_points_per_second"]) for run in full_runs]))
    empty_rate = round(median([float(run["api_points_per_second"]) for run in empty_runs]))
    full_copy = round(median([float(run["copy_points_per_second"]) for run in full_runs]))
    empty_copy = round(median([float(run["copy_points_per_second"]) for run in empty_runs]))
    chart_full = chart_reads(url, long_job, args.repeat)
    # the same long series alone in a database of its own: what the other 80 M points cost the read
    with fresh_database("phalanx_growth_alone") as alone:
        alone_job = fill(alone, long_points * 5, 0)
        chart_alone = chart_reads(alone, alone_job, args.repeat)
    log(f"growth: chart read {median(chart_full):.0f} ms at {stored:,} points, {median(chart_alone):.0f} ms alone")

    thinning = apply_retention(url)
    left = count(url, "SELECT count(*) FROM metrics")
    long_left = count(url, "SELECT count(*) FROM metrics WHERE job_id = %s", long_job)
    chart_thinned = chart_reads(url, long_job, args.repeat)
    if not args.keep:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{args.database}" WITH (FORCE)')
    result = {
        "bench": "metric_growth",
        "points_stored": stored,
        "long_job_points": long_points,
        "ingest_api_points_per_s_full": full_rate,
        "ingest_api_points_per_s_empty": empty_rate,
        "ingest_ratio_full_to_empty": round(full_rate / empty_rate, 3),
        "ingest_copy_points_per_s_full": full_copy,
        "ingest_copy_points_per_s_empty": empty_copy,
        "chart_ms_full": round(median(chart_full), 1),
        "chart_ms_alone": round(median(chart_alone), 1),
        "chart_ratio_full_to_alone": round(median(chart_full) / median(chart_alone), 3),
        "retention": thinning,
        "points_left": left,
        "long_job_points_left": long_left,
        "chart_ms_thinned": round(median(chart_thinned), 1),
        "chart_ratio_thinned_to_full": round(median(chart_thinned) / median(chart_full), 3),
        "cpus": os.cpu_count(),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
