"""Benchmark of one scheduling pass: ``place()`` over a deterministic queue of gangs.

    python bench/bench_placement.py [--jobs 10000 --agents 1000 --repeat 5]

Prints one line of JSON; ``ok`` says whether the median pass met the goal of 0.5 s, which the
design sets for 10,000 queued gangs on 1,000 agents.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

try:
    from server.placement import AgentSlots, PendingJob, place
except ModuleNotFoundError:  # run as a script from a checkout where the project is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from server.placement import AgentSlots, PendingJob, place

GOAL_S = 0.5
SLOTS_PER_AGENT = 8
SEED = 20240601


def workload(jobs: int, agents: int, seed: int = SEED) -> tuple[list[PendingJob], list[AgentSlots]]:
    """A queue of mixed gangs and a cluster of 8-slot cpu and gpu agents, some partly busy."""
    rng = random.Random(seed)
    cluster: list[AgentSlots] = []
    for agent_id in range(agents):
        slot_type = "gpu" if rng.random() < 0.3 else "cpu"
        slots = list(range(SLOTS_PER_AGENT))
        if rng.random() < 0.4:  # partly busy: a random subset of its slots runs other jobs
            busy = set(rng.sample(slots, rng.randint(1, SLOTS_PER_AGENT)))
            slots = [index for index in slots if index not in busy]
        cluster.append(AgentSlots(agent_id, f"node-{agent_id:05d}", slot_type, SLOTS_PER_AGENT, tuple(slots)))
    rng.shuffle(cluster)
    queue: list[PendingJob] = []
    job_ids = rng.sample(range(1, jobs * 10 + 1), jobs)
    for seq, job_id in enumerate(job_ids):
        nodes = rng.choices(range(1, 9), weights=(40, 20, 10, 10, 5, 5, 5, 5))[0]
        queue.append(
            PendingJob(
                job_id=job_id,
                priority=rng.choice((0, 25, 50, 50, 50, 75, 100)),
                seq=seq,
                nodes=nodes,
                slots_per_node=rng.randint(1, SLOTS_PER_AGENT),
                slot_type="gpu" if rng.random() < 0.3 else "cpu",
            )
        )
    rng.shuffle(queue)
    return queue, cluster


def run(jobs: int, agents: int, repeat: int) -> dict[str, object]:
    """Time ``repeat`` passes of ``place()`` on one workload; the figure is the median."""
    queue, cluster = workload(jobs, agents)
    timings: list[float] = []
    result = None
    for _ in range(max(1, repeat)):
        started = time.perf_counter()
        result = place(queue, cluster)
        timings.append(time.perf_counter() - started)
    assert result is not None
    median_s = statistics.median(timings)
    return {
        "bench": "placement",
        "jobs": jobs,
        "agents": agents,
        "repeat": len(timings),
        "median_s": round(median_s, 4),
        "min_s": round(min(timings), 4),
        "placed": len(result.placements),
        "waiting": len(result.waiting),
        "goal_s": GOAL_S,
        "ok": median_s <= GOAL_S,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--agents", type=int, default=1_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    report = run(args.jobs, args.agents, args.repeat)
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
