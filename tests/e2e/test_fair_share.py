"""Fair sharing on the real stack: server, scheduler and two one-slot agents as processes, real
torchrun ranks. A team that arrives later goes first by fair share; a limited team never runs past
its limit while slots are free; a team below its guarantee preempts a borrower, which checkpoints
and completes from that checkpoint to the same parameters as an undisturbed run."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from phalanx.client import Client, load_job_file
from phalanx.schemas import JobDetail, JobSpec, JobState
from tests.conftest import call_failed
from tests.e2e.test_fault_tolerance import DIGITS
from tests.processes import REPO, Stack, final_checksum, two_agent_stack, wait_for

pytestmark = pytest.mark.e2e
SCRIPTED = REPO / "examples" / "scripted" / "job.yaml"
NEVER = datetime.max
GRACE_S = 60  # a preempted digits job checkpoints within a second; the grace only bounds a stuck one


@pytest.fixture
def stack(clean_db: str, clean_redis: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Stack]:
    env = {"PHALANX_PREEMPTION_MIN_RUNTIME": "0", "PHALANX_PREEMPTION_GRACE": str(GRACE_S)}
    with two_agent_stack(tmp_path, clean_db, clean_redis, **env) as running:
        yield running
        if call_failed(request):
            print(running.dump())


def member_of(admin: Client, url: str, user: str, team: str) -> Client:
    """A new user's client, alone in a new team."""
    token = admin.create_token("user", user).token
    admin.create_team(team)
    admin.set_team_member(team, user)
    return Client(url, token)


def scripted(name: str, steps: int, nodes: int = 1) -> tuple[JobSpec, Path]:
    spec, workdir = load_job_file(SCRIPTED)
    spec = spec.model_copy(
        update={
            "name": name,
            "resources": spec.resources.model_copy(update={"nodes": nodes}),
            "hyperparameters": {**spec.hyperparameters, "steps": steps, "step_seconds": 0.05},
        }
    )
    return spec, workdir


def test_a_team_that_submits_later_starts_before_the_busy_teams_backlog(stack: Stack) -> None:
    """Two teams of equal weight on 2 slots: A submits 6 jobs, B 2 once A's first two run; B's
    first job takes the first slot that frees up, before A's third job (strict FIFO would run
    all of A's first). A's first two jobs differ in length so that one slot frees at a time,
    and run long enough that B has submitted by then."""
    with (
        stack.client() as admin,
        member_of(admin, stack.url, "ann", "a") as a,
        member_of(admin, stack.url, "bea", "b") as b,
    ):
        spec, workdir = scripted("job", steps=40)
        steps = [120, 240, 40, 40, 40, 40]
        a_jobs = [
            a.submit(
                spec.model_copy(
                    update={"name": f"a{i}", "hyperparameters": {**spec.hyperparameters, "steps": steps[i]}}
                ),
                workdir,
            ).id
            for i in range(6)
        ]
        wait_for(lambda: all(a.get_job(j).started_at for j in a_jobs[:2]), 120, "team a's first two jobs to run")
        b_jobs = [b.submit(spec.model_copy(update={"name": f"b{i}"}), workdir).id for i in range(2)]
        assert not any(a.get_job(j).ended_at for j in a_jobs[:2]), "team a's first jobs ended before b submitted"
        for job_id in [*a_jobs, *b_jobs]:
            assert admin.wait(job_id, timeout=300).state is JobState.COMPLETED
        started = {job_id: admin.get_job(job_id).started_at or NEVER for job_id in [*a_jobs, *b_jobs]}
    assert started[b_jobs[0]] < started[a_jobs[3]], started
    assert started[b_jobs[0]] < started[a_jobs[2]], "b's first job should take the first slot that frees"


def test_a_limited_team_never_runs_past_its_limit_while_slots_are_free(stack: Stack) -> None:
    with stack.client() as admin, member_of(admin, stack.url, "sam", "small") as small:
        admin.set_team_policy("small", limit={"cpu": 1})
        spec, workdir = scripted("limited", steps=40)
        first = small.submit(spec, workdir).id
        second = small.submit(spec, workdir).id
        wait_for(lambda: small.get_job(first).state is JobState.RUNNING, 120, "the first job to run")

        def limited() -> JobDetail | None:
            job = small.get_job(second)
            return job if job.wait_reason and "limit" in job.wait_reason else None

        waiting = wait_for(limited, 30, "the second job's reason to name the limit")
        assert waiting.state is JobState.QUEUED
        assert "team small's limit is 1 cpu slot" in (waiting.wait_reason or "")
        assert sum(agent.used_cpu_slots for agent in admin.agents()) == 1  # a slot is free all along
        for job_id in (first, second):
            assert admin.wait(job_id, timeout=300).state is JobState.COMPLETED
        one, two = admin.get_job(first).allocations[0], admin.get_job(second).allocations[0]
    assert one.ended_at is not None and one.ended_at <= two.created_at, "the two ran at once"


def test_a_team_below_its_guarantee_preempts_a_borrower_that_resumes_to_the_same_parameters(stack: Stack) -> None:
    with (
        stack.client() as admin,
        member_of(admin, stack.url, "bob", "borrower") as borrower,
        member_of(admin, stack.url, "olga", "owner") as owner,
    ):
        admin.set_team_policy("owner", guarantee={"cpu": 2})
        spec, workdir = load_job_file(DIGITS)
        spec = spec.model_copy(update={"entrypoint": "python train.py --epochs 60", "max_restarts": 0})
        reference = borrower.submit(spec, workdir)
        assert borrower.wait(reference.id, timeout=300).state is JobState.COMPLETED
        expected = final_checksum(borrower, reference.id)

        borrowing = borrower.submit(spec, workdir)  # both slots, borrowed from the owner team
        wait_for(lambda: borrower.checkpoints(borrowing.id), 120, "the borrower's first checkpoint")
        short, short_dir = scripted("owed", steps=20, nodes=2)
        owed = owner.submit(short, short_dir)
        assert owner.wait(owed.id, timeout=300).state is JobState.COMPLETED
        final = borrower.wait(borrowing.id, timeout=300)
        assert final.state is JobState.COMPLETED, final.failure_reason
        owed_events = owner.get_job(owed.id).events
    assert (final.attempts, final.restarts_used, final.infra_restarts_used) == (2, 0, 0)
    first, second = final.allocations
    assert first.end_reason and first.end_reason.startswith("preempted"), first.end_reason
    assert second.resume_step is not None and second.resume_step > 0
    assert any("costing no restart" in e.reason for e in final.events)
    assert any(f"preempting job {borrowing.id}" in e.reason for e in owed_events)
    with stack.client() as admin:
        assert final_checksum(admin, borrowing.id) == expected
