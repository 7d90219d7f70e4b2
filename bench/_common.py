"""What the process benchmarks share: plain torchrun runs, Phalanx stacks, fresh databases.

Every helper that starts a child process stops it again on the way out, failure included.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
import psycopg

from phalanx.client import Client, load_job_file
from phalanx.schemas import JobDetail, JobSpec
from stack.embedded import PHALANX, EmbeddedStack, StackError
from stack.supervisor import ChildExited, Supervisor, WaitTimedOut, free_port

REPO = Path(__file__).resolve().parents[1]
DIGITS_JOB = REPO / "examples" / "digits" / "job.yaml"
PG_ADMIN = os.environ.get("PHALANX_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
# A Redis database of the benchmarks' own, so that a concurrent test run's flushes cannot hit it.
REDIS_URL = os.environ.get("PHALANX_BENCH_REDIS", "redis://127.0.0.1:6379/10")
ADMIN_TOKEN = "phx_u_bench-admin-token"
AGENT_TOKEN = "phx_a_bench-agent-token"
FIRST_STEP = re.compile(r"phalanx-first-step ([0-9.]+)")
STEPS_PER_SECOND = re.compile(r"phalanx-steps-per-second ([0-9.]+)")
# A pause before every run, so that what the previous one left running (a stack finishing its
# reports, processes exiting) does not land on the next one and bias the pair.
SETTLE_S = 2.0
# A job QUEUED this long while every agent is idle means the scheduler stopped working.
QUEUED_GIVE_UP_S = 30.0


class BenchError(RuntimeError):
    pass


@dataclass(frozen=True)
class TrainingRun:
    """One run of the digits example: when it was launched, its first step, its step rate."""

    launched: float  # unix time just before the launch (Popen or submit)
    first_step: float  # unix time rank 0 printed after its first optimizer step
    steps_per_second: float

    @property
    def start_latency(self) -> float:
        return self.first_step - self.launched


def log(message: str) -> None:
    """Progress for a person watching; stdout stays one JSON line."""
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def median(values: list[float]) -> float:
    return statistics.median(values)


def without_phalanx_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}


def digits_spec(epochs: int, checkpoint_every: int = 1) -> tuple[JobSpec, Path]:
    spec, workdir = load_job_file(DIGITS_JOB)
    entrypoint = f"python train.py --epochs {epochs} --checkpoint-every {checkpoint_every}"
    return spec.model_copy(update={"entrypoint": entrypoint}), workdir


def parse_training_output(text: str, launched: float, what: str) -> TrainingRun:
    first = FIRST_STEP.search(text)
    rate = STEPS_PER_SECOND.search(text)
    if first is None or rate is None:
        raise BenchError(f"{what}: rank 0 printed no first-step/steps-per-second line:\n{text[-3000:]}")
    return TrainingRun(launched, float(first.group(1)), float(rate.group(1)))


def plain_torchrun(epochs: int, timeout: float = 600.0, checkpoint_every: int = 1, **env_extra: str) -> TrainingRun:
    """The digits example under two plain torchrun nodes (1 rank each, static rendezvous on loopback).

    The same topology Phalanx runs on two agents with one CPU slot each, OMP_NUM_THREADS=1 as the
    agent sets it, and no PHALANX_* variables, so metrics stay in memory.
    """
    _, workdir = digits_spec(epochs)
    launched = time.time()
    args = ["train.py", f"--epochs={epochs}", f"--checkpoint-every={checkpoint_every}"]
    text = plain_torchrun_nodes(workdir, args, timeout, **env_extra)
    return parse_training_output(text, launched, "plain torchrun")


def plain_torchrun_nodes(
    workdir: Path, args: list[str], timeout: float = 600.0, nodes: int = 2, per_node: int = 1, **env_extra: str
) -> str:
    """`args` (a script and its arguments) under `nodes` plain torchrun nodes of `per_node` ranks
    each, static rendezvous on loopback, OMP_NUM_THREADS=1 as the agent sets it, no PHALANX_*
    variables but `env_extra`; returns node 0's output."""
    env = {**without_phalanx_env(), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env_extra}
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-") as tmp:
        supervisor = Supervisor(Path(tmp), env=env, grace=5.0)
        try:
            for node_rank in range(nodes):
                argv = [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    f"--nnodes={nodes}",
                    f"--node-rank={node_rank}",
                    f"--nproc-per-node={per_node}",
                    "--master-addr=127.0.0.1",
                    f"--master-port={port}",
                    "--rdzv-backend=static",
                    "--max-restarts=0",
                    *args,
                ]
                supervisor.spawn(f"node{node_rank}", argv, cwd=workdir)
            deadline = time.monotonic() + timeout
            for proc in supervisor.children.values():
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            codes = [proc.returncode for proc in supervisor.children.values()]
        finally:
            supervisor.close()
        text = supervisor.log("node0")
        if any(codes):
            raise BenchError(f"plain torchrun exited with {codes}:\n{text[-3000:]}")
        return text


def wait_for_job(running: RunningStack, job_id: int, timeout: float) -> JobDetail:
    """Long-poll the job (the server answers when its state changes, so watching costs the ranks
    nothing) until it ends; fail fast when a component died or the job sits QUEUED while every
    agent is idle."""
    client = running.client
    deadline = time.monotonic() + timeout
    queued_since = time.monotonic()
    job = client.get_job(job_id)
    while True:
        if job.state.is_terminal:
            return job
        running.check()
        now = time.monotonic()
        if job.state.value != "QUEUED":
            queued_since = now
        elif now - queued_since > QUEUED_GIVE_UP_S and all(a.used_cpu_slots == 0 for a in client.agents()):
            raise BenchError(
                f"job {job_id} is still QUEUED after {QUEUED_GIVE_UP_S:.0f} s with every agent idle: "
                "the scheduler stopped placing jobs (see its log)"
            )
        if now > deadline:
            raise BenchError(f"job {job_id} is still {job.state.value} after {timeout:.0f} s")
        job = client.get_job_change(job_id, job.state, wait=5.0)


def phalanx_run(
    running: RunningStack,
    epochs: int,
    timeout: float = 300.0,
    checkpoint_every: int = 1,
    spec_update: dict[str, object] | None = None,
) -> TrainingRun:
    """Submit the digits example (2 nodes x 1 cpu slot) and read rank 0's figures from its logs;
    `spec_update`: fields of the job spec to set (validated)."""
    spec, workdir = digits_spec(epochs, checkpoint_every)
    if spec_update:
        spec = JobSpec.model_validate({**spec.model_dump(), **spec_update})
    launched = time.time()
    text = phalanx_job_output(running, spec, workdir, timeout)
    return parse_training_output(text, launched, "the digits job")


def phalanx_job_output(running: RunningStack, spec: JobSpec, workdir: Path, timeout: float = 300.0) -> str:
    """Submit `spec`, wait for it to complete, and return rank 0's output once it printed its
    steps-per-second line (logs travel apart from the exit report) or 10 s passed."""
    client = running.client
    job = client.submit(spec, workdir)
    detail = wait_for_job(running, job.id, timeout)
    if detail.state.value != "COMPLETED":
        tail = "\n".join(r.line for r in client.logs(job.id, limit=1000)[-40:])
        raise BenchError(f"job {job.id} ended {detail.state.value}:\n{tail}")
    deadline = time.monotonic() + 10
    while True:
        text = "\n".join(record.line for record in client.logs(job.id, rank=0, limit=10_000))
        if STEPS_PER_SECOND.search(text) or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def steps_per_second(text: str, what: str) -> float:
    rate = STEPS_PER_SECOND.search(text)
    if rate is None:
        raise BenchError(f"{what}: rank 0 printed no steps-per-second line:\n{text[-3000:]}")
    return float(rate.group(1))


@contextmanager
def fresh_database(prefix: str = "phalanx_bench") -> Iterator[str]:
    """A migrated PostgreSQL database of its own (SQLAlchemy URL), dropped on the way out."""
    from server.db import engine_for, upgrade

    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    try:
        upgrade(url)
        yield url
    finally:
        engine_for(url).dispose()
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class ProcessGroup:
    """Phalanx components as supervised child processes (stack.supervisor), each logging to a file;
    closed agents first; a component that dies, or a wait that times out, raises BenchError."""

    def __init__(self, logs: Path, env: dict[str, str]) -> None:
        self.logs = logs
        self.supervisor = Supervisor(logs, env=env)

    def spawn(self, name: str, *args: str) -> None:
        self.supervisor.spawn(name, [*PHALANX, *args])

    def check(self) -> None:
        try:
            self.supervisor.check()
        except ChildExited as exc:
            raise BenchError(f"{exc}:\n{self.supervisor.log(exc.name)[-3000:]}") from exc

    def wait_until(self, predicate: Callable[[], object], timeout: float, what: str) -> None:
        try:
            self.supervisor.wait_until(predicate, timeout, what)
        except ChildExited as exc:
            raise BenchError(f"{exc}:\n{self.supervisor.log(exc.name)[-3000:]}") from exc
        except WaitTimedOut as exc:
            raise BenchError(str(exc)) from exc

    def pids(self) -> list[int]:
        return self.supervisor.pids()

    def close(self) -> None:
        # Agents first (started last): they stop their workers while the server still listens.
        self.supervisor.close()


def start_server(group: ProcessGroup, port: int, name: str = "server") -> str:
    url = f"http://127.0.0.1:{port}"
    group.spawn(name, "server", "--port", str(port))
    with Client(url, "") as probe:
        group.wait_until(probe.healthy, 60, f"the server to answer on {url}")
    return url


@contextmanager
def keep_logs_on_failure(logs: Path) -> Iterator[None]:
    """Copy a stack's logs somewhere lasting when the benchmark fails, and say where."""
    try:
        yield
    except BaseException:
        if logs.is_dir():
            kept = Path(tempfile.mkdtemp(prefix="phalanx-bench-failed-"))
            shutil.copytree(logs, kept, dirs_exist_ok=True)
            log(f"the stack's logs are kept in {kept}")
        raise


@dataclass(frozen=True)
class RunningStack:
    client: Client  # admin token
    check: Callable[[], None]  # raises if a component died
    pids: Callable[[], list[int]]  # the stack's own processes (their children are found from them)


def wait_quiet(pids: Callable[[], list[int]], timeout: float = 60.0) -> None:
    """Until the stack's process trees are idle (< 0.05 CPU-s in each of two 0.5 s samples): what
    the previous run left to do (reports landing, a fork-server importing torch) must not
    share the cores with the next measurement."""
    deadline = time.monotonic() + timeout
    quiet_samples = 0
    previous: dict[int, float] = {}
    while quiet_samples < 2 and time.monotonic() < deadline:
        current: dict[int, float] = {}
        for pid in pids():
            try:
                root = psutil.Process(pid)
                tree = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            for proc in tree:
                try:
                    times = proc.cpu_times()
                except psutil.Error:
                    continue
                current[proc.pid] = times.user + times.system
        busy = sum(cpu - previous.get(pid, cpu) for pid, cpu in current.items())
        quiet_samples = quiet_samples + 1 if previous and busy < 0.05 else 0
        previous = current
        time.sleep(0.5)


def postgres_env(database_url: str, data_dir: Path, **settings: str) -> dict[str, str]:
    """The environment of a stack's processes on `database_url` and the benchmarks' Redis, with the
    benchmarks' tokens; `settings`: more PHALANX_* variables."""
    return {
        **without_phalanx_env(),
        "PHALANX_DATA_DIR": str(data_dir),
        "PHALANX_DATABASE_URL": database_url,
        "PHALANX_BROKER_URL": REDIS_URL,
        "PHALANX_ADMIN_TOKEN": ADMIN_TOKEN,
        "PHALANX_AGENT_TOKEN": AGENT_TOKEN,
        **settings,
    }


@contextmanager
def postgres_stack(agents: int = 2, cpu_slots: int = 1) -> Iterator[RunningStack]:
    """Server, scheduler and agents as separate processes on a fresh PostgreSQL database + Redis."""
    with fresh_database() as database_url, tempfile.TemporaryDirectory(prefix="phalanx-bench-") as tmp:
        env = postgres_env(database_url, Path(tmp) / "data")
        group = ProcessGroup(Path(tmp) / "logs", env)
        with keep_logs_on_failure(group.logs):
            try:
                url = start_server(group, free_port())
                group.spawn("scheduler", "scheduler")
                for i in range(agents):
                    name = f"agent-{i}"
                    group.spawn(
                        name,
                        *("agent", "--server", url, "--name", name, "--address", "127.0.0.1"),
                        *("--cpu-slots", str(cpu_slots), "--work-dir", str(Path(tmp) / "agents" / name)),
                    )
                with Client(url, ADMIN_TOKEN) as client:
                    group.wait_until(
                        lambda: sum(a.state.value == "ACTIVE" for a in client.agents()) >= agents,
                        60,
                        f"{agents} agents to register",
                    )
                    yield RunningStack(client, group.check, group.pids)
                    group.check()
            finally:
                group.close()


@contextmanager
def embedded_stack(agents: int = 2, cpu_slots: int = 1) -> Iterator[RunningStack]:
    """`phalanx up`'s stack (SQLite + filesystem broker) on a temporary data dir and a free port."""
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-") as tmp:
        stack = EmbeddedStack(port=free_port(), data_dir=Path(tmp) / "data", agents=agents, cpu_slots=cpu_slots)

        def check() -> None:
            try:
                stack.check()
            except StackError as exc:
                raise BenchError(str(exc)) from exc

        with keep_logs_on_failure(stack.data_dir / "logs"), stack, stack.client() as client:
            yield RunningStack(client, check, lambda: list(stack.pids().values()))
            check()  # a component that died mid-run makes the figures suspect


@contextmanager
def stack(backend: str) -> Iterator[RunningStack]:
    """One running stack of the given backend, its two agents registered with 1 cpu slot each."""
    if backend == "embedded":
        with embedded_stack() as running:
            yield running
    elif backend == "postgres":
        with postgres_stack() as running:
            yield running
    else:
        raise ValueError(f"unknown backend {backend!r}: embedded or postgres")


def interleave(
    backend: str,
    repeat: int,
    plain: Callable[[], float],
    phalanx: Callable[[RunningStack], float],
    max_stack_failures: int = 3,
) -> tuple[list[float], list[float], list[str]]:
    """`repeat` pairs of (plain, Phalanx) figures on a running stack of `backend`, the order within
    a pair alternating (plain first, then Phalanx first, ...) so that neither side always runs
    right after the other.

    When the stack breaks (a component dies, the scheduler stops placing) the unfinished pair is
    dropped and the measurement goes on on a fresh stack, up to `max_stack_failures` times; the
    failures are returned so that the report shows them.
    """
    plain_runs: list[float] = []
    phalanx_runs: list[float] = []
    failures: list[str] = []
    while len(phalanx_runs) < repeat:
        try:
            with stack(backend) as running:
                while len(phalanx_runs) < repeat:
                    figures: dict[str, float] = {}
                    order = ("plain", "phalanx") if len(phalanx_runs) % 2 == 0 else ("phalanx", "plain")
                    for side in order:
                        wait_quiet(running.pids)
                        time.sleep(SETTLE_S)
                        figures[side] = plain() if side == "plain" else phalanx(running)
                    plain_runs.append(figures["plain"])
                    phalanx_runs.append(figures["phalanx"])
                    log(
                        f"{backend} {len(phalanx_runs)}/{repeat}: "
                        f"plain {figures['plain']:.2f}, phalanx {figures['phalanx']:.2f}"
                    )
        except (BenchError, StackError) as exc:
            failures.append(str(exc).splitlines()[0][:300])
            if len(failures) > max_stack_failures:
                raise
            log(f"the {backend} stack failed ({failures[-1]}); going on with a fresh one")
    return plain_runs, phalanx_runs, failures
