"""The lists at scale: the jobs list (REST and dashboard), the overview and the agents page with
100,000 jobs and 1,000 agents.

    python bench/bench_lists.py [--jobs 100000] [--agents 1000] [--repeat 100] [--json]

A fresh PostgreSQL database filled through SQL (bulk INSERT ... SELECT, seconds): `--jobs` jobs,
newest last, the newest 300 QUEUED, the 1,000 before them RUNNING (one node of four CPU slots on
an agent each, with their slot leases), the rest COMPLETED, FAILED or CANCELLED, each with one
submission event and, unless queued, an attempt with latest metrics; a tenth owned by alice, a tenth
by bob, the rest by the admin; every seventh in alice's team, every eleventh in bob's. `--agents`
agents of eight CPU slots (a few DRAINING and LOST). Redis is the benchmarks' own database.

The app runs in this process (`server.app.create_app`, Starlette's TestClient: no network, no
other process), so a request's time is the server's own: routing, the session, SQL, rendering.
Each list is requested `--repeat` times after two warm-ups; median and p99 in milliseconds:

- REST `GET /api/v1/jobs` (100 a page): the first page as the admin, as alice (the access filter:
  her jobs and her team's) and as carol (no job, no team: every job filtered out); a deep page by
  keyset (`before` = the 150th oldest id) as the admin and as alice, and the same page by OFFSET
  (the baseline: `offset_vs_keyset` is how many times slower it is);
- dashboard `/jobs` (first page as the admin and as alice, and a deep page by `before`),
  `/overview` (admin, alice), `/agents` (first page, and the last page by `after`).

Goal: every p99 <= 150 ms on the 2-core development machine. Prints progress on stderr and, as its
last stdout line, one JSON object (`--json`: that line only, nothing else on stdout).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastapi.testclient import TestClient
from sqlalchemy import text

from bench._common import ADMIN_TOKEN, AGENT_TOKEN, REDIS_URL, BenchError, fresh_database, log
from phalanx.schemas import JobSpec
from server.app import create_app, freeze_startup_heap
from server.db import engine_for
from server.settings import Settings

GOAL_P99_MS = 150.0
QUEUED = 300
RUNNING = 1000
SLOTS_PER_AGENT = 8
SLOTS_PER_JOB = 4
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

# One statement per table; :n jobs, :agents agents. Ids are given, so every list knows its range.
FILL = [
    """
    INSERT INTO agents (id, name, address, state, cpu_slots, gpu_slots, registered_at, last_heartbeat)
    SELECT a, 'node' || a, '10.0.' || (a / 250) || '.' || (a % 250), CASE
        WHEN a % 200 = 7 THEN 'LOST' WHEN a % 200 = 3 THEN 'DRAINING' ELSE 'ACTIVE' END,
        :slots, 0, timezone('utc', now()), timezone('utc', now())
    FROM generate_series(1, :agents) AS a
    """,
    """
    INSERT INTO jobs (id, name, owner_id, team_id, state, spec, priority, nodes, slots_per_node, slot_type,
                      bundle_size, wait_reason, failure_reason, attempts, restarts_used, infra_restarts_used,
                      submitted_at, started_at, ended_at, held)
    SELECT g, 'job-' || g,
        CASE g % 10 WHEN 0 THEN :alice WHEN 1 THEN :bob ELSE :admin END,
        CASE WHEN g % 7 = 0 THEN :vision WHEN g % 11 = 0 THEN :nlp END,
        s.state,
        CAST(jsonb_set(CAST(:spec AS jsonb), '{team}', CAST(CASE WHEN g % 7 = 0 THEN '"vision"'
            WHEN g % 11 = 0 THEN '"nlp"' ELSE 'null' END AS jsonb)) AS json),
        50, 1, :per_job, 'cpu', 0,
        CASE WHEN s.state = 'QUEUED' THEN 'waiting for the next scheduling pass' END,
        CASE WHEN s.state = 'FAILED' THEN 'rank 0 exited with code 1' END,
        CASE WHEN s.state = 'QUEUED' THEN 0 ELSE 1 END, 0, 0,
        timezone('utc', now()) - (:n - g) * interval '1 minute',
        CASE WHEN s.state <> 'QUEUED' THEN timezone('utc', now()) - (:n - g) * interval '1 minute' END,
        CASE WHEN s.state NOT IN ('QUEUED', 'RUNNING')
            THEN timezone('utc', now()) - (:n - g) * interval '30 second' END,
        false
    FROM generate_series(1, :n) AS g,
    LATERAL (SELECT CASE
        WHEN g > :n - :queued THEN 'QUEUED'
        WHEN g > :n - :queued - :running THEN 'RUNNING'
        WHEN g % 20 = 3 THEN 'FAILED'
        WHEN g % 20 = 5 THEN 'CANCELLED'
        ELSE 'COMPLETED' END AS state) AS s
    """,
    """
    INSERT INTO job_events (job_id, time, from_state, to_state, reason)
    SELECT id, submitted_at, NULL, 'QUEUED', 'submitted' FROM jobs ORDER BY id
    """,
    """
    INSERT INTO allocations (id, job_id, attempt, master_addr, active, fenced, latest_metrics, latest_step,
                             created_at, ended_at)
    SELECT id, id, 1, '10.0.0.1', state = 'RUNNING', state <> 'RUNNING',
        jsonb_build_object('loss', 1.0 / (1 + id % 97), 'accuracy', (id % 89) / 89.0), id % 5000,
        submitted_at, ended_at
    FROM jobs WHERE state <> 'QUEUED'
    """,
    # each running job: one node of SLOTS_PER_JOB slots on its own agent (the LOST ones' too: a
    # lost agent's leases stay until its nodes are accounted for)
    """
    INSERT INTO allocation_nodes (id, allocation_id, node_rank, agent_id, slot_type, slot_indices, state,
                                  desired, started_at)
    SELECT j.id, j.id, 0, (j.id % :agents) + 1, 'cpu', CAST('[0, 1, 2, 3]' AS json), 'RUNNING', 'run', j.started_at
    FROM jobs AS j WHERE j.state = 'RUNNING'
    """,
    """
    INSERT INTO slot_leases (agent_id, slot_type, slot_index, node_id)
    SELECT n.agent_id, 'cpu', i, n.id FROM allocation_nodes AS n, generate_series(0, :per_job - 1) AS i
    """,
    "SELECT setval('jobs_id_seq', :n)",
    "SELECT setval('agents_id_seq', :agents)",
    "SELECT setval('allocations_id_seq', :n)",
    "SELECT setval('allocation_nodes_id_seq', :n)",
]


def fill(client: TestClient, url: str, jobs: int, agents: int) -> dict[str, str]:
    """The rows above; returns the users' tokens by name (carol: no job, no team). Users and
    teams through the API, as anyone would create them; the bulk through SQL."""
    if agents < RUNNING or jobs < QUEUED + RUNNING + 200:
        raise BenchError(f"at least {RUNNING} agents and {QUEUED + RUNNING + 200} jobs (one running job per agent)")
    tokens = {}
    for name in ("alice", "bob", "carol"):
        minted = client.post("/api/v1/tokens", json={"kind": "user", "name": name}, headers=ADMIN)
        minted.raise_for_status()
        tokens[name] = minted.json()["token"]
    for team, member in (("vision", "alice"), ("nlp", "bob")):
        client.post("/api/v1/teams", json={"name": team}, headers=ADMIN).raise_for_status()
        client.put(f"/api/v1/teams/{team}/members/{member}", json={"role": "member"}, headers=ADMIN).raise_for_status()
    spec = JobSpec.model_validate(
        {"name": "job", "entrypoint": "python train.py", "resources": {"nodes": 1, "slots_per_node": SLOTS_PER_JOB}}
    )
    with engine_for(url).begin() as conn:
        ids: dict[str, int] = {name: id_ for name, id_ in conn.execute(text("SELECT name, id FROM users"))}
        teams: dict[str, int] = {name: id_ for name, id_ in conn.execute(text("SELECT name, id FROM teams"))}
        params = {
            "n": jobs,
            "agents": agents,
            "slots": SLOTS_PER_AGENT,
            "per_job": SLOTS_PER_JOB,
            "queued": QUEUED,
            "running": RUNNING,
            "alice": ids["alice"],
            "bob": ids["bob"],
            "admin": ids["admin"],
            "vision": teams["vision"],
            "nlp": teams["nlp"],
            "spec": json.dumps(spec.model_dump(mode="json")),
        }
        for statement in FILL:
            clause = text(statement)
            conn.execute(clause, {k: v for k, v in params.items() if f":{k}" in statement})
    with engine_for(url).connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE"))  # as autovacuum would soon: plans on real statistics
    return tokens


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def measure(client: TestClient, path: str, token: str, repeat: int) -> dict[str, float]:
    """`path` as the holder of `token` (a bearer token for the API, the session cookie for pages)."""
    client.cookies.set("phalanx_session", token)
    headers = {"Authorization": f"Bearer {token}"} if path.startswith("/api/") else {}
    for _ in range(2):
        client.get(path, headers=headers).raise_for_status()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        response = client.get(path, headers=headers)
        times.append((time.perf_counter() - started) * 1000)
        response.raise_for_status()
    return {"median_ms": round(statistics.median(times), 1), "p99_ms": round(p99(times), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--agents", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=100)
    parser.add_argument("--json", action="store_true", help="only the JSON line on stdout")
    args = parser.parse_args()

    with fresh_database("phalanx_lists") as url, tempfile.TemporaryDirectory(prefix="phalanx-lists-") as tmp:
        settings = Settings(
            data_dir=Path(tmp) / "data",
            database_url=url,
            broker_url=REDIS_URL,
            admin_token=ADMIN_TOKEN,
            agent_token=AGENT_TOKEN,
        )
        app = create_app(settings, enqueue=lambda *_, **__: None)
        freeze_startup_heap()  # as `phalanx server` does once its app is built
        with TestClient(app, follow_redirects=False) as client:
            started = time.perf_counter()
            users = fill(client, url, args.jobs, args.agents)
            log(f"{args.jobs} jobs and {args.agents} agents stored in {time.perf_counter() - started:.1f} s")
            deep = 150  # the page below the 150th oldest job: 100 rows, as the first page has
            page = client.get("/api/v1/jobs", params={"before": deep + 1, "limit": 100}, headers=ADMIN)
            by_offset = client.get("/api/v1/jobs", params={"offset": args.jobs - deep, "limit": 100}, headers=ADMIN)
            if [j["id"] for j in page.json()] != [j["id"] for j in by_offset.json()]:
                raise BenchError("the keyset page and the OFFSET page differ")
            if "older →" not in client.get("/jobs", cookies={"phalanx_session": ADMIN_TOKEN}).text:
                raise BenchError("the dashboard's jobs page has no link to older jobs")
            alice, carol = users["alice"], users["carol"]
            cases = [
                ("rest_first_page", "/api/v1/jobs?limit=100", ADMIN_TOKEN),
                ("rest_first_page_member", "/api/v1/jobs?limit=100", alice),
                ("rest_first_page_no_jobs", "/api/v1/jobs?limit=100", carol),
                ("rest_deep_keyset", f"/api/v1/jobs?limit=100&before={deep + 1}", ADMIN_TOKEN),
                ("rest_deep_offset", f"/api/v1/jobs?limit=100&offset={args.jobs - deep}", ADMIN_TOKEN),
                ("rest_deep_keyset_member", f"/api/v1/jobs?limit=100&before={deep + 1}", alice),
                ("page_jobs", "/jobs", ADMIN_TOKEN),
                ("page_jobs_deep", f"/jobs?before={deep + 1}", ADMIN_TOKEN),
                ("page_jobs_member", "/jobs", alice),
                ("page_overview", "/overview", ADMIN_TOKEN),
                ("page_overview_member", "/overview", alice),
                ("page_agents", "/agents", ADMIN_TOKEN),
                ("page_agents_last", f"/agents?after={args.agents - 50}", ADMIN_TOKEN),
            ]
            results = {}
            for name, path, token in cases:
                results[name] = measure(client, path, token, args.repeat)
                log(f"{name}: {results[name]}")
    offset_ms = results["rest_deep_offset"]["median_ms"]
    worst = max(r["p99_ms"] for r in results.values() if r is not results["rest_deep_offset"])
    result = {
        "benchmark": "lists",
        "jobs": args.jobs,
        "agents": args.agents,
        "repeat": args.repeat,
        **results,
        "offset_vs_keyset": round(offset_ms / results["rest_deep_keyset"]["median_ms"], 1),
        "worst_p99_ms": worst,
        "goal_p99_ms": GOAL_P99_MS,
        "ok": worst <= GOAL_P99_MS,
    }
    if not args.json:
        for name, figures in results.items():
            log(f"{name}: p99 {figures['p99_ms']} ms (goal {GOAL_P99_MS})")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
