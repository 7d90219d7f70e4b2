"""The fork-server: real torchruns forked from one process that imported torch once."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from stack.supervisor import free_port
from worker_agent.forkserver import ForkedProcess, ForkServer

SCRIPT = """
import os, sys, time
print("cwd", os.getcwd())
print("flag", os.environ.get("JOB_FLAG"), "secret", os.environ.get("PHALANX_ADMIN_TOKEN"))
if os.environ.get("SLEEP"):
    time.sleep(float(os.environ["SLEEP"]))
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


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ForkServer]:
    forks = ForkServer(dict(os.environ), tmp_path)
    yield forks
    forks.close()


def output(proc: ForkedProcess) -> tuple[str, str]:
    with proc.stdout as out, proc.stderr as err:
        return out.read().decode(), err.read().decode()


def test_every_launch_is_forked_with_exactly_its_env_and_cwd(tmp_path: Path) -> None:
    script = tmp_path / "job" / "t.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    server = ForkServer({**os.environ, "PHALANX_ADMIN_TOKEN": "agent-secret"}, tmp_path / "agent")
    try:
        env = {"PATH": os.environ["PATH"], "JOB_FLAG": "on"}
        launched = [
            server.launch(torchrun_args(free_port(), script), {**env, "EXIT_WITH": str(code)}, script.parent)
            for code in (0, 3, 0, 0)  # more than any pool held: a fork-server never runs dry
        ]
        assert all(proc is not None for proc in launched)
        results = [(output(proc), proc.wait()) for proc in launched if proc is not None]
        for (out, err), _code in results:
            assert f"cwd {script.parent}" in out, err  # why the rank did not run, when it did not
            # the job's environment only: nothing of the agent's (its secrets included)
            assert "flag on secret None" in out, err
        assert [code for _, code in results] == [0, 1, 0, 0]
        assert "exitcode  : 3" in results[1][0][1]  # torchrun's own summary and status
        forked = {proc.pid for proc in launched if proc is not None}
        assert len(forked) == 4 and server._proc is not None
        assert server._proc.pid not in forked
    finally:
        server.close()


def test_a_forked_torchrun_killed_reports_the_signal_and_its_tree_can_be_walked(
    tmp_path: Path, server: ForkServer
) -> None:
    script = tmp_path / "t.py"
    script.write_text(SCRIPT)
    proc = server.launch(torchrun_args(free_port(), script), {**os.environ, "SLEEP": "60"}, tmp_path)
    assert proc is not None
    tree = psutil.Process(proc.pid)
    deadline = time.monotonic() + 60
    while not tree.children(recursive=True) and time.monotonic() < deadline:
        time.sleep(0.05)  # torchrun starting its rank
    assert tree.children(recursive=True), "torchrun started no rank"
    assert os.getsid(proc.pid) == proc.pid  # a session of its own, like a cold torchrun
    for p in [*tree.children(recursive=True), tree]:
        p.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    output(proc)


def test_the_server_leaves_when_the_agent_goes_and_a_new_one_starts(tmp_path: Path) -> None:
    script = tmp_path / "t.py"
    script.write_text(SCRIPT)
    server = ForkServer(dict(os.environ), tmp_path)
    server.start()
    first = server._proc
    assert first is not None and server._conn is not None
    server._conn.sock.shutdown(2)  # what the kernel does to the server's end when the agent dies
    assert first.wait(timeout=60) == 0
    proc = server.launch(torchrun_args(free_port(), script), dict(os.environ), tmp_path)  # a new server
    assert proc is not None and proc.wait(timeout=120) == 0 and server._proc is not first
    output(proc)
    server.close()
    assert server.launch(torchrun_args(free_port(), script), dict(os.environ), tmp_path) is None  # closed


RANK_SCRIPT = """
import os, sys, time
import torch
print("rank", os.environ["RANK"], "threads", torch.get_num_threads(), "argv", sys.argv[1:], flush=True)
print("parent", os.getppid(), flush=True)
if os.environ.get("SLEEP"):
    time.sleep(float(os.environ["SLEEP"]))
sys.exit(int(os.environ.get("EXIT_WITH", "0")))
"""


def rank_args(port: int, script: Path, nproc: int = 2) -> list[str]:
    shim = [sys.executable, "-m", "worker_agent.rank_shim", str(script), "--flag"]
    return [
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        "--rdzv-backend=static",
        "--max-restarts=0",
        "--no-python",
        *shim,
    ]


def test_ranks_are_forked_too_with_their_threads_args_and_exit_code(tmp_path: Path, server: ForkServer) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    address = server.rank_socket()
    assert address is not None
    env = {**os.environ, "PHALANX_FORK_SOCKET": address, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
    proc = server.launch(rank_args(free_port(), script), env, tmp_path)
    assert proc is not None
    out, err = output(proc)
    assert proc.wait(timeout=120) == 0, err
    for rank in (0, 1):
        assert f"rank {rank} threads 1 argv ['--flag']" in out, out
    assert server._proc is not None
    assert out.count(f"parent {server._proc.pid}") == 2, out  # forked by the server, not started cold
    failing = server.launch(rank_args(free_port(), script, nproc=1), {**env, "EXIT_WITH": "7"}, tmp_path)
    assert failing is not None
    _, err = output(failing)
    assert failing.wait(timeout=120) == 1 and "exitcode  : 7" in err, err


def test_a_killed_shim_takes_its_forked_rank_with_it(tmp_path: Path, server: ForkServer) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    address = server.rank_socket()
    assert address is not None
    env = {**os.environ, "PHALANX_FORK_SOCKET": address, "SLEEP": "120"}
    proc = server.launch(rank_args(free_port(), script, nproc=1), env, tmp_path)
    assert proc is not None
    assert server._proc is not None
    server_side = psutil.Process(server._proc.pid)
    deadline = time.monotonic() + 60
    while len(server_side.children()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # the torchrun, then the rank it asked for
    ranks = [p for p in server_side.children() if p.pid != proc.pid]
    assert ranks, "no rank was forked"
    shims = psutil.Process(proc.pid).children()
    assert shims and "worker_agent.rank_shim" in " ".join(shims[0].cmdline())
    for shim in shims:
        shim.send_signal(signal.SIGKILL)  # what the agent's stop does to the tree it sees
    psutil.wait_procs(ranks, timeout=30)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks)
    proc.wait(timeout=60)
    output(proc)
