"""Communication insight on the real stack: a wide MLP on 2 nodes reports where its step time
goes, and the job's `communication` shows it: the bytes each rank all-reduces (4 per parameter,
2 with `ddp.comm_hook: bf16`), the exposed share of the step, the slowest rank."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from phalanx.schemas import JobSpec, JobState
from tests.processes import Stack, wait_for

pytestmark = pytest.mark.e2e

WIDE_MLP = """
import time
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
deadline = time.monotonic() + 4.0
step = 0
while time.monotonic() < deadline:
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if step == 0:
        print(f"first loss {loss.item():.4f}", flush=True)
    ctx.report({"loss": loss}, step=step)
    step += 1
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
    assert comm is not None
    params = next(int(line.split()[1]) for line in lines if line.startswith("parameters"))
    first = next(float(line.split()[2]) for line in lines if line.startswith("first loss"))
    last = next(float(line.split()[2]) for line in lines if line.startswith("last loss"))
    expected = bytes_per_parameter * params
    assert abs(comm.bytes_per_step - expected) <= 0.1 * expected, (comm.bytes_per_step, expected)
    assert 0 < comm.comm_fraction < 1
    assert [r.rank for r in comm.ranks] == [0, 1]
    assert comm.straggler_ratio >= 1.0 and comm.slowest_rank in (0, 1)
    for rank in comm.ranks:
        assert 0 < rank.compute_time_s < rank.step_time_s
        assert 0 < rank.comm_exposed_s <= rank.comm_time_s
    assert last < first, "the run learns, compressed or not"
