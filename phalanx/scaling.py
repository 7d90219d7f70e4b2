"""Scaling efficiency: the same job at several sizes, each for a bounded number of steps.

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

import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from phalanx.schemas import JobDetail, JobSpec, JobView, MetricPoint, ScalingPoint

POLL_S = 0.5
FIGURES_WAIT_S = 8.0  # the ranks report their communication figures 2 s in, then every 5 s


class Client(Protocol):
    """What a scaling run needs of `phalanx.Client` (which offers it as `Client.scaling`)."""

    def submit(self, spec: JobSpec, workdir: Path | None = None) -> JobView: ...
    def get_job(self, job_id: int) -> JobDetail: ...
    def kill_job(self, job_id: int) -> JobView: ...
    def metrics(
        self, job_id: int, name: str | None = None, limit: int = 100_000, all_attempts: bool = False, after: int = 0
    ) -> list[MetricPoint]: ...


class ScalingError(RuntimeError):
    """A size could not be measured: the job failed, never reported, or ended too early."""


def scaling(
    client: Client,
    spec: JobSpec,
    workdir: Path | None,
    nodes: list[int],
    steps: int = 100,
    warmup: int = 10,
    timeout: float = 900.0,
    progress: Callable[[str], None] | None = None,
) -> list[ScalingPoint]:
    """Run `spec` at each of `nodes` sizes in turn (smallest first) and measure it."""
    if not nodes or any(n < 1 for n in nodes):
        raise ValueError("nodes: give one or more sizes of at least 1, such as [1, 2, 4]")
    if steps < 1 or warmup < 0:
        raise ValueError("steps must be at least 1 and warmup at least 0")
    say = progress or (lambda _message: None)
    measured: list[tuple[int, int, float, float | None, float | None, int]] = []
    for size in sorted(set(nodes)):
        sized = spec.model_copy(
            update={
                "name": f"{spec.name}-scaling-n{size}",
                "resources": spec.resources.model_copy(update={"nodes": size}),
            }
        )
        job = client.submit(sized, workdir)
        say(f"{size} node(s): job {job.id} submitted")
        rate = _run_bounded(client, job.id, warmup, steps, timeout, say)
        detail = client.get_job(job.id)
        world = size * sized.resources.slots_per_node
        # one rank has no all-reduce and no figures; a gang's come 2 s in, the kill may beat them
        deadline = time.monotonic() + (FIGURES_WAIT_S if world > 1 else 0.0)
        while detail.communication is None and time.monotonic() < deadline:
            time.sleep(POLL_S)
            detail = client.get_job(job.id)
        comm = detail.communication
        measured.append(
            (
                size,
                world,
                rate,
                None if comm is None else comm.comm_fraction,
                None if comm is None else comm.bytes_per_step,
                job.id,
            )
        )
        say(f"{size} node(s): {rate:.2f} steps/s")
    base_nodes, _, base_rate, _, _, _ = measured[0]
    base_world = measured[0][1]
    points = []
    for size, world, rate, fraction, bytes_per_step, job_id in measured:
        throughput = rate * world
        ideal = base_rate * base_world * size / base_nodes
        points.append(
            ScalingPoint(
                nodes=size,
                world_size=world,
                job_id=job_id,
                steps_per_second=rate,
                throughput=throughput,
                efficiency=throughput / ideal if ideal > 0 else 0.0,
                comm_fraction=fraction,
                bytes_per_step=bytes_per_step,
            )
        )
    return points


def _run_bounded(
    client: Client, job_id: int, warmup: int, steps: int, timeout: float, say: Callable[[str], None]
) -> float:
    """Wait until rank 0 reported step `warmup + steps` (then kill the job), and return its rate
    over steps warmup..warmup+steps."""
    deadline = time.monotonic() + timeout
    target = warmup + steps
    while True:
        job = client.get_job(job_id)
        if job.latest_step is not None and job.latest_step >= target:
            break
        if job.state.is_terminal:
            if job.state.value != "COMPLETED":
                raise ScalingError(f"job {job_id} ended {job.state.value}: {job.failure_reason or 'see its logs'}")
            break  # it completed: its points say whether it ran long enough
        if time.monotonic() > deadline:
            client.kill_job(job_id)
            raise ScalingError(f"job {job_id} did not reach step {target} in {timeout:.0f} s; it was killed")
        time.sleep(POLL_S)
    if not client.get_job(job_id).state.is_terminal:
        client.kill_job(job_id)
        say(f"job {job_id}: step {target} reached, killed")
    times: dict[int, float] = {}
    after = 0
    while True:
        page = client.metrics(job_id, after=after, limit=100_000)
        if not page:
            break
        for point in page:
            if point.rank == 0 and warmup <= point.step <= target:
                times.setdefault(point.step, point.time.timestamp())
        after = page[-1].id
    first, last = min(times, default=None), max(times, default=None)
    if first is None or last is None or last - first < max(steps // 2, 1):
        raise ScalingError(
            f"job {job_id}: rank 0 reported steps {first}..{last}; the script must report a metric every "
            f"step and run at least {target} steps"
        )
    elapsed = times[last] - times[first]
    if elapsed <= 0:
        raise ScalingError(f"job {job_id}: its steps {first}..{last} carry no time between them")
    return (last - first) / elapsed
