"""Recovery time, measured against plain torchrun in the same run.

1. worker SIGKILL -> first training step after the restart. Baseline: plain torchrun restarting
   the same script locally (`--standalone --max-restarts 1`, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1,
   which its restarts need). Phalanx: the example as a 2-node job on the embedded stack; it
   restarts the whole gang from the newest checkpoint. Goal: <= 1.2x torchrun's time.
2. agent SIGKILL (with its workers) -> the job trains again on another agent, median of `repeat`
   runs (the kill lands anywhere in the heartbeat period). The survivors' ranks fail on a reset
   connection and the gang restarts without waiting for the dead agent's heartbeat timeout.
   Goals: <= 1.5x the worker SIGKILL recovery of 1. (same run), and <= heartbeat timeout + 3 s.

    python bench/bench_recovery.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC
from pathlib import Path

import psutil

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import contextlib

from bench._common import wait_quiet
from phalanx.client import Client, load_job_file
from stack.embedded import EmbeddedStack
from stack.supervisor import free_port

REPO = Path(__file__).resolve().parents[1]
DIGITS = REPO / "examples" / "digits"
EPOCHS = 400  # far longer than a measurement: each run is stopped once it trained again
FIRST_STEP = "phalanx-first-step"


def with_env(**pairs: str) -> list[int]:
    """PIDs of training scripts whose environment has every pair (the ranks we kill); helpers
    they fork (torch's resource tracker, say) inherit the environment but run something else."""
    wanted = [f"{k}={v}".encode() for k, v in pairs.items()]
    found = []
    for proc in psutil.process_iter():
        try:
            environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
            script = any(arg.endswith("train.py") for arg in proc.cmdline())
        except (OSError, psutil.Error):
            continue
        if script and all(w in environ for w in wanted):
            found.append(proc.pid)
    return found


def wait(predicate, timeout: float, what: str, interval: float = 0.02):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout} s")
        time.sleep(interval)
    return value


def torchrun_restart() -> float:
    """SIGKILL rank 1 of a plain torchrun; seconds until rank 0 of the new attempt trained a step."""
    tag = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
    env.update(
        BENCH_TAG=tag,
        OMP_NUM_THREADS="1",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        PHALANX_CHECKPOINT_ROOT=f"file://{tempfile.mkdtemp(prefix='bench-ckpt-')}",
    )
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "train.py",
        "--epochs",
        str(EPOCHS),
    ]
    proc = subprocess.Popen(argv, cwd=DIGITS, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    first_steps: list[float] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(FIRST_STEP):
                first_steps.append(float(line.split()[1]))

    threading.Thread(target=read, daemon=True).start()
    tree = psutil.Process(proc.pid)
    try:
        wait(lambda: first_steps, 120, "first step")
        time.sleep(1.0)  # well into training, as in the Phalanx run (after a checkpoint)
        (rank1,) = wait(lambda: with_env(BENCH_TAG=tag, RANK="1"), 30, "rank 1")
        killed = time.time()
        os.kill(rank1, signal.SIGKILL)
        wait(lambda: len(first_steps) >= 2, 120, "first step after the restart")
        return first_steps[1] - killed
    finally:
        for member in [*tree.children(recursive=True), tree]:
            with contextlib.suppress(psutil.NoSuchProcess):
                member.kill()
        proc.wait()


def first_step_after(client: Client, job_id: int, since: float) -> float | None:
    for line in client.logs(job_id, rank=0, limit=10_000):
        if line.line.startswith(FIRST_STEP) and float(line.line.split()[1]) > since:
            return float(line.line.split()[1])
    return None


def log_breakdown(what: str, client: Client, job_id: int, killed: float, first: float) -> None:
    """Where the time went: each job event after the kill, then the first step (stderr)."""
    parts = [
        f"{event.to_state} +{event.time.replace(tzinfo=UTC).timestamp() - killed:.2f}"
        for event in client.get_job(job_id).events
        if event.time.replace(tzinfo=UTC).timestamp() > killed
    ]
    print(f"[bench] {what}: {', '.join(parts)}, first step +{first - killed:.2f} s", file=sys.stderr, flush=True)


def phalanx_restart(stack: EmbeddedStack) -> float:
    """SIGKILL rank 1 of a 2-node job; seconds until rank 0 of the next attempt trained a step."""
    spec, workdir = load_job_file(DIGITS / "job.yaml")
    spec = spec.model_copy(update={"entrypoint": f"python train.py --epochs {EPOCHS}", "max_restarts": 1})
    with stack.client() as client:
        job = client.submit(spec, workdir)
        try:
            wait(lambda: client.checkpoints(job.id), 120, "a committed checkpoint", interval=0.2)
            allocation = client.get_job(job.id).allocations[-1].id
            (rank1,) = wait(lambda: with_env(PHALANX_ALLOCATION_ID=str(allocation), RANK="1"), 30, "rank 1")
            killed = time.time()
            os.kill(rank1, signal.SIGKILL)
            first = wait(lambda: first_step_after(client, job.id, killed), 120, "a step of the next attempt", 0.1)
            log_breakdown("worker kill", client, job.id, killed, float(first))
            return float(first) - killed
        finally:
            client.kill_job(job.id)
            wait(lambda: not client.get_job(job.id).allocations[-1].active, 60, "the job to stop", 0.2)


def agent_loss(stack: EmbeddedStack) -> float:
    """SIGKILL an agent and its workers; seconds until the job trained a step elsewhere."""
    spec, workdir = load_job_file(DIGITS / "job.yaml")
    spec = spec.model_copy(update={"entrypoint": f"python train.py --epochs {EPOCHS}"})
    with stack.client() as client:
        job = client.submit(spec, workdir)
        try:
            wait(lambda: client.checkpoints(job.id), 120, "a committed checkpoint", interval=0.2)
            victim = client.get_job(job.id).allocations[-1].nodes[1].agent_name
            tree = psutil.Process(stack.pids()[victim])
            killed = time.time()
            for proc in [*tree.children(recursive=True), tree]:
                proc.kill()
            first = wait(lambda: first_step_after(client, job.id, killed), 120, "a step elsewhere", 0.1)
            log_breakdown("agent kill", client, job.id, killed, float(first))
            return float(first) - killed
        finally:
            client.kill_job(job.id)


def stack_pids(stack: EmbeddedStack) -> Callable[[], list[int]]:
    return lambda: list(stack.pids().values())


def run(repeat: int = 3) -> dict[str, object]:
    plain, ours = [], []
    with tempfile.TemporaryDirectory() as data, EmbeddedStack(port=free_port(), data_dir=Path(data)) as stack:
        for _ in range(repeat):  # interleaved: drift of the machine hits both alike
            wait_quiet(stack_pids(stack))
            plain.append(torchrun_restart())
            wait_quiet(stack_pids(stack))
            ours.append(phalanx_restart(stack))
    losses = []
    for _ in range(repeat):
        # a third agent to move to; the one killed is not restarted, so each run has a fresh stack
        with (
            tempfile.TemporaryDirectory() as data,
            EmbeddedStack(port=free_port(), data_dir=Path(data), agents=3) as stack,
        ):
            wait_quiet(stack_pids(stack))
            losses.append(agent_loss(stack))
    timeout = float(os.environ.get("PHALANX_HEARTBEAT_TIMEOUT", "10"))
    lost = statistics.median(losses)
    plain_s, ours_s = statistics.median(plain), statistics.median(ours)
    ratio = ours_s / plain_s
    return {
        "bench": "recovery",
        "worker_kill_torchrun_s": round(plain_s, 2),
        "worker_kill_phalanx_s": round(ours_s, 2),
        "ratio": round(ratio, 3),
        "goal_ratio": 1.2,
        "torchrun_runs": [round(v, 2) for v in plain],
        "phalanx_runs": [round(v, 2) for v in ours],
        "agent_kill_s": round(lost, 2),
        "agent_kill_runs": [round(v, 2) for v in losses],
        "goal_agent_kill_s": timeout + 3,
        "agent_kill_vs_worker_kill": round(lost / ours_s, 3),
        "goal_agent_kill_vs_worker_kill": 1.5,
        "ok": ratio <= 1.2 and lost <= timeout + 3 and lost / ours_s <= 1.5,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    result = run(parser.parse_args().repeat)
    print(json.dumps(result))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
