"""The whole stack as separate processes on PostgreSQL + Redis, with real 2-node DDP over gloo."""

from __future__ import annotations

import json

import pytest

from phalanx.client import load_job_file
from phalanx.schemas import JobState
from tests.processes import REPO, Stack, cli, processes_of_allocation, wait_for

pytestmark = pytest.mark.e2e
DIGITS = REPO / "examples" / "digits" / "job.yaml"
SCRIPTED = REPO / "examples" / "scripted" / "job.yaml"


def test_example_trains_as_a_two_node_ddp_job(stack: Stack) -> None:
    with stack.client() as client:
        job = client.submit_file(DIGITS)
        final = client.wait(job.id, timeout=240)
        assert final.state is JobState.COMPLETED, (final.failure_reason, stack.log("node-a")[-2000:])
        (allocation,) = final.allocations
        assert {n.agent_name for n in allocation.nodes} == {"node-a", "node-b"}
        assert all(n.exit_code == 0 for n in allocation.nodes)

        points = client.metrics(job.id, name="loss")
        assert {p.rank for p in points} == {0, 1}
        steps = sorted(p.step for p in points if p.rank == 0)
        assert steps == sorted(set(steps)) and len(steps) > 10
        assert "accuracy" in final.latest_metrics

        rank0 = [line.line for line in client.logs(job.id, rank=0, limit=10_000)]
        rank1 = [line.line for line in client.logs(job.id, rank=1, limit=10_000)]
        assert any(line.startswith("final-checksum:") for line in rank0)
        assert rank1 and not any(line.startswith("final-checksum:") for line in rank1)
    assert processes_of_allocation(stack, allocation.id) == []


def test_kill_mid_run_cancels_and_leaves_no_process(stack: Stack) -> None:
    spec, workdir = load_job_file(SCRIPTED)
    spec = spec.model_copy(update={"hyperparameters": {"steps": 100_000, "step_seconds": 0.05}})
    with stack.client() as client:
        job = client.submit(spec, workdir)
        wait_for(lambda: client.get_job(job.id).latest_step, 120, "the scripted job to report a step")
        allocation_id = client.get_job(job.id).allocations[0].id
        assert len(processes_of_allocation(stack, allocation_id)) >= 2  # torchrun and its rank on each node

        assert client.kill_job(job.id).state is JobState.CANCELLED
        wait_for(
            lambda: all(n.state.value == "EXITED" for n in client.get_job(job.id).allocations[0].nodes),
            30,
            "every node to report its exit",
        )
        assert processes_of_allocation(stack, allocation_id) == []
        final = client.get_job(job.id)
        assert final.state is JobState.CANCELLED
        assert [e.to_state.value for e in final.events][-1] == "CANCELLED"
        assert all(a.used_cpu_slots == 0 for a in client.agents())


def test_crashing_rank_fails_the_job_with_its_stderr(stack: Stack) -> None:
    spec, workdir = load_job_file(SCRIPTED)
    hparams = {"steps": 50, "step_seconds": 0.05, "crash_rank": 1, "crash_step": 3, "exit_code": 7}
    with stack.client() as client:
        job = client.submit(spec.model_copy(update={"hyperparameters": hparams}), workdir)
        final = client.wait(job.id, timeout=120)
        # the survivor on the other node is stopped (SIGTERM, then SIGKILL) and reports its exit
        wait_for(
            lambda: all(n.state.value == "EXITED" for n in client.get_job(job.id).allocations[0].nodes),
            30,
            "the surviving node to be stopped",
        )
    assert final.state is JobState.FAILED
    assert final.failure_reason and "node 1" in final.failure_reason
    assert "rank 1 exited with code 7" in final.failure_reason
    assert processes_of_allocation(stack, final.allocations[0].id) == []


def test_cli_against_the_stack(stack: Stack) -> None:
    submitted = json.loads(cli(stack, "submit", str(SCRIPTED), "--json").stdout)
    job_id = submitted["id"]
    waited = json.loads(cli(stack, "submit", str(SCRIPTED), "--wait", "--json").stdout)
    assert waited["state"] == "COMPLETED"
    shown = json.loads(cli(stack, "jobs", "show", str(job_id), "--json").stdout)
    assert shown["id"] == job_id and "latest_metrics" in shown and "state" in shown
    listed = json.loads(cli(stack, "jobs", "list", "--json").stdout)
    assert {j["id"] for j in listed} >= {job_id, waited["id"]}
    assert all("restarts_used" in j and "infra_restarts_used" in j for j in listed)
    table = cli(stack, "jobs", "list").stdout
    assert "restarts" in table and "infra" in table  # used/allowed, per budget
    agents = json.loads(cli(stack, "agents", "list", "--json").stdout)
    assert {a["name"] for a in agents} == {"node-a", "node-b"}
    logs = cli(stack, "jobs", "logs", str(waited["id"]), "--rank", "1").stdout
    assert logs and all(line.startswith("[rank 1]") for line in logs.splitlines())
    missing = cli(stack, "jobs", "show", "4242", ok=False)
    assert missing.returncode == 1 and "does not exist" in missing.stderr
    unreachable = cli(stack, "jobs", "list", ok=False, PHALANX_URL="http://127.0.0.1:9")
    assert unreachable.returncode == 1 and "phalanx up" in unreachable.stderr


def test_teams_through_the_cli(stack: Stack) -> None:
    alice = json.loads(cli(stack, "tokens", "create", "alice", "--json").stdout)["token"]
    cli(stack, "tokens", "create", "bob")
    assert "team ml created" in cli(stack, "teams", "create", "ml").stdout
    cli(stack, "teams", "add-member", "ml", "alice", "--role", "admin")
    cli(stack, "teams", "add-member", "ml", "bob", PHALANX_TOKEN=alice)  # a team admin manages members
    (team,) = json.loads(cli(stack, "teams", "list", "--json", PHALANX_TOKEN=alice).stdout)
    assert team["your_role"] == "admin" and [(m["user"], m["role"]) for m in team["members"]] == [
        ("alice", "admin"),
        ("bob", "member"),
    ]
    submitted = json.loads(cli(stack, "submit", str(SCRIPTED), "--json", PHALANX_TOKEN=alice).stdout)
    assert submitted["team"] == "ml"
    assert "team ml" in cli(stack, "jobs", "show", str(submitted["id"]), PHALANX_TOKEN=alice).stdout
    refused = cli(stack, "teams", "create", "other", ok=False, PHALANX_TOKEN=alice)
    assert refused.returncode == 1 and "cluster admin" in refused.stderr
    shown = cli(stack, "teams", "remove-member", "ml", "bob", PHALANX_TOKEN=alice).stdout
    assert "bob" not in shown and "alice (admin)" in shown


def test_sharing_through_the_cli(stack: Stack) -> None:
    """`teams set|hold|release`, `jobs hold|release`, `queue` and `usage`, as a user types them."""
    lead = json.loads(cli(stack, "tokens", "create", "lead", "--json").stdout)["token"]
    cli(stack, "teams", "create", "cv")
    cli(stack, "teams", "add-member", "cv", "lead", "--role", "admin")
    shown = cli(stack, "teams", "set", "cv", "--weight", "2", "--guarantee", "cpu=1", "--limit", "cpu=2").stdout
    assert "weight 2" in shown and "guarantee cpu=1" in shown and "limit cpu=2" in shown
    bad = cli(stack, "teams", "set", "cv", "--limit", "tpu=3", ok=False)
    assert bad.returncode == 2 and "cpu=8,gpu=2" in bad.stderr
    refused = cli(stack, "teams", "set", "cv", "--weight", "5", ok=False, PHALANX_TOKEN=lead)
    assert refused.returncode == 1 and "cluster admin" in refused.stderr

    assert "held" in cli(stack, "teams", "hold", "cv", PHALANX_TOKEN=lead).stdout
    job = json.loads(cli(stack, "submit", str(SCRIPTED), "--json", PHALANX_TOKEN=lead).stdout)
    queue = json.loads(cli(stack, "queue", "--json", PHALANX_TOKEN=lead).stdout)
    (entry,) = queue["entries"]
    assert entry["job_id"] == job["id"] and entry["position"] is None and "teams release cv" in entry["reason"]
    assert json.loads(cli(stack, "jobs", "hold", str(job["id"]), "--json", PHALANX_TOKEN=lead).stdout)["held"]
    cli(stack, "jobs", "release", str(job["id"]), PHALANX_TOKEN=lead)
    assert "released" in cli(stack, "teams", "release", "cv", PHALANX_TOKEN=lead).stdout
    with stack.client() as client:
        assert client.wait(job["id"], timeout=180).state is JobState.COMPLETED
    usage = json.loads(cli(stack, "usage", "--since", "1d", "--json", PHALANX_TOKEN=lead).stdout)
    assert [(row["team"], row["user"]) for row in usage["rows"]] == [("cv", "lead")] and usage["by_team"]["cv"] > 0
    assert "cv" in cli(stack, "usage", PHALANX_TOKEN=lead).stdout
    assert "the queue is empty" in cli(stack, "queue").stdout
    bad_since = cli(stack, "usage", "--since", "yesterday", ok=False)
    assert bad_since.returncode == 2 and "ISO date" in bad_since.stderr
