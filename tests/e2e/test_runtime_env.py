"""Runtime environments end to end: real agents resolve, build and use a job's packages, offline from
a wheelhouse of wheels the test makes (a package the agents' own interpreter lacks)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.client import Client
from phalanx.schemas import JobSpec, JobState
from tests.conftest import call_failed
from tests.processes import Stack, cli
from tests.wheels import make_wheel

pytestmark = pytest.mark.e2e

PROBE = """\
import os
import phx_probe
import torch.distributed as dist

dist.init_process_group("gloo")
print(f"probe {phx_probe.VERSION} from {os.path.dirname(phx_probe.__file__)} on rank {dist.get_rank()}")
dist.barrier()
dist.destroy_process_group()
"""


@pytest.fixture
def wheelhouse(tmp_path: Path) -> Path:
    house = tmp_path / "wheelhouse"
    house.mkdir()
    for version in ("1.0", "1.1"):
        make_wheel(house, "phx-probe", version, f"VERSION = {version!r}\n")
    return house


@pytest.fixture
def stack(
    clean_db: str, clean_redis: str, tmp_path: Path, wheelhouse: Path, request: pytest.FixtureRequest
) -> Iterator[Stack]:
    """Server, scheduler and two two-slot agents that install jobs' packages from `wheelhouse` only."""
    running = Stack(tmp_path, clean_db, clean_redis)
    try:
        running.start_server()
        running.start_scheduler()
        for name in ("node-a", "node-b"):
            running.start_agent(name, cpu_slots=2, extra=("--wheelhouse", str(wheelhouse)))
        running.wait_agents(2)
        yield running
        if call_failed(request):
            print(running.dump())
    finally:
        running.close()


def probe_job(tmp_path: Path, pin: str, nodes: int = 1, name: str = "probe") -> tuple[JobSpec, Path]:
    workdir = tmp_path / f"code-{name}"
    workdir.mkdir(exist_ok=True)
    (workdir / "probe.py").write_text(PROBE)
    (workdir / "requirements.txt").write_text(f"# what the probe imports\n{pin}\n")
    spec = JobSpec.model_validate(
        {
            "name": name,
            "entrypoint": "python probe.py",
            "resources": {"nodes": nodes, "slots_per_node": 1},
            "runtime_env": {"requirements": "requirements.txt"},
            "max_restarts": 3,
        }
    )
    return spec, workdir


def lines(client: Client, job_id: int) -> list[str]:
    return [f"[{line.source}] {line.line}" for line in client.logs(job_id, limit=10_000)]


def test_a_two_node_job_imports_a_package_the_agents_lack(stack: Stack, tmp_path: Path) -> None:
    assert importlib.util.find_spec("phx_probe") is None  # the agents run this interpreter
    with stack.client() as client:
        spec, workdir = probe_job(tmp_path, "phx-probe==1.0", nodes=2)
        done = client.wait(client.submit(spec, workdir).id, timeout=180)
        assert done.state is JobState.COMPLETED, (done.failure_reason, lines(client, done.id))
        assert done.attempts == 1 and done.env_lock is not None and "phx-probe==1.0" in done.env_lock
        output = lines(client, done.id)
        for rank in (0, 1):
            assert any("probe 1.0 from" in line and f"on rank {rank}" in line for line in output), output
        nodes = {n.agent_name for n in done.allocations[0].nodes}
        assert nodes == {"node-a", "node-b"}
        assert sum("[setup] building environment" in line for line in output) == 2  # one per node
        shown = cli(stack, "jobs", "show", str(done.id)).stdout
        assert "runtime env: -r requirements.txt -> phx-probe==1.0" in " ".join(shown.split()), shown

        # One pin changed: a new environment, with the new version in it.
        spec, workdir = probe_job(tmp_path, "phx-probe==1.1", nodes=2, name="probe-new")
        newer = client.wait(client.submit(spec, workdir).id, timeout=180)
        assert newer.state is JobState.COMPLETED, newer.failure_reason
        output = lines(client, newer.id)
        assert sum("[setup] building environment" in line for line in output) == 2, output
        assert any("probe 1.1 from" in line for line in output), output
    assert importlib.util.find_spec("phx_probe") is None
    for agent in ("node-a", "node-b"):
        assert len(list((stack.tmp / "agents" / agent / "envs").glob("*/lock.txt"))) == 2


def test_a_missing_package_fails_the_job_once_naming_it(stack: Stack, tmp_path: Path) -> None:
    with stack.client() as client:
        spec, workdir = probe_job(tmp_path, "phx-nowhere==2.0")
        done = client.wait(client.submit(spec, workdir).id, timeout=120)
        assert done.state is JobState.FAILED
        assert "phx-nowhere" in (done.failure_reason or ""), done.failure_reason
        assert "not restarted" in (done.failure_reason or "")
        assert done.attempts == 1 and done.restarts_used == 0 and done.env_lock is None
        assert any("[setup]" in line and "phx-nowhere" in line for line in lines(client, done.id))
        shown = " ".join(cli(stack, "jobs", "show", str(done.id)).stdout.split())
        assert "phx-nowhere" in shown and "not resolved yet" in shown, shown


def test_jobs_sharing_requirements_build_once_and_a_restarted_agent_keeps_them(stack: Stack, tmp_path: Path) -> None:
    with stack.client() as client:
        node_b = next(a for a in client.agents() if a.name == "node-b")
        client.drain_agent(node_b.id)  # both jobs on node-a, at the same time
        spec, workdir = probe_job(tmp_path, "phx-probe==1.1")
        jobs = [client.submit(spec.model_copy(update={"name": f"twin-{i}"}), workdir) for i in range(2)]
        done = [client.wait(job.id, timeout=180) for job in jobs]
        assert [d.state for d in done] == [JobState.COMPLETED] * 2, [d.failure_reason for d in done]
        assert done[0].allocations[0].nodes[0].agent_name == done[1].allocations[0].nodes[0].agent_name == "node-a"
        setup = [line for d in done for line in lines(client, d.id) if line.startswith("[setup]")]
        assert sum("building environment" in line for line in setup) == 1, setup
        assert sum("is built on this node" in line for line in setup) == 2, setup

        stack.stop("node-a")
        stack.start_agent("node-a", cpu_slots=2, extra=("--wheelhouse", str(stack.tmp / "wheelhouse")))
        stack.wait_agents(1)
        again = client.wait(client.submit(spec.model_copy(update={"name": "after-restart"}), workdir).id, 180)
        assert again.state is JobState.COMPLETED, again.failure_reason
        setup = [line for line in lines(client, again.id) if line.startswith("[setup]")]
        assert not any("building environment" in line for line in setup), setup
        assert any("is built on this node" in line for line in setup), setup
