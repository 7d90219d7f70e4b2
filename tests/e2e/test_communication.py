"""Communication insight on the real stack: a wide MLP on 2 nodes reports where its step time
goes, and the job's `communication` shows it: the bytes each rank all-reduces (4 per parameter,
2 with `ddp.comm_hook: bf16`), the exposed share of the step, the slowest rank. The same job runs
at several sizes (`jobs scaling`) and records torch.profiler traces on demand (`jobs profile`)."""

from __future__ import annotations

import gzip
import json
import textwrap
from pathlib import Path

import pytest
import yaml

from phalanx.schemas import JobSpec, JobState, ProfileView, ScalingPoint
from server.trace_summary import summarise_bytes
from tests.processes import Stack, cli, wait_for

pytestmark = pytest.mark.e2e

WIDE_MLP = """
import torch
from torch import nn
import phalanx.train as pt
import phalanx.train._comm as comm

comm.REPORT_PERIOD_S = 1.0  # a test's run is short: report every second instead of every five
ctx = pt.init()
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 10))
print(f"parameters {sum(p.numel() for p in net.parameters())}", flush=True)
model = ctx.prepare_model(net)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
g = torch.Generator().manual_seed(ctx.rank)
x = torch.randn(256, 512, generator=g)
y = (x[:, :10].argmax(dim=1))  # a learnable target
steps = 400  # the same count on every rank: each step's all-reduce needs them all (~4 s)
for step in range(steps):
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if step == 0:
        print(f"first loss {loss.item():.4f}", flush=True)
    ctx.report({"loss": loss}, step=step)
print(f"last loss {loss.item():.4f}", flush=True)
ctx.finish()
"""


def wide_job(tmp_path: Path, comm_hook: str) -> tuple[JobSpec, Path]:
    workdir = tmp_path / "wide"
    workdir.mkdir(exist_ok=True)
    (workdir / "train.py").write_text(textwrap.dedent(WIDE_MLP))
    spec = JobSpec(
        name=f"wide-{comm_hook}",
        entrypoint="python train.py",
        resources={"nodes": 2, "slots_per_node": 1},
        ddp={"comm_hook": comm_hook},
    )
    return spec, workdir


@pytest.mark.parametrize(("comm_hook", "bytes_per_parameter"), [("none", 4), ("bf16", 2)])
def test_a_two_node_job_shows_where_its_step_time_goes(
    stack: Stack, tmp_path: Path, comm_hook: str, bytes_per_parameter: int
) -> None:
    spec, workdir = wide_job(tmp_path, comm_hook)
    with stack.client() as client:
        final = client.wait(client.submit(spec, workdir).id, timeout=180)
        assert final.state is JobState.COMPLETED, final.failure_reason
        wait_for(lambda: client.get_job(final.id).communication is not None, 10, "the figures to arrive")
        comm = client.get_job(final.id).communication
        lines = [record.line for record in client.logs(final.id, rank=0)]
    shown = cli(stack, "jobs", "show", str(final.id)).stdout
    assert comm is not None
    assert f"slowest rank {comm.slowest_rank}" in shown and "exposed comm" in shown
    params = next(int(line.split()[1]) for line in lines if line.startswith("parameters"))
    first = next(float(line.split()[2]) for line in lines if line.startswith("first loss"))
    last = next(float(line.split()[2]) for line in lines if line.startswith("last loss"))
    expected = bytes_per_parameter * params
    assert abs(comm.bytes_per_step - expected) <= 0.1 * expected, (comm.bytes_per_step, expected)
    assert 0 < comm.comm_fraction < 1
    assert [r.rank for r in comm.ranks] == [0, 1]
    assert comm.straggler_ratio >= 1.0 and comm.slowest_rank in (0, 1)
    for rank in comm.ranks:
        assert 0 < rank.compute_time_s <= rank.step_time_s - rank.comm_exposed_s - rank.data_time_s + 1e-12
        assert 0 < rank.comm_exposed_s <= rank.comm_time_s
    assert last < first, "the run learns, compressed or not"


ENDLESS = WIDE_MLP.replace("steps = 400", "steps = 1_000_000")


def test_scaling_runs_the_job_at_each_size_for_a_bounded_number_of_steps(stack: Stack, tmp_path: Path) -> None:
    spec, workdir = wide_job(tmp_path, "none")
    (workdir / "train.py").write_text(textwrap.dedent(ENDLESS))  # runs until the measurement kills it
    job_file = workdir / "job.yaml"
    job_file.write_text(yaml.safe_dump(spec.model_dump(mode="json", exclude_defaults=True)))
    done = cli(stack, "jobs", "scaling", str(job_file), "--nodes", "2,1", "--steps", "150", "--warmup", "5", "--json")
    points = [ScalingPoint.model_validate(p) for p in json.loads(done.stdout)]
    with stack.client() as client:
        states = {p.nodes: client.get_job(p.job_id).state for p in points}
    assert [p.nodes for p in points] == [1, 2] and [p.world_size for p in points] == [1, 2]
    assert states == {1: JobState.CANCELLED, 2: JobState.CANCELLED}, "each size ran only its bounded steps"
    one, two = points
    assert one.efficiency == 1.0 and one.comm_fraction is None, "one rank: no all-reduce, no figures"
    assert two.steps_per_second > 0 and two.throughput == pytest.approx(2 * two.steps_per_second)
    assert two.efficiency == pytest.approx(two.throughput / (2 * one.throughput))
    assert two.comm_fraction is not None and 0 < two.comm_fraction < 1


def test_a_profile_of_a_running_two_node_job_records_every_rank_and_summarises_it(stack: Stack, tmp_path: Path) -> None:
    spec, workdir = wide_job(tmp_path, "none")
    (workdir / "train.py").write_text(textwrap.dedent(ENDLESS))
    with stack.client() as client:
        job = client.submit(spec, workdir)
        running = client.get_job_change(job.id, JobState.QUEUED)
        if running.state is JobState.SCHEDULED:
            running = client.get_job_change(job.id, JobState.SCHEDULED)
        assert running.state is JobState.RUNNING, running.failure_reason
        traces = tmp_path / "traces"
        done = cli(stack, "jobs", "profile", str(job.id), "--steps", "10", "--download", str(traces), "--json")
        profile = ProfileView.model_validate_json(done.stdout)
        shown = cli(stack, "jobs", "profile", str(job.id), "--show", str(profile.id), COLUMNS="200").stdout
        detail = client.get_job(job.id)
        client.kill_job(job.id)
    assert profile.state == "complete" and [r.rank for r in profile.ranks] == [0, 1]
    for rank in profile.ranks:
        summary = rank.summary
        assert summary is not None, rank.error
        assert summary.device == "cpu" and summary.steps == 10
        assert 0 < summary.comm_s < summary.step_time_s and 0 < summary.compute_s < summary.step_time_s
        assert summary.overlap_s <= min(summary.compute_s, summary.comm_s)
        busy = summary.compute_s + summary.comm_s - summary.overlap_s
        assert busy + summary.idle_s == pytest.approx(summary.step_time_s, rel=1e-6)
        # the downloaded trace is the rank's own, and the server's summary is what it says
        path = traces / f"job-{job.id}-profile-{profile.id}-rank-{rank.rank}.json.gz"
        assert path.stat().st_size == rank.size_bytes
        assert summarise_bytes(path.read_bytes()) == summary
        names = {e.get("name", "") for e in json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]}
        assert any(n.startswith("ProfilerStep#") for n in names) and "gloo:all_reduce" in names
    assert profile.comm_fraction is not None and 0 < profile.comm_fraction < 1
    assert f"profile {profile.id} of job {job.id}" in shown and "exposed comm" in shown
    assert [p.id for p in detail.profiles] == [profile.id]
