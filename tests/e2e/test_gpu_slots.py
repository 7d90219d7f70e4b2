"""The GPU path without a GPU: agents find 4 GPUs through a stub `nvidia-smi` on PATH, `slot_type:
gpu` jobs are placed on them, and each node's ranks see only their own GPUs (CUDA_VISIBLE_DEVICES),
two jobs on one agent never the same ones."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.client import Client
from phalanx.schemas import JobSpec, JobState
from tests.processes import Stack, two_agent_stack, wait_for

pytestmark = pytest.mark.e2e

NVIDIA_SMI = """#!/bin/sh
# what `nvidia-smi -L` prints on a machine with four GPUs
for i in 0 1 2 3; do echo "GPU $i: NVIDIA H100 80GB HBM3 (UUID: GPU-0000000$i-stub)"; done
"""

SHOW_DEVICES = """
import os, sys, time
env = os.environ
print(f"devices rank {env['RANK']} local {env['LOCAL_RANK']}: {env['CUDA_VISIBLE_DEVICES']}", flush=True)
if len(sys.argv) > 1:
    time.sleep(float(sys.argv[1]))
"""


@pytest.fixture
def gpu_stack(clean_db: str, clean_redis: str, tmp_path: Path) -> Iterator[Stack]:
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "nvidia-smi").write_text(NVIDIA_SMI)
    (stub / "nvidia-smi").chmod(0o755)
    path = f"{stub}{os.pathsep}{os.environ['PATH']}"
    with two_agent_stack(tmp_path, clean_db, clean_redis, PATH=path) as running:
        yield running


def gpu_job(tmp_path: Path, linger_s: float = 0) -> tuple[JobSpec, Path]:
    workdir = tmp_path / "gpu"
    workdir.mkdir(exist_ok=True)
    (workdir / "show.py").write_text(textwrap.dedent(SHOW_DEVICES))
    entry = "python show.py" + (f" {linger_s}" if linger_s else "")
    spec = JobSpec(
        name="gpu-ranks",
        entrypoint=entry,
        launcher="plain",
        resources={"nodes": 2, "slots_per_node": 2, "slot_type": "gpu"},
    )
    return spec, workdir


def devices(client: Client, job_id: int) -> dict[int, str]:
    lines = [line for line in client.logs(job_id, limit=1000) if line.line.startswith("devices rank")]
    return {int(line.line.split()[2]): line.line.rsplit(": ", 1)[1] for line in lines}


def test_gpu_jobs_get_their_own_gpus_on_each_node(gpu_stack: Stack, tmp_path: Path) -> None:
    with gpu_stack.client() as client:
        assert sorted((a.name, a.gpu_slots) for a in client.agents()) == [("node-a", 4), ("node-b", 4)]
        spec, workdir = gpu_job(tmp_path, linger_s=600)
        first = client.submit(spec, workdir)
        wait_for(lambda: len(devices(client, first.id)) == 4, 120, "the first job's four ranks")
        assert all(a.used_gpu_slots == 2 for a in client.agents())

        spec, workdir = gpu_job(tmp_path)
        second = client.wait(client.submit(spec, workdir).id, timeout=120)
        assert second.state is JobState.COMPLETED, second.failure_reason
        held, got = devices(client, first.id), devices(client, second.id)
        for rank in range(4):  # ranks 0-1 on one agent, 2-3 on the other
            assert len(held[rank].split(",")) == len(got[rank].split(",")) == 2
            assert not set(held[rank].split(",")) & set(got[rank].split(",")), (held, got)
        assert held[0] == held[1] and got[0] == got[1]  # a node's ranks share its GPUs (LOCAL_RANK picks one)
        client.kill_job(first.id)
