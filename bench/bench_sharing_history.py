"""Fair sharing's read of past usage, with hours of history: what every scheduling pass and every
queue snapshot pays for it.

    python bench/bench_sharing_history.py [--nodes 100000 500000] [--repeat 5] [--json]

A fresh PostgreSQL database holds `--nodes` finished nodes (one one-slot attempt each, 20 teams)
placed evenly over the ten half-lives that decayed usage reads (10 hours at the default half-life
of one hour), each run for 10 minutes: a cluster of 1,000 agents x 8 slots whose jobs take ~10
minutes ends ~48,000 nodes an hour. Two ways of computing each team's decayed usage are timed in
turn, `--repeat` times each, in the same process on the same rows:

- `python`: every node's interval read as a row and decayed in Python (`sharing.slot_intervals`
  and `sharing.decayed_usage`), as passes read it before;
- `database`: the sum computed by the database, one row per team and slot type
  (`sharing.decayed_usage_in_database`), as passes read it now.

Both must agree (relative difference under 1e-9). Prints one JSON line per size: the medians, the
ratio, and the whole `sharing.load_sharing` read (usage, quotas, running jobs) as a pass makes it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from functools import partial
from pathlib import Path
from typing import TypeVar

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import text
from sqlalchemy.orm import Session

from bench._common import fresh_database, log
from server import sharing
from server.db import engine_for
from server.settings import Settings
from server.transitions import db_now

T = TypeVar("T")
TEAMS = 20
NODE_MINUTES = 10

FILL = [
    "INSERT INTO users (id, name, is_admin, created_at) VALUES (1, 'history', false, :now)",
    "INSERT INTO teams (id, name, weight, queue_held, created_at) "
    f"SELECT g, 'team-' || g, 1.0, false, :now FROM generate_series(1, {TEAMS}) g",
    "INSERT INTO agents (id, name, address, state, cpu_slots, gpu_slots, registered_at, last_heartbeat) "
    "VALUES (1, 'history', '127.0.0.1', 'LOST', 8, 0, :now, :now)",
    "INSERT INTO jobs (id, name, owner_id, team_id, state, spec, priority, nodes, slots_per_node, slot_type, "
    "bundle_size, attempts, restarts_used, infra_restarts_used, submitted_at, held) "
    f"SELECT g, 'h' || g, 1, 1 + g % {TEAMS}, 'SUCCEEDED', '{{}}', 0, 1, 1, 'cpu', 0, 1, 0, 0, :now, false "
    "FROM generate_series(1, :nodes) g",
    # placed evenly over the window, the newest just now
    "INSERT INTO allocations (id, job_id, attempt, master_addr, active, fenced, created_at, ended_at) "
    "SELECT g, g, 1, '127.0.0.1', false, true, "
    "  CAST(:now AS timestamp) - (:window * (1 - g::float / :nodes)) * interval '1 second', NULL "
    "FROM generate_series(1, :nodes) g",
    "INSERT INTO allocation_nodes (allocation_id, node_rank, agent_id, slot_type, slot_indices, state, desired, "
    "  ended_at) "
    f"SELECT a.id, 0, 1, 'cpu', '[0]', 'EXITED', 'run', a.created_at + interval '{NODE_MINUTES} minutes' "
    "FROM allocations a",
    # the nodes still running are open intervals
    "UPDATE allocation_nodes SET ended_at = NULL, state = 'RUNNING' WHERE ended_at > CAST(:now AS timestamp)",
    "ANALYZE",
]


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    began = time.perf_counter()
    result = fn()
    return time.perf_counter() - began, result


def measure(url: str, nodes: int, repeat: int) -> dict[str, object]:
    settings = Settings(database_url=url)
    half_life_s = settings.fair_share_half_life
    window_s = half_life_s * sharing.HALF_LIVES_READ
    engine = engine_for(url)
    with engine.begin() as conn:
        now = conn.execute(text("SELECT timezone('utc', now())")).scalar_one()
        for statement in FILL:
            conn.execute(text(statement), {"now": now, "nodes": nodes, "window": window_s})
    log(f"{nodes:,} nodes of history stored")

    times: dict[str, list[float]] = {"python": [], "database": [], "load_sharing": []}

    def in_python(session: Session, at: datetime) -> dict[tuple[str, str], float]:
        since = at - timedelta(seconds=window_s)
        return sharing.decayed_usage(sharing.slot_intervals(session, since, at), at, half_life_s)

    def in_database(session: Session, at: datetime) -> dict[tuple[str, str], float]:
        return sharing.decayed_usage_in_database(session, at, half_life_s)

    for _ in range(repeat):
        for name, read in (("python", in_python), ("database", in_database)):
            with Session(engine) as session, session.begin():
                at = db_now(session)
                seconds, _ = timed(partial(read, session, at))
            times[name].append(seconds)
        with Session(engine) as session, session.begin():
            at = db_now(session)
            seconds, _ = timed(partial(sharing.load_sharing, session, at, settings))
        times["load_sharing"].append(seconds)
    with Session(engine) as session, session.begin():  # the two answers, at one instant
        at = db_now(session)
        python, database = in_python(session, at), in_database(session, at)
    assert python.keys() == database.keys(), (sorted(python), sorted(database))
    for key, value in python.items():
        assert abs(database[key] - value) <= 1e-9 * max(1.0, abs(value)), (key, value, database[key])
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {
        "bench": "sharing_history",
        "nodes": nodes,
        "half_life_s": half_life_s,
        "python_s": round(medians["python"], 4),
        "database_s": round(medians["database"], 4),
        "speedup": round(medians["python"] / medians["database"], 1),
        "load_sharing_s": round(medians["load_sharing"], 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[100_000, 500_000])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="only the JSON lines on stdout")
    args = parser.parse_args()
    for nodes in args.nodes:
        with fresh_database("phalanx_history") as url:
            result = measure(url, nodes, args.repeat)
        if not args.json:
            log(f"{nodes:,} nodes: {result}")
        print(json.dumps(result))


if __name__ == "__main__":
    main()
