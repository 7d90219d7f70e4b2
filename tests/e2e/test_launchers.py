"""`launcher: plain` on the real stack: a torch.distributed script that knows nothing of Phalanx,
on 2 nodes x 2 slots, with the same logs, failure reasons and kills as torchrun jobs."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.client import Client
from phalanx.schemas import JobSpec, JobState
from tests.processes import Stack, processes_of_allocation, two_agent_stack, wait_for

pytestmark = pytest.mark.e2e

RAW_DDP = """
import os, sys, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method="env://")  # MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
rank, world = dist.get_rank(), dist.get_world_size()
local, node = int(os.environ["LOCAL_RANK"]), int(os.environ["NODE_RANK"])
assert os.environ["LOCAL_WORLD_SIZE"] == "2" and rank == node * 2 + local
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
crash = os.environ.get("CRASH_RANK")
if crash is not None and rank == int(crash):
    print(f"rank {rank} fails on purpose", file=sys.stderr, flush=True)
    sys.exit(5)
if os.environ.get("LINGER"):
    print(f"rank {rank} lingering", flush=True)
    time.sleep(600)
print(f"raw rank {rank}/{world} node {node} local {local} sum {total.item():.0f}", flush=True)
dist.destroy_process_group()
"""


@pytest.fixture
def wide_stack(clean_db: str, clean_redis: str, tmp_path: Path) -> Iterator[Stack]:
    with two_agent_stack(tmp_path, clean_db, clean_redis, cpu_slots=2) as running:
        yield running


def raw_job(tmp_path: Path, **env: str) -> tuple[JobSpec, Path]:
    workdir = tmp_path / "raw"
    workdir.mkdir(exist_ok=True)
    (workdir / "raw_ddp.py").write_text(textwrap.dedent(RAW_DDP))
    spec = JobSpec(
        name="raw-ddp",
        entrypoint="python raw_ddp.py",
        launcher="plain",
        resources={"nodes": 2, "slots_per_node": 2},
        env=env,
    )
    return spec, workdir


def all_exited(client: Client, job_id: int) -> bool:
    return all(n.state.value == "EXITED" for n in client.get_job(job_id).allocations[0].nodes)


def test_a_raw_torch_distributed_script_runs_on_two_nodes_of_two_slots(wide_stack: Stack, tmp_path: Path) -> None:
    spec, workdir = raw_job(tmp_path)
    with wide_stack.client() as client:
        final = client.wait(client.submit(spec, workdir).id, timeout=180)
        assert final.state is JobState.COMPLETED, final.failure_reason
        lines = {line.rank: line.line for line in client.logs(final.id, limit=1000) if "raw rank" in line.line}
    assert lines == {r: f"raw rank {r}/4 node {r // 2} local {r % 2} sum 10" for r in range(4)}


def test_a_failing_plain_rank_fails_the_job_naming_it(wide_stack: Stack, tmp_path: Path) -> None:
    spec, workdir = raw_job(tmp_path, CRASH_RANK="3")
    with wide_stack.client() as client:
        final = client.wait(client.submit(spec, workdir).id, timeout=180)
        wait_for(lambda: all_exited(client, final.id), 30, "every node to report its exit")
    assert final.state is JobState.FAILED
    assert final.failure_reason and "node 1" in final.failure_reason
    assert "rank 3 exited with code 5" in final.failure_reason and "fails on purpose" in final.failure_reason
    assert processes_of_allocation(wide_stack, final.allocations[0].id) == []


def test_killing_a_plain_job_leaves_no_process(wide_stack: Stack, tmp_path: Path) -> None:
    spec, workdir = raw_job(tmp_path, LINGER="1")
    with wide_stack.client() as client:
        job = client.submit(spec, workdir)
        wait_for(
            lambda: sum("lingering" in line.line for line in client.logs(job.id, limit=1000)) == 4,
            120,
            "all four ranks to run",
        )
        allocation_id = client.get_job(job.id).allocations[0].id
        assert client.kill_job(job.id).state is JobState.CANCELLED
        wait_for(lambda: all_exited(client, job.id), 30, "every node to report its exit")
    assert processes_of_allocation(wide_stack, allocation_id) == []
