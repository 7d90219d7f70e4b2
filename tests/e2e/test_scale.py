"""The control-plane simulator (bench/bench_scale.py) in a small configuration, so that it never
rots: 50 simulated agents speaking the real protocol to a real server and scheduler on PostgreSQL
and Redis, a backlog larger than the cluster, jobs that end and are replaced."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_simulator_fills_a_cluster_and_keeps_it_busy_without_a_server_error() -> None:
    agents, slots, jobs = 50, 8, 500
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "bench_scale.py"),
            *("--agents", str(agents), "--slots", str(slots), "--jobs", str(jobs), "--gangs", "5"),
            *("--job-seconds", "4", "--stationary", "--steady-seconds", "20", "--metrics-interval", "2", "--json"),
            # registered over one heartbeat interval, the agents' beats are spread over it: at the
            # default 100 a second, 50 agents beat within 0.5 s of every 2 s, and a storm of a
            # second could fall between two bursts and time no heartbeat
            *("--register-rate", "25"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["agents"] == agents
    # The backlog holds more one-slot jobs than the cluster has slots: the fill leaves none free.
    assert result["peak_slots_held"] == agents * slots, result
    assert result["placements_per_s"] > 0
    assert result["jobs_stored"] >= jobs
    assert result["nodes_completed_per_s"] > 0, "no job ended and was replaced in the steady state"
    assert result["heartbeats"] > agents and result["heartbeat_p99_ms"] is not None
    assert result["floor_p99_ms"] is not None, "the floor server was not timed"
    assert result["api_p99_ms"] is not None and result["agents_list_p99_ms"] is not None
    assert result["storm_s"] < 60 and result["storm_nodes_unstarted"] == 0, "the nodes of the fill did not all start"
    for phase in ("submit", "storm", "steady"):  # each phase timed on its own
        assert result["phases"][phase]["heartbeat_p99_ms"] is not None, result["phases"]
    assert result["phases"]["steady"]["api_p99_ms"] is not None, result["phases"]
    assert result["db_commits_per_s"] > 0
    assert not [k for k in result["non_2xx"] if k.split()[-1].startswith("5")], result["non_2xx"]
    assert result["client_errors"] == {}, result["client_error_examples"]
