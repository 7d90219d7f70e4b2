"""The agent's warm torchrun: a real torchrun, started from a process that imported torch early."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from stack.supervisor import free_port
from worker_agent.warm import WarmTorchrun

SCRIPT = """
import os, sys
print("cwd", os.getcwd())
print("flag", os.environ.get("JOB_FLAG"), "secret", os.environ.get("PHALANX_ADMIN_TOKEN"))
sys.exit(int(os.environ.get("EXIT_WITH", "0")))
"""


def torchrun_args(port: int, script: Path) -> list[str]:
    return [
        "--nnodes=1",
        "--nproc-per-node=1",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        "--rdzv-backend=static",
        "--max-restarts=0",
        "--no-python",
        sys.executable,
        str(script),
    ]


def test_warm_torchrun_runs_the_command_with_exactly_its_env_and_cwd(tmp_path: Path) -> None:
    script = tmp_path / "job" / "t.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    warm = WarmTorchrun({**os.environ, "PHALANX_ADMIN_TOKEN": "agent-secret"}, tmp_path / "agent", size=2)
    try:
        warm.prime()
        env = {"PATH": os.environ["PATH"], "JOB_FLAG": "on"}
        ok = warm.take(torchrun_args(free_port(), script), env, script.parent)
        failing = warm.take(torchrun_args(free_port(), script), {**env, "EXIT_WITH": "3"}, script.parent)
        assert ok is not None and failing is not None
        assert warm.take(["--help"], env, tmp_path) is None  # only two were waiting
        out, err = ok.communicate(timeout=120)
        assert ok.returncode == 0, err.decode()
        assert f"cwd {script.parent}" in out.decode()
        # the job's environment only: nothing of the agent's (its secrets included)
        assert "flag on secret None" in out.decode()
        _, err = failing.communicate(timeout=120)
        assert failing.returncode == 1 and b"exitcode  : 3" in err  # torchrun's own summary and status
    finally:
        warm.close()


def test_waiting_process_leaves_when_the_agent_goes(tmp_path: Path) -> None:
    warm = WarmTorchrun(dict(os.environ), tmp_path, size=1)
    warm.prime()
    (proc,) = warm._waiting
    assert proc.stdin is not None
    proc.stdin.close()  # what the kernel does when the agent dies
    proc.stdin = None
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and out == b"", err.decode()
    warm.close()
