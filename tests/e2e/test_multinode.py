"""Multi-node on one machine: agents in their own network namespaces, joined by veth pairs.

A 2-node DDP job trains across namespaces over gloo; then (a) one agent and its workers are
SIGKILLed and (b) one namespace's link is cut: each time the job resumes on a third agent and
completes, and the cut-off attempt cannot write once its link returns.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from phalanx.client import Client, load_job_file
from phalanx.schemas import JobDetail, JobSpec, JobState
from tests import netns
from tests.conftest import call_failed
from tests.processes import REPO, Stack, processes_of_allocation, wait_for

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(netns.available() is not None, reason=str(netns.available())),
]
DIGITS = REPO / "examples" / "digits" / "job.yaml"


@pytest.fixture
def cluster(
    clean_db: str, clean_redis: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[Stack, netns.Cluster]]:
    hosts = netns.Cluster().up(["a", "b", "c"])
    stack = Stack(tmp_path, clean_db, clean_redis)
    try:
        stack.start_server(host=hosts.gateway)
        stack.start_scheduler()
        for host in hosts.hosts.values():
            stack.start_agent(f"node-{host.name}", address=host.address, netns=host.netns)
        stack.wait_agents(3)
        yield stack, hosts
        if call_failed(request):
            print(stack.dump())
    finally:
        stack.close()
        hosts.down()


def digits(epochs: int) -> tuple[JobSpec, Path]:
    spec, workdir = load_job_file(DIGITS)
    return spec.model_copy(update={"entrypoint": f"python train.py --epochs {epochs}", "max_restarts": 0}), workdir


def finished(client: Client, job_id: int, timeout: float = 180) -> JobDetail:
    try:
        return client.wait(job_id, timeout=timeout)
    except TimeoutError:
        raise AssertionError(client.get_job(job_id).model_dump_json(indent=1)) from None


def running_on(client: Client, job_id: int) -> JobDetail:
    """The job once it has committed a checkpoint, so a restart has something to resume from."""
    wait_for(lambda: client.checkpoints(job_id), 180, "the first committed checkpoint")
    return client.get_job(job_id)


def test_two_node_job_survives_a_killed_agent(cluster: tuple[Stack, netns.Cluster]) -> None:
    stack, _ = cluster
    spec, workdir = digits(epochs=80)
    with stack.client() as client:
        job = client.submit(spec, workdir)
        first = running_on(client, job.id).allocations[0]
        assert {n.agent_name for n in first.nodes} <= {"node-a", "node-b", "node-c"}
        victim = first.nodes[1].agent_name
        agent = psutil.Process(stack.procs[victim].pid)
        workers = agent.children(recursive=True)
        # The agent dies first: were a worker first, the agent could report its -9 exit as the
        # workload's own failure before its own SIGKILL landed, which is not a lost node.
        for proc in [agent, *workers]:
            proc.send_signal(signal.SIGKILL)

        final = finished(client, job.id)
        assert final.state is JobState.COMPLETED, final.failure_reason
        assert final.infra_restarts_used == 1 and final.restarts_used == 0
        assert "lost" in (final.allocations[0].end_reason or "")
        assert victim not in {n.agent_name for n in final.allocations[-1].nodes}
        assert {a.name: a.state.value for a in client.agents()}[victim] == "LOST"
    assert processes_of_allocation(stack, first.id) == []


def test_a_gang_restarts_without_waiting_for_a_killed_agents_timeout(cluster: tuple[Stack, netns.Cluster]) -> None:
    """With a restart left in the job's own budget, the survivor's failure on a reset connection
    restarts the gang at once; the dead agent is declared lost later, on its own timeout."""
    stack, _ = cluster
    spec, workdir = digits(epochs=80)
    with stack.client() as client:
        job = client.submit(spec.model_copy(update={"max_restarts": 1}), workdir)
        first = running_on(client, job.id).allocations[0]
        victim = first.nodes[1].agent_name
        agent = psutil.Process(stack.procs[victim].pid)
        for proc in [agent, *agent.children(recursive=True)]:
            proc.send_signal(signal.SIGKILL)

        final = finished(client, job.id)
        assert final.state is JobState.COMPLETED, final.failure_reason
        restarted = [e for e in final.events if e.to_state is JobState.QUEUED and e.from_state is JobState.RESTARTING]
        assert restarted and f"without waiting for node 1 on agent {victim}" in restarted[0].reason
        assert victim not in {n.agent_name for n in final.allocations[-1].nodes}
        # its loss, found on its own timeout, settles the charge as the infrastructure's
        wait_for(lambda: {a.name: a.state.value for a in client.agents()}[victim] == "LOST", 60, "the loss")
        settled = client.get_job(job.id)
        assert settled.infra_restarts_used == 1 and settled.restarts_used == 0
        assert "lost" in (settled.allocations[0].end_reason or "")
    assert processes_of_allocation(stack, first.id) == []


def test_cut_link_restarts_elsewhere_and_fences_the_cut_off_attempt(cluster: tuple[Stack, netns.Cluster]) -> None:
    stack, hosts = cluster
    spec, workdir = digits(epochs=80)
    with stack.client() as client:
        job = client.submit(spec, workdir)
        first = running_on(client, job.id).allocations[0]
        victim = first.nodes[1].agent_name
        hosts.cut(victim.removeprefix("node-"))
        wait_for(lambda: client.get_job(job.id).attempts >= 2, 120, "a new attempt on the other agents")
        points_of_first = len([p for p in client.metrics(job.id, all_attempts=True) if p.allocation_id == first.id])

        hosts.restore(victim.removeprefix("node-"))
        final = finished(client, job.id)
        assert final.state is JobState.COMPLETED, final.failure_reason
        assert final.infra_restarts_used == 1
        assert victim not in {n.agent_name for n in final.allocations[-1].nodes}
        # back online, the cut-off agent registers again and stops its stale workers...
        wait_for(lambda: processes_of_allocation(stack, first.id) == [], 60, "the cut-off attempt's workers to stop")
        # ...and nothing they sent after the cut was stored
        after = [p for p in client.metrics(job.id, all_attempts=True) if p.allocation_id == first.id]
        assert len(after) == points_of_first
