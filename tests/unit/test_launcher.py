"""What the agent makes of torchrun's output."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from worker_agent.launcher import FAILURE_REPORT_WAIT, FailureReport, NodeProcess, entry_argv

# A stand-in for torchrun: its one rank is started, then (FAILING) dies, and the launcher reports
# the failure a moment later; or (HEALTHY) the rank keeps running.
FAILING = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "pass"]).wait()
print("E1205 api.py:1] failed (exitcode: 7) local_rank: 0 (pid: 1) of binary: x", file=sys.stderr, flush=True)
time.sleep(0.5)
sys.exit(1)
"""
HEALTHY = """
import subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print("ready", flush=True)
rank.wait()
"""

SUMMARY = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 18336)  (SIGTERM)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-03_07:54:40
  rank      : 3 (local_rank: 1)
  exitcode  : 7 (pid: 18337)
============================================================"""


def test_failure_report_names_the_root_cause_rank_and_its_stderr() -> None:
    report = FailureReport()
    report.add(3, "stderr", "Traceback (most recent call last):")
    report.add(3, "stderr", "ValueError: bad batch")
    report.add(2, "stderr", "unrelated")
    report.add(3, "stdout", "not stderr")
    for line in SUMMARY.splitlines():
        report.add(None, "stderr", line)
    assert (report.rank, report.exit_code) == (3, 7)
    text = report.describe()
    assert text.startswith("rank 3 exited with code 7")
    assert "ValueError: bad batch" in text and "unrelated" not in text and "not stderr" not in text


def test_failure_report_names_signals_and_falls_back_to_launcher_lines() -> None:
    report = FailureReport()
    for line in ["Root Cause (first observed failure):", "  rank      : 0 (local_rank: 0)", "  exitcode  : -9"]:
        report.add(None, "stderr", line)
    assert report.describe() == "rank 0 exited with code -9 (SIGKILL)"
    bare = FailureReport()
    bare.add(None, "stderr", "torchrun: error: unrecognized arguments")
    assert bare.describe() == "torchrun: error: unrecognized arguments"


def test_python_means_phalanx_interpreter() -> None:
    import sys

    assert entry_argv("python train.py --lr 0.1") == [sys.executable, "train.py", "--lr", "0.1"]
    assert entry_argv("bash run.sh 'a b'") == ["bash", "run.sh", "a b"]


def test_ranks_do_not_inherit_the_agents_secrets() -> None:
    from phalanx.schemas import Assignment
    from worker_agent.launcher import rank_env

    assignment = Assignment.model_validate(
        {
            "allocation_id": 7,
            "job_id": 3,
            "attempt": 2,
            "node_rank": 0,
            "nnodes": 2,
            "nproc_per_node": 1,
            "slot_type": "cpu",
            "slot_indices": [0],
            "master_addr": "127.0.0.1",
            "master_port": 1234,
            "desired": "run",
            "entrypoint": "python t.py",
            "env": {"MY_FLAG": "1"},
            "hyperparameters": {"lr": 0.1},
            "precision": "32",
            "credential": "phx_r_7_secret",
        }
    )
    base = {
        "PATH": "/usr/bin",
        "PHALANX_ADMIN_TOKEN": "secret",
        "PHALANX_DATABASE_URL": "postgresql://x",
        "PHALANX_TOKEN": "the-agents-own-token",
    }
    env = rank_env(assignment, base, "http://server:8000", "127.0.0.1")
    assert "PHALANX_ADMIN_TOKEN" not in env and "PHALANX_DATABASE_URL" not in env
    # the attempt's own credential, never the agent's token
    assert env["PHALANX_TOKEN"] == "phx_r_7_secret" and env["PHALANX_ALLOCATION_ID"] == "7"
    assert env["MY_FLAG"] == "1" and env["OMP_NUM_THREADS"] == "1"


def _launcher(source: str, lines: list[str]) -> NodeProcess:
    proc = subprocess.Popen(
        [sys.executable, "-c", source], stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    return NodeProcess(proc, node_rank=0, nproc=1, on_line=lambda _rank, _stream, text: lines.append(text))


def _wait_for_line(lines: list[str], fragment: str) -> None:
    deadline = time.monotonic() + 30
    while not any(fragment in line for line in lines):
        assert time.monotonic() < deadline, lines
        time.sleep(0.01)


def test_a_kill_lets_a_torchrun_reporting_its_rank_failure_finish() -> None:
    lines: list[str] = []
    node = _launcher(FAILING, lines)
    _wait_for_line(lines, "failed (exitcode")
    node.stop(0.0)
    assert node.wait() == 1  # its own exit, summary printed: not SIGKILLed mid-report


def test_a_kill_of_a_healthy_torchrun_is_immediate() -> None:
    lines: list[str] = []
    node = _launcher(HEALTHY, lines)
    _wait_for_line(lines, "ready")
    started = time.monotonic()
    node.stop(0.0)
    assert node.wait() == -9
    assert time.monotonic() - started < FAILURE_REPORT_WAIT / 2


PLAIN_RANK = """
import os, sys
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
print(" ".join(f"{k}={os.environ[k]}" for k in keys), flush=True)
if os.environ["RANK"] == os.environ.get("FAIL_RANK"):
    print("on purpose", file=sys.stderr, flush=True)
    sys.exit(3)
"""


def _plain(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "rank.py"
    script.write_text(PLAIN_RANK)
    args = ["--nnodes=2", "--node-rank=1", "--nproc-per-node=2", "--master-addr=10.0.0.1", "--master-port=29500"]
    return subprocess.run(
        [sys.executable, "-m", "worker_agent.plain_launcher", *args, "--", sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )


def test_the_plain_launcher_sets_the_standard_variables_and_prefixes_each_rank(tmp_path: Path) -> None:
    done = _plain(tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == [
        f"[default{local}]:RANK={2 + local} LOCAL_RANK={local} WORLD_SIZE=4 LOCAL_WORLD_SIZE=2 NODE_RANK=1 "
        "MASTER_ADDR=10.0.0.1 MASTER_PORT=29500"
        for local in (0, 1)
    ]


def test_the_plain_launcher_reports_a_failed_rank_as_torchrun_does(tmp_path: Path) -> None:
    done = _plain(tmp_path, FAIL_RANK="3")
    assert done.returncode == 1
    report = FailureReport()
    for line in done.stderr.splitlines():
        rank = 2 + int(line[len("[default") :].split("]")[0]) if line.startswith("[default") else None
        report.add(rank, "stderr", line.split("]:", 1)[1] if rank is not None else line)
    assert report.describe() == "rank 3 exited with code 3; its last stderr lines:\non purpose"
