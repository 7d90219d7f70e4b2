"""examples/gpt on the real stack: 2 nodes, bf16 autocast, gradient accumulation; a SIGKILLed rank
resumes from the last checkpoint and ends with the parameters of an uninterrupted run."""

from __future__ import annotations

import pytest

from phalanx.client import load_job_file
from phalanx.schemas import JobState
from tests.processes import REPO, Stack, final_checksum, sigkill_rank, wait_for

pytestmark = pytest.mark.e2e
GPT = REPO / "examples" / "gpt" / "job.yaml"
STEPS = 20


def test_the_gpt_example_resumes_a_sigkilled_rank_exactly(stack: Stack) -> None:
    spec, workdir = load_job_file(GPT)
    # A short run: small micro-batches (bf16 matmuls are slow on CPUs without bf16 instructions),
    # still two per step, so no_sync and the all-reduce of the accumulated gradients both run.
    hparams = {**spec.hyperparameters, "batch_size": 4, "grad_accum": 2, "checkpoint_every": 5}
    spec = spec.model_copy(
        update={"entrypoint": f"python train.py --steps {STEPS}", "hyperparameters": hparams, "total_steps": STEPS}
    )
    with stack.client() as client:
        reference = client.wait(client.submit(spec, workdir).id, timeout=180)
        assert reference.state is JobState.COMPLETED, reference.failure_reason
        expected = final_checksum(client, reference.id)
        losses = {p.step: p.value for p in client.metrics(reference.id, name="loss") if p.rank == 0}
        assert sorted(losses) == list(range(1, STEPS + 1))
        assert losses[STEPS] < losses[1]
        assert "lr" in reference.latest_metrics

        job = client.submit(spec, workdir)
        wait_for(lambda: client.checkpoints(job.id), 120, "the first committed checkpoint")
        sigkill_rank(stack, client.get_job(job.id).allocations[0].id, rank=1)
        final = client.wait(job.id, timeout=180)
        assert final.state is JobState.COMPLETED, final.failure_reason
        assert final.attempts == 2
        resume_step = final.allocations[1].resume_step
        assert resume_step is not None and resume_step < STEPS
        assert final_checksum(client, job.id) == expected  # exactly where the uninterrupted run ended
        steps = [p.step for p in client.metrics(job.id, name="loss") if p.rank == 0]
        assert sorted(steps) == list(range(1, STEPS + 1))  # the re-done steps once each
