"""Framework integrations on the real stack: 2 nodes, metrics, checkpoints, a SIGKILLed rank that
resumes from the last checkpoint, and a pause that resumes from the checkpoint written on stop."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.client import Client, load_job_file
from phalanx.schemas import JobSpec, JobState
from tests.processes import REPO, Stack, final_checksum, sigkill_rank, wait_for

pytestmark = pytest.mark.e2e
LIGHTNING = REPO / "examples" / "lightning" / "job.yaml"


def lightning_job(epochs: int) -> tuple[JobSpec, Path]:
    spec, workdir = load_job_file(LIGHTNING)
    return spec.model_copy(update={"entrypoint": f"python train.py --epochs {epochs}", "max_restarts": 1}), workdir


def test_lightning_resumes_a_sigkilled_rank_from_its_checkpoint(stack: Stack) -> None:
    spec, workdir = lightning_job(epochs=40)
    with stack.client() as client:
        job = client.submit(spec, workdir)
        wait_for(lambda: client.checkpoints(job.id), 180, "Lightning's first checkpoint, committed")
        saved = max(c.step for c in client.checkpoints(job.id))
        assert saved > 0
        wait_for(lambda: client.metrics(job.id, name="loss"), 120, "self.log values to arrive as job metrics")
        sigkill_rank(stack, client.get_job(job.id).allocations[0].id, rank=1)
        final = client.wait(job.id, timeout=300)
        assert final.state is JobState.COMPLETED, final.failure_reason
        assert final.attempts == 2
        second = final.allocations[1]
        assert second.resume_step is not None and second.resume_step >= saved  # not from step 0
        resumed = [line.line for line in client.logs(job.id, rank=0, limit=10_000) if "Restoring states" in line.line]
        assert resumed, "Lightning restored the trainer's state from the checkpoint"
        assert "val_accuracy" in final.latest_metrics


def test_a_paused_lightning_job_resumes_from_the_checkpoint_written_on_stop(stack: Stack) -> None:
    spec, workdir = lightning_job(epochs=200)
    with stack.client() as client:
        job = client.submit(spec, workdir)
        wait_for(lambda: (client.get_job(job.id).latest_step or 0) >= 30, 180, "thirty steps")
        client.pause_job(job.id)
        wait_for(
            lambda: all(n.state.value == "EXITED" for n in client.get_job(job.id).allocations[0].nodes),
            60,
            "both nodes to stop",
        )
        stop_step = max(c.step for c in client.checkpoints(job.id))
        assert stop_step >= 30, "the stop wrote a checkpoint of the step it stopped at"
        assert client.get_job(job.id).state is JobState.PAUSED
        client.resume_job(job.id)
        wait_for(lambda: len(client.get_job(job.id).allocations) == 2, 120, "the second attempt")
        assert client.get_job(job.id).allocations[1].resume_step == stop_step
        client.kill_job(job.id)


RESUMABLE = REPO / "examples" / "resumable" / "job.yaml"


def test_the_ten_line_port_resumes_a_sigkilled_rank_exactly(stack: Stack) -> None:
    spec, workdir = load_job_file(RESUMABLE)
    spec = spec.model_copy(update={"entrypoint": "python train.py --epochs 40"})
    with stack.client() as client:
        reference = client.wait(client.submit(spec, workdir).id, timeout=300)
        assert reference.state is JobState.COMPLETED, reference.failure_reason
        expected = final_checksum(client, reference.id)

        job = client.submit(spec, workdir)
        wait_for(lambda: client.checkpoints(job.id), 120, "the first committed checkpoint")
        sigkill_rank(stack, client.get_job(job.id).allocations[0].id, rank=1)
        final = client.wait(job.id, timeout=300)
        assert final.state is JobState.COMPLETED, final.failure_reason
        assert final.attempts == 2 and final.allocations[1].resume_step is not None
        assert final_checksum(client, job.id) == expected  # exactly where the uninterrupted run ended


HF_TRAINER = REPO / "examples" / "hf_trainer" / "job.yaml"


def hf_job(epochs: int) -> tuple[JobSpec, Path]:
    spec, workdir = load_job_file(HF_TRAINER)
    return spec.model_copy(update={"entrypoint": f"python train.py --epochs {epochs}", "max_restarts": 1}), workdir


def loss_steps(client: Client, job_id: int, allocation_id: int) -> list[int]:
    """The steps of the loss values one attempt reported."""
    points = client.metrics(job_id, name="loss", all_attempts=True)
    return [point.step for point in points if point.allocation_id == allocation_id]


def test_transformers_resumes_a_sigkilled_rank_from_its_checkpoint(stack: Stack) -> None:
    spec, workdir = hf_job(epochs=6)  # 26 steps an epoch on 2 ranks; the Trainer saves every 40
    with stack.client() as client:
        job = client.submit(spec, workdir)
        wait_for(lambda: client.checkpoints(job.id), 180, "the Trainer's first checkpoint, committed")
        saved = max(c.step for c in client.checkpoints(job.id))
        assert saved >= 40
        wait_for(lambda: client.metrics(job.id, name="loss"), 120, "the Trainer's logged loss as a job metric")
        sigkill_rank(stack, client.get_job(job.id).allocations[0].id, rank=1)
        final = client.wait(job.id, timeout=300)
        assert final.state is JobState.COMPLETED, final.failure_reason
        assert final.attempts == 2
        second = final.allocations[1]
        assert second.resume_step is not None and second.resume_step >= saved  # not from step 0
        resumed = loss_steps(client, job.id, second.id)
        assert resumed and min(resumed) > second.resume_step, "the Trainer went on from the checkpoint's step"
        assert final.latest_step == 6 * 26
        assert {"loss", "learning_rate", "grad_norm"} <= set(final.latest_metrics)


def test_a_paused_transformers_job_resumes_from_the_checkpoint_written_on_stop(stack: Stack) -> None:
    spec, workdir = hf_job(epochs=100)
    with stack.client() as client:
        job = client.submit(spec, workdir)
        wait_for(lambda: (client.get_job(job.id).latest_step or 0) >= 20, 180, "twenty steps")
        client.pause_job(job.id)
        wait_for(
            lambda: all(n.state.value == "EXITED" for n in client.get_job(job.id).allocations[0].nodes),
            60,
            "both nodes to stop",
        )
        stop_step = max(c.step for c in client.checkpoints(job.id))
        assert stop_step >= 20, "the stop wrote a checkpoint of the step it stopped at"
        assert client.get_job(job.id).state is JobState.PAUSED
        client.resume_job(job.id)
        wait_for(lambda: len(client.get_job(job.id).allocations) == 2, 120, "the second attempt")
        assert client.get_job(job.id).allocations[1].resume_step == stop_step
        second = client.get_job(job.id).allocations[1].id
        resumed = wait_for(
            lambda: loss_steps(client, job.id, second),
            180,
            "the resumed attempt's first logged loss",
        )
        assert min(resumed) > stop_step, "the Trainer went on from the stop checkpoint's step"
        client.kill_job(job.id)
