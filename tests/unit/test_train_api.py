"""phalanx.train: the in-training API, with real torch, real HTTP and a real 2-rank gloo run."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import phalanx.train as pt
from phalanx.schemas import MetricBatchIn, Precision
from phalanx.train._env import read_env
from phalanx.train._metrics import MetricPipeline, MetricRecordDict, SendOutcome
from tests.processes import wait_for

REPO_ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
CONTRACT_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in list(os.environ):
        if name in CONTRACT_VARS or name.startswith("PHALANX_"):
            monkeypatch.delenv(name)
    yield
    # A test that failed half-way must not leave its context (and SIGTERM handler) to the next.
    leftover = pt._context._current
    if leftover is not None:
        leftover.finish(timeout=0.5)


class MetricsServer:
    """A real HTTP server on 127.0.0.1 that records metric POSTs and answers scripted statuses."""

    def __init__(self, statuses: list[int] | None = None, default_status: int = 200) -> None:
        self.requests: list[dict[str, Any]] = []
        self.statuses = list(statuses or [])
        self.default_status = default_status
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with outer._lock:
                    status = outer.statuses.pop(0) if outer.statuses else outer.default_status
                    outer.requests.append(
                        {
                            "path": self.path,
                            "auth": self.headers.get("Authorization"),
                            "body": json.loads(body),
                            "status": status,
                        }
                    )
                payload = b'{"error": "scripted"}' if status >= 300 else b"{}"
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def delivered(self) -> list[dict[str, Any]]:
        with self._lock:
            return [r for req in self.requests if req["status"] == 200 for r in req["body"]["records"]]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


@pytest.fixture
def metrics_server() -> Iterator[MetricsServer]:
    server = MetricsServer()
    yield server
    server.close()


def managed_env(monkeypatch: pytest.MonkeyPatch, url: str, allocation_id: int = 7) -> None:
    monkeypatch.setenv("PHALANX_URL", url)
    monkeypatch.setenv("PHALANX_TOKEN", "secret-token")
    monkeypatch.setenv("PHALANX_JOB_ID", "3")
    monkeypatch.setenv("PHALANX_ALLOCATION_ID", str(allocation_id))
    monkeypatch.setenv("PHALANX_ATTEMPT", "2")


def subprocess_env(**extra: str) -> dict[str, str]:
    """This interpreter's environment minus the contract, plus `extra`; one thread per rank on 2 cores."""
    env = {k: v for k, v in os.environ.items() if k not in CONTRACT_VARS and not k.startswith("PHALANX_")}
    env.update(PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", **extra)
    return env


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


# --- a single process outside Phalanx ------------------------------------------------------


def test_single_process_context_outside_phalanx(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHALANX_HPARAMS", '{"lr": 0.1, "hidden": 8}')
    ctx = pt.init()

    assert (ctx.rank, ctx.local_rank, ctx.world_size) == (0, 0, 1)
    assert ctx.device == torch.device("cpu")
    assert ctx.hparams == {"lr": 0.1, "hidden": 8}
    assert ctx.precision == "32"
    assert (ctx.job_id, ctx.allocation_id, ctx.attempt) == (None, None, 0)
    assert ctx.latest_checkpoint is None
    assert not dist.is_initialized()  # one process: no process group at all
    assert pt.init() is ctx
    model = torch.nn.Linear(2, 1)
    assert ctx.prepare_model(model) is model  # no DDP wrapper around a lone process
    assert not ctx.should_stop()

    ctx.report({"loss": torch.tensor(0.25, requires_grad=True) * 2, "acc": 1})
    ctx.report({"loss": 0.5, "diverged": float("inf"), "name": "text"}, step=10)
    ctx.report({"loss": torch.tensor(0.125)})  # step defaults to the previous one + 1
    assert ctx.flush(timeout=5)
    assert [(r["step"], r["values"]) for r in ctx.metrics] == [
        (0, {"loss": 0.5, "acc": 1.0}),
        (10, {"loss": 0.5, "diverged": float("inf")}),  # kept: a diverged value is worth seeing
        (11, {"loss": 0.125}),
    ]
    assert all(r["rank"] == 0 and abs(r["time"] - time.time()) < 60 for r in ctx.metrics)
    stats = ctx.metric_stats()
    assert (stats.nonfinite, stats.dropped_invalid, stats.sent) == (1, 1, 0)

    ctx.finish()
    with pytest.raises(RuntimeError, match=r"after ctx\.finish"):
        ctx.report({"loss": 1.0})
    assert pt.init() is not ctx  # a finished context is not handed out again


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PHALANX_HPARAMS": "[1, 2]"}, "JSON object"),
        ({"PHALANX_HPARAMS": "{lr: 1}"}, "not valid JSON"),
        ({"PHALANX_PRECISION": "fp8"}, "PHALANX_PRECISION"),
        ({"WORLD_SIZE": "2"}, "RANK is unset"),
        ({"WORLD_SIZE": "2", "RANK": "2"}, "outside"),
        ({"PHALANX_ALLOCATION_ID": "5"}, "PHALANX_URL"),
        ({"PHALANX_PG_TIMEOUT": "-3"}, "positive"),
        ({"PHALANX_ATTEMPT": "two"}, "PHALANX_ATTEMPT"),
    ],
)
def test_bad_environment_is_reported_by_name(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        read_env(env)


def test_environment_contract_is_read() -> None:
    env = read_env(
        {
            "RANK": "3",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "4",
            "PHALANX_URL": "http://server:8000/",
            "PHALANX_TOKEN": "t",
            "PHALANX_JOB_ID": "11",
            "PHALANX_ALLOCATION_ID": "12",
            "PHALANX_ATTEMPT": "2",
            "PHALANX_PRECISION": "bf16-mixed",
            "PHALANX_PG_TIMEOUT": "45",
        }
    )
    assert (env.rank, env.local_rank, env.world_size) == (3, 1, 4)
    assert (env.url, env.token, env.job_id, env.allocation_id, env.attempt) == ("http://server:8000", "t", 11, 12, 2)
    assert (env.precision, env.pg_timeout_s, env.managed) == ("bf16-mixed", 45.0, True)
    assert read_env({}).pg_timeout_s == 120.0  # never torch's 30 minutes


def test_precisions_match_the_job_schema() -> None:
    assert tuple(p.value for p in Precision) == pt.PRECISIONS


@pytest.mark.parametrize(
    ("precision", "dtype", "scaled"),
    [("32", torch.float32, False), ("bf16-mixed", torch.bfloat16, False), ("fp16-mixed", torch.float16, True)],
)
def test_autocast_and_backward_follow_the_precision(
    monkeypatch: pytest.MonkeyPatch, precision: str, dtype: torch.dtype, scaled: bool
) -> None:
    monkeypatch.setenv("PHALANX_PRECISION", precision)
    ctx = pt.init()
    torch.manual_seed(0)
    model = ctx.prepare_model(torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    before = [p.detach().clone() for p in model.parameters()]

    with ctx.autocast():
        out = model(torch.randn(8, 4))
        loss = out.float().pow(2).mean()
    assert out.dtype == dtype
    assert (ctx.grad_scaler is not None) == scaled
    ctx.backward(loss, optimizer)

    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())  # zeroed for the next step
    ctx.finish()


def test_single_process_data_loader_keeps_the_plain_order() -> None:
    ctx = pt.init()
    dataset = TensorDataset(torch.arange(20.0))

    def loader() -> DataLoader[Any]:
        return DataLoader(dataset, batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(1))

    plain, prepared = loader(), ctx.prepare_data_loader(loader())
    for _ in range(2):
        assert [b[0].tolist() for b in plain] == [b[0].tolist() for b in prepared]
    assert prepared.epoch == 2 and len(prepared) == len(plain) == 4
    ctx.finish()


def test_sigterm_sets_should_stop_without_exiting() -> None:
    previous = signal.getsignal(signal.SIGTERM)
    ctx = pt.init()
    assert not ctx.should_stop()
    os.kill(os.getpid(), signal.SIGTERM)
    deadline = time.monotonic() + 5
    while not ctx.should_stop() and time.monotonic() < deadline:
        time.sleep(0.01)  # the Python-level handler runs between bytecodes of the main thread
    assert ctx.should_stop()
    ctx.finish()
    assert signal.getsignal(signal.SIGTERM) == previous  # the handler leaves with the context


FREEZE_PROBE = """
import gc, json, torch
import phalanx.train as pt
if FORKED:
    gc.freeze()  # what the fork-server does before it forks a rank
setup_leftover = [[] for _ in range(3)]  # built by the script's setup, alive through training
ctx = pt.init()
ctx.prepare_model(torch.nn.Linear(2, 2))
tracked = any(obj is setup_leftover for obj in gc.get_objects())  # the permanent generation is not listed
print(json.dumps({"tracked": tracked, "frozen": gc.get_freeze_count()}))
ctx.finish()
"""


@pytest.mark.parametrize("forked", [True, False])
def test_prepare_model_freezes_the_setup_only_in_a_forked_rank(forked: bool) -> None:
    """A forked rank's collector no longer counts torch's (frozen) modules, so the setup's objects
    must be frozen too or full collections land in the first training steps; a fresh
    interpreter's collector is left as Python sets it."""
    out = subprocess.run(
        [sys.executable, "-c", f"FORKED = {forked}\n" + textwrap.dedent(FREEZE_PROBE)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    probe = json.loads(out.stdout.splitlines()[-1])
    assert probe["tracked"] is not forked
    assert (probe["frozen"] > 0) is forked


HEAVY_MODULES = {"server", "scheduler", "worker_agent", "pydantic", "httpx", "tenacity", "fastapi", "sqlalchemy"}


def loaded_heavy_modules(code: str, **env: str) -> list[str]:
    """Which of HEAVY_MODULES a fresh interpreter holds after running `code`."""
    report = (
        f"; import sys, json; print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & {HEAVY_MODULES!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code + report],
        env=subprocess_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    loaded: list[str] = json.loads(out.stdout.splitlines()[-1])
    return loaded


def test_importing_the_api_loads_neither_server_nor_http_stack() -> None:
    assert loaded_heavy_modules("import phalanx.train") == []


def test_a_rank_launched_by_an_agent_loads_the_transport_but_no_pydantic() -> None:
    # The metric sink and the checkpoint committer share the SDK's transport; the SDK's models stay out.
    code = "import phalanx.train as pt; ctx = pt.init(); ctx.report({'loss': 1.0}, step=0); ctx.finish(timeout=0.2)"
    env = {
        "PHALANX_URL": closed_port_url(),
        "PHALANX_JOB_ID": "3",
        "PHALANX_ALLOCATION_ID": "7",
        "PHALANX_ATTEMPT": "1",
    }
    assert loaded_heavy_modules(code, **env) == ["httpx", "tenacity"]


# --- metrics to a server -------------------------------------------------------------------


def test_report_never_blocks_when_the_server_is_down(monkeypatch: pytest.MonkeyPatch) -> None:
    managed_env(monkeypatch, closed_port_url())
    ctx = pt.init()
    loss = torch.tensor(0.5)
    durations = []
    for step in range(20_000):
        start = time.perf_counter()
        ctx.report({"loss": loss, "acc": 0.9}, step=step)
        durations.append(time.perf_counter() - start)

    # The goal is 20 µs on a quiet machine; the bound here leaves room for a busy CI box while
    # still failing for any network wait (a refused connect alone takes longer).
    assert statistics.median(durations) < 50e-6, statistics.median(durations)
    assert sum(durations) < 2.0
    assert not ctx.flush(timeout=0.5)  # nothing can be delivered...
    # ...though the sender tries (converting 20,000 records first may outlast that flush on a busy box)
    wait_for(lambda: ctx.metric_stats().failed_attempts >= 1, 30, "the sender's first failed attempt", interval=0.01)
    start = time.monotonic()
    ctx.finish(timeout=0.5)
    assert time.monotonic() - start < 3  # finish() waits a bounded time, then gives up
    assert ctx.metric_stats().lost_at_close == 20_000


def test_sender_delivers_batches_to_the_server(monkeypatch: pytest.MonkeyPatch, metrics_server: MetricsServer) -> None:
    managed_env(monkeypatch, metrics_server.url)
    ctx = pt.init()
    for step in range(12_000):
        loss = torch.tensor(step / 1000) if step else torch.tensor(float("nan"))
        ctx.report({"loss": loss, "acc": 0.5, "grad_norm": float("inf")}, step=step)
    assert ctx.flush(timeout=15)
    ctx.finish()

    requests = metrics_server.requests
    assert len(requests) >= 3  # 12,000 records cannot fit in batches of at most 5,000
    for request in requests:
        assert request["path"] == "/api/v1/allocations/7/metrics"
        assert request["auth"] == "Bearer secret-token"
        batch = MetricBatchIn.model_validate(request["body"])  # the server's own wire schema
        assert 0 < len(batch.records) <= 5_000
    records = metrics_server.delivered()
    assert sorted(r["step"] for r in records) == list(range(12_000))  # each exactly once
    # JSON has no NaN or Infinity: they travel as the strings the server's schema documents
    assert records[0]["values"] == {"loss": "NaN", "acc": 0.5, "grad_norm": "Infinity"}
    assert math.isnan(MetricBatchIn.model_validate(requests[0]["body"]).records[0].values["loss"])
    assert records[-1]["values"]["loss"] == pytest.approx(11.999)
    assert {r["rank"] for r in records} == {0}
    stats = ctx.metric_stats()
    assert (stats.sent, stats.pending, stats.nonfinite) == (12_000, 0, 12_001)
    assert ctx.metrics == []  # sent, not kept


def test_sender_retries_after_server_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    server = MetricsServer(statuses=[503, 502])
    try:
        managed_env(monkeypatch, server.url)
        ctx = pt.init()
        for step in range(50):
            ctx.report({"loss": 1.0}, step=step)
        assert ctx.flush(timeout=15)
        ctx.finish()
        assert [r["status"] for r in server.requests] == [503, 502, 200]
        assert sorted(r["step"] for r in server.delivered()) == list(range(50))
        assert ctx.metric_stats().failed_attempts == 2
    finally:
        server.close()


def test_conflict_means_superseded_stop_sending_and_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    server = MetricsServer(default_status=409)
    try:
        managed_env(monkeypatch, server.url)
        ctx = pt.init()
        ctx.report({"loss": 1.0}, step=0)
        ctx.flush(timeout=10)
        assert ctx.should_stop()
        requests_after_conflict = len(server.requests)
        assert requests_after_conflict == 1
        for step in range(1, 100):
            ctx.report({"loss": 1.0}, step=step)
        ctx.finish(timeout=2)
        assert len(server.requests) == requests_after_conflict  # a zombie writes nothing more
        assert ctx.metric_stats().discarded_superseded == 100
    finally:
        server.close()


class ScriptedSink:
    """A sink that fails until told otherwise, to watch the bounded buffer."""

    def __init__(self) -> None:
        self.up = False
        self.retry_after: float | None = None
        self.received: list[MetricRecordDict] = []

    def send(self, records: list[MetricRecordDict], timeout: float, batch_id: str) -> SendOutcome:
        if not self.up:
            return SendOutcome.RETRY
        self.received.extend(records)
        return SendOutcome.DELIVERED

    def close(self) -> None:
        pass


def test_buffer_drops_the_oldest_records_past_its_bound() -> None:
    sink = ScriptedSink()
    pipeline = MetricPipeline(rank=1, sink=sink, flush_interval_s=0.05, max_buffer=100, max_batch=40)
    for step in range(250):
        pipeline.queue.put((step, time.time(), {"v": step}))
    deadline = time.monotonic() + 5
    while pipeline.stats().records < 250 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pipeline.stats().dropped_overflow == 150
    sink.up = True
    assert pipeline.flush(timeout=5)
    pipeline.close(timeout=1)
    assert [r["step"] for r in sink.received] == list(range(150, 250))  # the newest survive
    assert {r["rank"] for r in sink.received} == {1}


def test_a_refused_batch_is_sent_again_no_sooner_than_the_server_asked() -> None:
    class BusySink(ScriptedSink):
        def __init__(self) -> None:
            super().__init__()
            self.retry_after = 1.0
            self.attempts: list[float] = []
            self.twice = threading.Event()

        def send(self, records: list[MetricRecordDict], timeout: float, batch_id: str) -> SendOutcome:
            self.attempts.append(time.monotonic())
            if len(self.attempts) == 2:
                self.twice.set()
            return super().send(records, timeout, batch_id)

    sink = BusySink()
    pipeline = MetricPipeline(rank=0, sink=sink, flush_interval_s=0.02)
    pipeline.queue.put((1, time.time(), {"v": 1}))
    assert sink.twice.wait(10)
    sink.up = True
    assert sink.attempts[1] - sink.attempts[0] >= 1.0, "the first backoff alone is 0.1-0.2 s"
    assert pipeline.flush(timeout=5)
    pipeline.close(timeout=1)


# --- two real ranks ------------------------------------------------------------------------

TWO_RANK_SCRIPT = """
import json, sys
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
import phalanx.train as pt

ctx = pt.init()
torch.manual_seed(ctx.rank)  # different initial weights: DDP must broadcast rank 0's
model = ctx.prepare_model(torch.nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
features = torch.arange(32.0).reshape(16, 2).repeat(1, 2)
dataset = TensorDataset(features, features.sum(1))
loader = ctx.prepare_data_loader(DataLoader(dataset, batch_size=4, shuffle=True))

first_grads, seen, step = None, [], 0
for epoch in range(2):
    order = []
    for x, y in loader:
        loss = (model(x).squeeze(1) - y).pow(2).mean()
        if first_grads is None:  # read the all-reduced gradients once, then train through ctx
            loss.backward()
            first_grads = [p.grad.flatten().tolist() for p in model.parameters()]
            optimizer.step()
            optimizer.zero_grad()
        else:
            ctx.backward(loss, optimizer)
        ctx.report({"loss": loss}, step=step)
        step += 1
        order.extend(x[:, 0].div(2).int().tolist())
    seen.append(order)

backend = dist.get_backend()
pg_timeout = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).options._timeout
result = {
    "rank": ctx.rank,
    "world_size": ctx.world_size,
    "ddp": type(model).__name__,
    "backend": backend,
    "pg_timeout_s": pg_timeout.total_seconds(),
    "first_grads": first_grads,
    "params": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist(),
    "seen": seen,
}
ctx.finish()
result["initialized_after_finish"] = dist.is_initialized()
with open(sys.argv[1] + f"/rank{result['rank']}.json", "w") as out:
    json.dump(result, out)
"""


def test_two_rank_gloo_run_through_torchrun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, metrics_server: MetricsServer
) -> None:
    script = tmp_path / "two_ranks.py"
    script.write_text(textwrap.dedent(TWO_RANK_SCRIPT))
    env = subprocess_env(
        PHALANX_URL=metrics_server.url,
        PHALANX_TOKEN="secret-token",
        PHALANX_ALLOCATION_ID="9",
        PHALANX_PG_TIMEOUT="45",
    )
    proc = subprocess.run(
        [*TORCHRUN, str(script), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]

    assert [r["world_size"] for r in ranks] == [2, 2]
    assert [r["ddp"] for r in ranks] == ["DistributedDataParallel"] * 2
    assert {r["backend"] for r in ranks} == {"gloo"}
    assert {r["pg_timeout_s"] for r in ranks} == {45.0}
    assert not any(r["initialized_after_finish"] for r in ranks)
    # Each rank saw a different half of the data, so equal gradients prove the all-reduce.
    assert ranks[0]["first_grads"] == ranks[1]["first_grads"]
    assert ranks[0]["params"] == ranks[1]["params"]
    for epoch in (0, 1):
        shard0, shard1 = ranks[0]["seen"][epoch], ranks[1]["seen"][epoch]
        assert len(shard0) == len(shard1) == 8
        assert sorted(shard0 + shard1) == list(range(16))  # disjoint shards covering the data
    assert ranks[0]["seen"][0] != ranks[0]["seen"][1]  # set_epoch reshuffled the second epoch

    records = metrics_server.delivered()
    assert sorted((r["rank"], r["step"]) for r in records) == [(rank, s) for rank in (0, 1) for s in range(4)]
    assert {req["path"] for req in metrics_server.requests} == {"/api/v1/allocations/9/metrics"}


AGREED_STOP_SCRIPT = """
import json, os, signal, sys, time
import phalanx.train as pt

ctx = pt.init()
stopped_at = None
for step in range(200):
    if ctx.rank == 1 and step == 5:
        os.kill(os.getpid(), signal.SIGTERM)  # only rank 1 is asked to stop
    time.sleep(0.01 * (ctx.rank + 1))  # the ranks run at different speeds
    if ctx.should_stop():
        stopped_at = step
        break
requested = ctx.stop_requested()
ctx.finish()
with open(sys.argv[1] + f"/rank{ctx.rank}.json", "w") as out:
    json.dump({"stopped_at": stopped_at, "requested": requested}, out)
print(f"rank {ctx.rank} stopped at {stopped_at}")
"""


def test_a_stop_asked_of_one_rank_stops_every_rank_at_the_same_step(tmp_path: Path) -> None:
    script = tmp_path / "agreed_stop.py"
    script.write_text(AGREED_STOP_SCRIPT)
    proc = subprocess.run(
        [*TORCHRUN, str(script), str(tmp_path)], env=subprocess_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    # the flag raised during step 5 is agreed a few calls later, at the same step on both ranks
    assert ranks[0]["stopped_at"] == ranks[1]["stopped_at"]
    assert 5 < ranks[0]["stopped_at"] < 100, ranks
    assert [r["requested"] for r in ranks] == [False, True]  # rank 0 itself was never signalled


# --- the examples --------------------------------------------------------------------------


def test_digits_port_reproduces_the_plain_script_in_one_process() -> None:
    digits = REPO_ROOT / "examples" / "digits"
    runs = [
        subprocess.Popen(
            [sys.executable, name, "--epochs", "1"],
            cwd=digits,
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in ("train_plain.py", "train.py")
    ]
    (plain_out, plain_err), (port_out, port_err) = (run.communicate(timeout=120) for run in runs)
    assert [run.returncode for run in runs] == [0, 0], plain_err[-2000:] + port_err[-2000:]
    assert "UserWarning" not in port_err

    def checksum(out: str) -> str:
        return next(line.split(": ")[1] for line in out.splitlines() if line.startswith("final-checksum: "))

    assert checksum(plain_out) == checksum(port_out)  # porting changed nothing numerically
    lines = dict(line.split(" ", 1) for line in port_out.splitlines() if line.startswith("phalanx-"))
    assert abs(float(lines["phalanx-first-step"]) - time.time()) < 120
    assert float(lines["phalanx-steps-per-second"]) > 0


def test_scripted_workload_runs_in_lock_step_and_reports(metrics_server: MetricsServer) -> None:
    hparams = {"steps": 3, "step_seconds": 0.01, "exit_code": 0, "report": True}
    proc = subprocess.run(
        [*TORCHRUN, "workload.py"],
        cwd=REPO_ROOT / "examples" / "scripted",
        env=subprocess_env(
            PHALANX_URL=metrics_server.url, PHALANX_ALLOCATION_ID="4", PHALANX_HPARAMS=json.dumps(hparams)
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        assert [f"step {s} rank {rank}" in proc.stdout for s in range(3)] == [True] * 3
    records = metrics_server.delivered()
    assert sorted((r["rank"], r["step"], r["values"]["step_value"]) for r in records) == [
        (rank, s, float(s)) for rank in (0, 1) for s in range(3)
    ]


# --- checkpoints: sharded, and on a filesystem that is not local ------------------------------

SHARDED_SCRIPT = """
import json, sys
import torch
import phalanx.train as pt

ctx = pt.init()
resumed = None
if ctx.latest_checkpoint is not None:  # each rank reads back its own shard
    shard = ctx.latest_checkpoint.load(f"rank-{ctx.rank}.pt")
    resumed = {"step": ctx.latest_checkpoint.step, "rank": shard["rank"], "w": shard["w"].tolist()}
else:
    state = {"rank": ctx.rank, "w": torch.full((3,), float(ctx.rank))}
    ctx.report({"loss": 1.0}, step=5, checkpoint=state, sharded=True)
ctx.finish()
with open(sys.argv[1] + f"/rank{ctx.rank}.json", "w") as out:
    json.dump({"resumed": resumed}, out)
"""


def test_sharded_checkpoint_every_rank_writes_and_reads_its_part(tmp_path: Path) -> None:
    script = tmp_path / "sharded.py"
    script.write_text(textwrap.dedent(SHARDED_SCRIPT))
    root = tmp_path / "checkpoints"
    env = subprocess_env(PHALANX_CHECKPOINT_ROOT=f"file://{root}")

    def run(**extra: str) -> list[dict[str, object]]:
        done = subprocess.run(
            [*TORCHRUN, str(script), str(tmp_path)], env={**env, **extra}, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]

    assert [r["resumed"] for r in run()] == [None, None]
    (folder,) = root.iterdir()  # one checkpoint, renamed into place: no temporary name left
    assert folder.name.startswith("step-000000000005-") and not folder.name.endswith(".tmp")
    assert sorted(p.name for p in folder.iterdir()) == ["rank-0.pt", "rank-1.pt"]

    resumed = run(PHALANX_RESUME_STEP="5", PHALANX_RESUME_PATH=f"file://{folder}")
    assert [r["resumed"] for r in resumed] == [
        {"step": 5, "rank": 0, "w": [0.0, 0.0, 0.0]},
        {"step": 5, "rank": 1, "w": [1.0, 1.0, 1.0]},
    ]


def test_checkpoint_on_a_non_local_fsspec_filesystem(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any fsspec URI works: fsspec's in-memory filesystem takes the same path as s3:// would
    (fs.open for the write, fs.mv for the rename, fs.du for the size)."""
    import fsspec

    monkeypatch.setenv("PHALANX_CHECKPOINT_ROOT", "memory://phalanx-test/checkpoints")
    ctx = pt.init()
    try:
        ctx.report({"loss": 0.5}, step=3, checkpoint={"w": torch.arange(4.0)})
        ctx.flush()
        assert ctx._checkpoints.flush(30)
        (committed,) = ctx._checkpoints.committed
        assert committed.step == 3 and committed.path.startswith("memory://") and committed.local_path is None
        fs = fsspec.filesystem("memory")
        assert not fs.glob("/phalanx-test/checkpoints/*.tmp")
        assert committed.load()["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    finally:
        ctx.finish()


def test_a_step_saved_twice_keeps_the_newer_files_while_the_first_commit_is_under_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning writes its checkpoint and then, on a stop, the same step again: the second save
    must not write into the folder that the first one's commit is renaming."""
    from phalanx.train import _checkpoint

    first_commit_under_way, second_saved = threading.Event(), threading.Event()
    real_fsync_tree = _checkpoint._fsync_tree

    def held_fsync_tree(root: Path) -> None:
        if not first_commit_under_way.is_set():
            first_commit_under_way.set()
            assert second_saved.wait(30)
        real_fsync_tree(root)

    monkeypatch.setattr(_checkpoint, "_fsync_tree", held_fsync_tree)
    writer = _checkpoint.CheckpointWriter(f"file://{tmp_path}", 0, 0, 1, None, lambda: None)
    writer.save({"version": 1}, 5, None, sharded=False)
    assert first_commit_under_way.wait(30)
    writer.save({"version": 2}, 5, None, sharded=False)
    second_saved.set()
    assert writer.flush(30)
    writer.close(5)
    assert [p.name for p in tmp_path.iterdir()] == [f"step-{5:012d}-a0"], "no temporary folder left"
    assert torch.load(tmp_path / f"step-{5:012d}-a0" / "state.pt")["version"] == 2, "the newer save wins"
