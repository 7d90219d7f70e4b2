"""Metric ingestion into PostgreSQL through the API vs a raw psycopg COPY of the same rows.

    python bench/bench_ingest.py [--batches 20 --records 5000 --values 4 --clients 2 --repeat 3]

A real server process on a fresh migrated database takes `--batches` POSTs to
/api/v1/allocations/{id}/metrics (each `--records` records x `--values` values) from `--clients`
concurrent httpx clients; the bodies are encoded before the clock starts, so the figure is the
server's. Baseline: the identical rows (server.ingest.metric_rows, same columns) written by the
same number of threads, one COPY per batch in a transaction of its own, straight into the same
table with psycopg. Rounds alternate (API, COPY, API, ...); figures are medians of points/s.
Goals: API >= 100,000 points/s and API / COPY >= 0.5. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import psycopg

from bench._common import (
    ADMIN_TOKEN,
    AGENT_TOKEN,
    BenchError,
    ProcessGroup,
    free_port,
    fresh_database,
    log,
    median,
    start_server,
    without_phalanx_env,
)
from phalanx.client import Client
from phalanx.schemas import AgentRegistration, JobSpec, MetricRecord, Resources
from scheduler.service import schedule_pass
from server.db import session_scope
from server.ingest import COPY_METRICS, metric_rows

GOAL_POINTS_PER_SECOND = 100_000
GOAL_RATIO = 0.5
# Its own Redis database: the server only publishes wake-ups there.
BROKER_URL = "redis://127.0.0.1:6379/9"


def make_batches(batches: int, records: int, values: int, round_no: int) -> list[list[MetricRecord]]:
    names = [f"metric_{v}" for v in range(values)]
    now = time.time()
    out = []
    for b in range(batches):
        base = (round_no * batches + b) * records
        out.append(
            [
                MetricRecord(
                    rank=r % 2,
                    step=base + r,
                    time=now + (base + r) * 0.001,
                    values={name: (base + r) * 0.5 + v for v, name in enumerate(names)},
                )
                for r in range(records)
            ]
        )
    return out


def concurrently(clients: int, jobs: list[Any], work: Callable[[int, Any], None]) -> float:
    """Run work(worker_index, job) for every job on `clients` threads; the wall time in seconds."""
    shares = [jobs[i::clients] for i in range(clients)]

    def worker(index: int) -> None:
        for job in shares[index]:
            work(index, job)

    with ThreadPoolExecutor(clients) as pool:
        started = time.perf_counter()
        for future in [pool.submit(worker, i) for i in range(clients)]:
            future.result()
        return time.perf_counter() - started


def post_api(url: str, allocation_id: int, credential: str, bodies: list[bytes], clients: int) -> float:
    """POST the batches as the allocation's ranks do, with its own credential."""
    https = [httpx.Client(base_url=url, headers={"Authorization": f"Bearer {credential}"}) for _ in range(clients)]
    path = f"/api/v1/allocations/{allocation_id}/metrics"
    headers = {"Content-Type": "application/json"}

    def post(index: int, body: bytes) -> None:
        response = https[index].post(path, content=body, headers=headers, timeout=120)
        if response.status_code != 204:
            raise BenchError(f"POST {path} answered {response.status_code}: {response.text[:500]}")

    try:
        return concurrently(clients, bodies, post)
    finally:
        for http in https:
            http.close()


def copy_direct(conninfo: str, row_batches: list[list[tuple[Any, ...]]], clients: int) -> float:
    connections = [psycopg.connect(conninfo) for _ in range(clients)]

    def copy(index: int, rows: list[tuple[Any, ...]]) -> None:
        conn = connections[index]
        with conn.transaction(), conn.cursor() as cursor, cursor.copy(COPY_METRICS) as out:
            for row in rows:
                out.write_row(row)

    try:
        return concurrently(clients, row_batches, copy)
    finally:
        for conn in connections:
            conn.close()


def create_allocation(url: str, database_url: str) -> tuple[int, int, str]:
    """Register one agent, submit a 1-node job and place it in-process: (job id, allocation id,
    the allocation's credential, as the agent hands it to the ranks)."""
    with Client(url, AGENT_TOKEN) as agent, Client(url, ADMIN_TOKEN) as admin:
        # a name of its own: bench_metric_growth runs this twice on one database
        name = f"bench-agent-{uuid.uuid4().hex[:8]}"
        registered = agent.register_agent(AgentRegistration(name=name, address="127.0.0.1", cpu_slots=1))
        agent.use_token(registered.agent_token)
        spec = JobSpec(name="ingest-bench", entrypoint="python train.py", resources=Resources(nodes=1))
        job = admin.submit(spec)
        with session_scope(database_url) as session:
            schedule_pass(session)
        assignments = agent.agent_work(registered.id).assignments
    if not assignments:
        raise BenchError(f"the scheduling pass placed no allocation for job {job.id}")
    return job.id, assignments[0].allocation_id, assignments[0].credential


def run(
    batches: int = 20,
    records: int = 5_000,
    values: int = 4,
    clients: int = 2,
    repeat: int = 3,
    database_url: str | None = None,
) -> dict[str, object]:
    """The rounds on a fresh database, or on `database_url` (migrated; its job and points stay)."""
    points_per_round = batches * records * values
    api_rates: list[float] = []
    copy_rates: list[float] = []
    given = contextlib.nullcontext(database_url) if database_url else fresh_database()
    with given as database_url, tempfile.TemporaryDirectory(prefix="phalanx-bench-") as tmp:
        conninfo = database_url.replace("postgresql+psycopg://", "postgresql://")
        env = {
            **without_phalanx_env(),
            "PHALANX_DATA_DIR": str(Path(tmp) / "data"),
            "PHALANX_DATABASE_URL": database_url,
            "PHALANX_BROKER_URL": BROKER_URL,
            "PHALANX_ADMIN_TOKEN": ADMIN_TOKEN,
            "PHALANX_AGENT_TOKEN": AGENT_TOKEN,
            # No scheduler runs, so nothing reaps the agent that never heartbeats; say so anyway.
            "PHALANX_HEARTBEAT_TIMEOUT": "3600",
        }
        group = ProcessGroup(Path(tmp) / "logs", env)
        try:
            url = start_server(group, free_port())
            job_id, allocation_id, credential = create_allocation(url, database_url)
            for round_no in range(repeat):
                api_batches = make_batches(batches, records, values, 2 * round_no)
                bodies = [json.dumps({"records": [r.model_dump() for r in batch]}).encode() for batch in api_batches]
                seconds = post_api(url, allocation_id, credential, bodies, clients)
                api_rates.append(points_per_round / seconds)
                copy_batches = make_batches(batches, records, values, 2 * round_no + 1)
                rows = [metric_rows(job_id, allocation_id, batch) for batch in copy_batches]
                seconds = copy_direct(conninfo, rows, clients)
                copy_rates.append(points_per_round / seconds)
                log(f"ingest round {round_no + 1}/{repeat}: api {api_rates[-1]:,.0f} pts/s, copy {copy_rates[-1]:,.0f}")
            group.check()
            with psycopg.connect(conninfo) as conn:
                row = conn.execute("SELECT count(*) FROM metrics WHERE allocation_id = %s", (allocation_id,)).fetchone()
                stored = row[0] if row else 0
        finally:
            group.close()
    expected = 2 * repeat * points_per_round
    if stored != expected:
        raise BenchError(f"the metrics table holds {stored} points of this run, expected {expected}")
    api, copy = median(api_rates), median(copy_rates)
    ratio = api / copy
    return {
        "bench": "ingest",
        "batches": batches,
        "records_per_batch": records,
        "values_per_record": values,
        "clients": clients,
        "repeat": repeat,
        "api_points_per_second": round(api),
        "copy_points_per_second": round(copy),
        "ratio": round(ratio, 3),
        "goal_api_points_per_second": GOAL_POINTS_PER_SECOND,
        "goal_ratio": GOAL_RATIO,
        "ok": api >= GOAL_POINTS_PER_SECOND and ratio >= GOAL_RATIO,
        "api_runs": [round(r) for r in api_rates],
        "copy_runs": [round(r) for r in copy_rates],
        "cpus": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--records", type=int, default=5_000)
    parser.add_argument("--values", type=int, default=4)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    report = run(args.batches, args.records, args.values, args.clients, args.repeat)
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
