"""Fault tolerance with real processes and real torch.distributed: exact resume after a SIGKILL."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from phalanx.client import Client, load_job_file
from phalanx.schemas import JobSpec, JobState, MetricPoint
from tests.processes import (
    REPO,
    Stack,
    final_checksum,
    free_port,
    processes_of_allocation,
    processes_with_env,
    sigkill_rank,
    two_agent_stack,
    wait_for,
)

pytestmark = pytest.mark.e2e
DIGITS = REPO / "examples" / "digits" / "job.yaml"
EPOCHS = 60  # long enough (several seconds) to kill a rank between two checkpoints


def assert_each_step_once(points: list[MetricPoint], steps: int) -> None:
    for rank in (0, 1):
        assert sorted(p.step for p in points if p.rank == rank) == list(range(steps)), f"rank {rank}"


def digits_spec() -> tuple[JobSpec, Path]:
    spec, workdir = load_job_file(DIGITS)
    return spec.model_copy(update={"entrypoint": f"python train.py --epochs {EPOCHS}", "max_restarts": 1}), workdir


def test_sigkilled_rank_resumes_to_the_same_parameters(stack: Stack) -> None:
    spec, workdir = digits_spec()
    with stack.client() as client:
        reference = client.submit(spec, workdir)
        done = client.wait(reference.id, timeout=300)
        assert done.state is JobState.COMPLETED and done.attempts == 1
        expected = final_checksum(client, reference.id)

        job = client.submit(spec, workdir)
        wait_for(lambda: client.checkpoints(job.id), 120, "the first committed checkpoint")
        sigkill_rank(stack, client.get_job(job.id).allocations[0].id, rank=1)

        final = client.wait(job.id, timeout=300)
        assert final.state is JobState.COMPLETED, final.failure_reason
        assert final.attempts == 2 and final.restarts_used == 1
        first, second = final.allocations
        assert first.end_reason and "node" in first.end_reason and second.resume_step is not None
        assert any(e.to_state is JobState.RESTARTING for e in final.events)
        assert final_checksum(client, job.id) == expected

        # every step is shown once: the re-done steps of the failed attempt are superseded
        steps = [p.step for p in client.metrics(job.id, name="loss") if p.rank == 0]
        assert len(steps) == len(set(steps)) and max(steps) == len(steps)
        # retention: keep_last 2 + keep_best 1 of val_accuracy; files and rows agree
        checkpoints = client.checkpoints(job.id)
        assert 2 <= len(checkpoints) <= 3
    assert processes_of_allocation(stack, first.id) == [] and processes_of_allocation(stack, second.id) == []
    storage = Path(checkpoints[0].path.removeprefix("file://")).parent
    wait_for(
        lambda: sorted(p.name for p in storage.iterdir()) == sorted(Path(c.path).name for c in checkpoints),
        30,
        "retention to delete the dropped checkpoints' files",
    )


SCRIPTED = REPO / "examples" / "scripted" / "job.yaml"


def submit_scripted_and_await_training(client: Client, steps: int) -> int:
    """The scripted example for `steps` steps of 50 ms; its id once it reported ten steps."""
    spec, workdir = load_job_file(SCRIPTED)
    spec = spec.model_copy(update={"hyperparameters": {"steps": steps, "step_seconds": 0.05}})
    job = client.submit(spec, workdir)
    wait_for(lambda: (client.get_job(job.id).latest_step or 0) >= 10, 120, "ten steps")
    return job.id


def test_control_plane_killed_mid_run_loses_nothing(stack: Stack) -> None:
    """kill -9 the server and the scheduler while the job trains; agents and workers buffer and
    retry, and after the restart the job completes with every step's metrics present once."""
    steps = 120
    with stack.client() as client:
        job_id = submit_scripted_and_await_training(client, steps)
    stack.stop("server", signal.SIGKILL)
    stack.stop("scheduler", signal.SIGKILL)
    with stack.client() as client:
        assert not client.healthy()
    allocation = processes_with_env("PHALANX_JOB_ID", str(job_id), RANK="0", PHALANX_URL=stack.url)
    assert allocation, "the workers must keep training while the control plane is down"
    stack.start_server()
    stack.start_scheduler()
    with stack.client() as client:
        final = client.wait(job_id, timeout=180)
        assert final.state is JobState.COMPLETED, final.failure_reason
        assert final.attempts == 1 and final.restarts_used == 0 and final.infra_restarts_used == 0
        points = client.metrics(job_id, name="step_value")
    assert_each_step_once(points, steps)


def test_crash_while_writing_a_checkpoint_keeps_the_latest_loadable(stack: Stack) -> None:
    """SIGKILL rank 0 while it writes a large checkpoint: the half-written folder never becomes a
    checkpoint, and the restarted attempt loads the previous, complete one."""
    spec, workdir = load_job_file(SCRIPTED)
    hparams = {"steps": 400, "step_seconds": 0.02, "checkpoint_every": 5, "checkpoint_mb": 96}
    spec = spec.model_copy(update={"hyperparameters": hparams, "max_restarts": 1})
    with stack.client() as client:
        job = client.submit(spec, workdir)
        wait_for(lambda: client.checkpoints(job.id), 120, "a committed checkpoint")
        allocation = client.get_job(job.id).allocations[0].id
        root = Path(client.checkpoints(job.id)[0].path.removeprefix("file://")).parent

        def writing() -> list[int]:
            # rank 0 is inside torch.save when a temporary folder holds a partial state file
            if not any(p.name.endswith(".tmp") and any(p.iterdir()) for p in root.iterdir()):
                return []
            return processes_with_env("PHALANX_ALLOCATION_ID", str(allocation), RANK="0", PHALANX_URL=stack.url)

        (rank0,) = wait_for(writing, 60, "rank 0 in the middle of a checkpoint write", interval=0.01)
        os.kill(rank0, signal.SIGKILL)
        final = client.wait(job.id, timeout=300)
        assert final.state is JobState.COMPLETED, final.failure_reason
        assert final.attempts == 2
        resumed = [line.line for line in client.logs(job.id, rank=0, limit=10_000) if "resumed from" in line.line]
        assert resumed, "the second attempt did not resume from a checkpoint"
        for checkpoint in client.checkpoints(job.id):
            assert not checkpoint.path.endswith(".tmp")


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[tuple[str, Callable[[], subprocess.Popen[bytes]]]]:
    """A Redis of this test's own (killing the shared one would hit everything else): its URL and
    a function that (re)starts it on the same port."""
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server is not installed (.ci/run installs it)")
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        argv = [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        proc = subprocess.Popen([*argv, "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
        procs.append(proc)
        client = redis.Redis(port=port)
        wait_for(lambda: _pings(client), 30, "the private redis-server to answer")
        client.close()
        return proc

    try:
        yield f"redis://127.0.0.1:{port}/0", start
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def test_redis_killed_mid_run_training_goes_on(
    clean_db: str, tmp_path: Path, private_redis: tuple[str, Callable[[], subprocess.Popen[bytes]]]
) -> None:
    """kill -9 Redis (the broker and the wake-up channel) while the job trains: ranks keep training
    and reporting through the server, and once Redis is back the job completes with no restart."""
    url, start_redis = private_redis
    redis_proc = start_redis()
    with two_agent_stack(tmp_path, clean_db, url) as stack:
        steps = 160
        with stack.client() as client:
            job_id = submit_scripted_and_await_training(client, steps)
            redis_proc.kill()
            redis_proc.wait()
            down_at = client.get_job(job_id).latest_step or 0
            # metrics keep arriving while Redis is down: training and reporting do not need it
            wait_for(lambda: (client.get_job(job_id).latest_step or 0) >= down_at + 20, 60, "20 more steps")
            assert client.get_job(job_id).state is JobState.RUNNING
            start_redis()
            final = client.wait(job_id, timeout=180)
            assert final.state is JobState.COMPLETED, final.failure_reason
            assert final.attempts == 1 and final.restarts_used == 0 and final.infra_restarts_used == 0
            points = client.metrics(job_id, name="step_value")
        assert_each_step_once(points, steps)
