"""JAX, not PyTorch, under `launcher: plain` on the real stack: examples/jax/train.py on 2 nodes x 1
slot, its processes joined by jax.distributed.initialize from the variables the launcher sets, the
gradients averaged across them by gloo."""

from __future__ import annotations

import subprocess
import sys

import pytest

from phalanx.client import load_job_file
from phalanx.schemas import JobState
from tests.e2e.test_launchers import all_exited
from tests.processes import REPO, Stack, processes_of_allocation, wait_for

pytestmark = pytest.mark.e2e

JOB = REPO / "examples" / "jax" / "job.yaml"


def losses(lines: list[str]) -> list[tuple[int, float]]:
    """(step, loss) of every `step N loss X` line."""
    return [(int(w[1]), float(w[3])) for w in (line.split() for line in lines) if len(w) == 4 and w[0] == "step"]


def test_jax_trains_data_parallel_on_two_nodes(stack: Stack) -> None:
    spec, workdir = load_job_file(JOB)
    # The same script alone: one process, whole batches. Averaged over two processes' halves of
    # every batch, the gradient is the same, and so is each printed loss (a sum instead of a
    # mean, or no all-reduce at all, would not be).
    alone = subprocess.Popen(
        [sys.executable, "train.py", *spec.entrypoint.split()[2:]],
        cwd=workdir,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    with stack.client() as client:
        final = client.wait(client.submit(spec, workdir).id, timeout=180)
        assert final.state is JobState.COMPLETED, final.failure_reason
        logs = client.logs(final.id, limit=10_000)
    out, _ = alone.communicate(timeout=120)
    assert alone.returncode == 0, out[-2000:]

    by_rank = {rank: [r.line for r in logs if r.rank == rank] for rank in (0, 1)}
    for rank, lines in by_rank.items():
        assert sum(line.startswith(f"jax process {rank}/2 devices ") for line in lines) == 1, lines[-10:]
    trained = losses(by_rank[0])
    assert trained[-1][1] < trained[0][1] / 4, trained
    assert trained == [(step, pytest.approx(loss, abs=2e-3)) for step, loss in losses(out.splitlines())]
    # Each process trained its own copy on a different half of every batch: equal parameters at
    # the end mean every step's gradients were averaged across the two.
    sums = {
        rank: [line.split(":", 1)[1].strip() for line in lines if line.startswith("final-checksum:")]
        for rank, lines in by_rank.items()
    }
    assert len(sums[0]) == 1 and sums[0] == sums[1], sums


def test_killing_a_jax_job_leaves_no_process(stack: Stack) -> None:
    spec, workdir = load_job_file(JOB)
    spec = spec.model_copy(update={"entrypoint": "python train.py --steps 1000000 --log-every 20"})
    with stack.client() as client:
        job = client.submit(spec, workdir)
        # a step past the first needs both processes in the loop (each step is an all-reduce)
        wait_for(
            lambda: any(s >= 40 for s, _ in losses([r.line for r in client.logs(job.id, rank=0, limit=1000)])),
            120,
            "both processes to train",
            interval=0.5,
        )
        allocation_id = client.get_job(job.id).allocations[0].id
        assert processes_of_allocation(stack, allocation_id)
        assert client.kill_job(job.id).state is JobState.CANCELLED
        wait_for(lambda: all_exited(client, job.id), 30, "every node to report its exit")
    assert processes_of_allocation(stack, allocation_id) == []
