"""Scaling efficiency: the same job at several sizes, each for a bounded number of steps. The
server runs it (`POST /api/v1/scaling`, `server/scaling.py`); this module holds the arithmetic both
sides share.

Each size is a job of its own (`<name>-scaling-n<N>`, `resources.nodes = N`), run until rank 0
has reported `warmup + steps` steps and then killed (a measurement needs no clean end). Its rate
comes from rank 0's metric points, stamped by the rank itself: steps `warmup` to `warmup + steps`
over the time between them, so neither the start nor the kill counts. Throughput is that rate
times the world size (per-rank batches a second: weak scaling, each rank keeps its batch), and
efficiency = throughput(N) / (N / N0 x throughput(N0)) for the smallest size N0 measured (N0 = 1
gives the textbook throughput(N) / (N x throughput(1))). The communication share is the job's
`communication.comm_fraction`, from `ctx.prepare_model`'s figures.

The script must report a metric every step (`ctx.report`) and run at least `warmup + steps`
steps; the job file's other settings are kept.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from phalanx.schemas import JobSpec, ScalingPoint


class ScalingError(RuntimeError):
    """A size could not be measured: the job failed, never reported, or ended too early."""


@dataclass(frozen=True)
class Measured:
    """One size as measured, before it is compared with the smallest."""

    nodes: int
    world_size: int
    job_id: int
    steps_per_second: float
    comm_fraction: float | None
    bytes_per_step: float | None


def sized_spec(spec: JobSpec, nodes: int) -> JobSpec:
    name = f"{spec.name[:40]}-scaling-n{nodes}"  # within the 64 characters of a name
    return spec.model_copy(update={"name": name, "resources": spec.resources.model_copy(update={"nodes": nodes})})


def rate_of(job_id: int, step_times: Mapping[int, float], warmup: int, steps: int) -> float:
    """Rank 0's steps per second from the first time it reported each step (unix seconds), over
    steps `warmup`..`warmup + steps` (or as many of them as it reported, at least half)."""
    target = warmup + steps
    inside = {step: when for step, when in step_times.items() if warmup <= step <= target}
    first, last = min(inside, default=None), max(inside, default=None)
    if first is None or last is None or last - first < max(steps // 2, 1):
        raise ScalingError(
            f"job {job_id}: rank 0 reported steps {first}..{last}; the script must report a metric every "
            f"step and run at least {target} steps"
        )
    elapsed = inside[last] - inside[first]
    if elapsed <= 0:
        raise ScalingError(f"job {job_id}: its steps {first}..{last} carry no time between them")
    return (last - first) / elapsed


def points(measured: list[Measured]) -> list[ScalingPoint]:
    """Each size against linear scaling from the smallest one measured."""
    if not measured:
        return []
    base = min(measured, key=lambda m: m.nodes)
    out = []
    for m in sorted(measured, key=lambda m: m.nodes):
        throughput = m.steps_per_second * m.world_size
        ideal = base.steps_per_second * base.world_size * m.nodes / base.nodes
        out.append(
            ScalingPoint(
                nodes=m.nodes,
                world_size=m.world_size,
                job_id=m.job_id,
                steps_per_second=m.steps_per_second,
                throughput=throughput,
                efficiency=throughput / ideal if ideal > 0 else 0.0,
                comm_fraction=m.comm_fraction,
                bytes_per_step=m.bytes_per_step,
            )
        )
    return out
