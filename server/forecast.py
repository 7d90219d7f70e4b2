"""When queued jobs may start: a pure replay of the placement policy over the running jobs' ends.

Contract
--------
- ``estimate_starts()`` does no I/O and never mutates its inputs.
- The running jobs whose remaining time is known end in that order; after each end the policy
  (``server.placement.place``, with the same sharing rules but no preemption) places what it can,
  and those jobs get that end as their estimated start. Jobs placed by the forecast itself never
  end in it (nothing says how long they run), so a job that waits on one gets no estimate.
- A job placed at once (by the next pass) starts in 0 s.
- Cost: at most ``max_events + 1`` placement passes over the first ``max_jobs`` jobs in line.

An estimate is only as good as the declared totals (`total_steps` in the job file) and the step
rates so far; it says nothing about jobs submitted later that may go first by fair share.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

from server.placement import AgentSlots, PendingJob, RunningJob, Sharing, place

__all__ = ["estimate_starts"]


def estimate_starts(
    pending: Sequence[PendingJob],
    agents: Sequence[AgentSlots],
    sharing: Sharing,
    remaining_s: Mapping[int, float],
    *,
    max_events: int = 64,
    max_jobs: int = 500,
) -> dict[int, float]:
    """job_id -> seconds from now until it may start, for the jobs that get an estimate.

    ``remaining_s``: running job id -> seconds until it ends (jobs missing here never end).
    ``pending`` is taken in the order given (the caller passes the queue's placement order) and cut
    at ``max_jobs``."""
    queue = list(pending[:max_jobs])
    free = {(a.slot_type, a.agent_id): len(a.free) for a in agents}
    shape = {(a.slot_type, a.agent_id): a for a in agents}
    running = {run.job_id: run for run in sharing.running}
    no_preemption = replace(sharing, min_runtime_s=math.inf)
    ends = sorted((seconds, job_id) for job_id, seconds in remaining_s.items() if job_id in running)
    by_id = {job.job_id: job for job in queue}
    estimates: dict[int, float] = {}
    now = 0.0
    for event in range(min(len(ends), max_events) + 1):
        if event > 0:
            now, ended = ends[event - 1]
            run = running.pop(ended)
            for agent_id, slots in run.slots:
                key = (run.slot_type, agent_id)
                if key in free:
                    free[key] = min(free[key] + slots, shape[key].capacity)
        views = [_with_free(shape[key], count) for key, count in free.items()]
        result = place(queue, views, replace(no_preemption, running=tuple(running.values())))
        if not result.placements:
            continue
        for placement in result.placements:
            job = by_id[placement.job_id]
            estimates[job.job_id] = now
            for node in placement.nodes:
                free[(job.slot_type, node.agent_id)] -= len(node.slot_indices)
            held = tuple((node.agent_id, len(node.slot_indices)) for node in placement.nodes)
            running[job.job_id] = RunningJob(job.job_id, job.team, job.user, job.slot_type, job.priority, held, 0.0)
        placed = {p.job_id for p in result.placements}
        queue = [job for job in queue if job.job_id not in placed]
        if not queue:
            break
    return estimates


def _with_free(agent: AgentSlots, count: int) -> AgentSlots:
    return AgentSlots(agent.agent_id, agent.name, agent.slot_type, agent.capacity, tuple(range(count)))
