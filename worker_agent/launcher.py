"""Launch torchrun for one node of a gang, stream its ranks' output, and stop it without orphans.

torchrun starts every rank in a session of its own (start_new_session=True), so signalling
torchrun's process group would miss them: stopping walks the whole process tree instead.
"""

from __future__ import annotations

import codecs
import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import psutil

from phalanx.schemas import Assignment
from worker_agent.forkserver import ForkServer

# torchrun --tee prefixes every line of a rank with "[<role><local_rank>]:".
_RANK_PREFIX = re.compile(r"^\[default(\d+)\]:")
# Output is read in lines of at most this many bytes; a longer one arrives as several.
MAX_LINE_BYTES = 64 * 1024
# torchrun logs this the moment it finds a rank dead, before it stops the others and prints its
# summary: from then on the node is reporting a failure of its own.
_RANK_FAILED = "failed (exitcode:"
# How long a "kill" waits for a torchrun that is already reporting a failure of its own: its
# summary names the rank that failed, which a SIGKILL would lose (the job's failure reason then
# names a peer that failed only because that rank's connection broke).
FAILURE_REPORT_WAIT = 2.0
# torchrun's failure summary names the first failing rank under "Root Cause".
_SUMMARY_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_SUMMARY_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")


class FailureReport:
    """Collects what explains a failed node: the root-cause rank from torchrun's summary, its exit
    code, and the last stderr lines of each rank."""

    def __init__(self, keep: int = 5) -> None:
        self._keep = keep
        self._tails: dict[int | None, list[str]] = {}
        self._in_root_cause = False
        self.rank: int | None = None
        self.exit_code: int | None = None

    def add(self, rank: int | None, stream: str, text: str) -> None:
        if stream != "stderr":
            return
        tail = self._tails.setdefault(rank, [])
        tail.append(text)
        del tail[: -self._keep]
        if rank is not None:
            return
        if "Root Cause" in text:
            self._in_root_cause = True
        elif self._in_root_cause and self.rank is None and (m := _SUMMARY_RANK.match(text)):
            self.rank = int(m.group(1))
        elif self._in_root_cause and self.exit_code is None and (m := _SUMMARY_EXIT.match(text)):
            self.exit_code = int(m.group(1))

    def describe(self) -> str:
        if self.rank is None:
            return "\n".join(self._tails.get(None, []))
        code = "" if self.exit_code is None else f" with code {self.exit_code}"
        if self.exit_code is not None and self.exit_code < 0:
            code += f" ({signal.Signals(-self.exit_code).name})" if -self.exit_code in signal.valid_signals() else ""
        lines = "\n".join(self._tails.get(self.rank, []))
        return f"rank {self.rank} exited{code}" + (f"; its last stderr lines:\n{lines}" if lines else "")


def free_port(address: str) -> int:
    """A port free now on `address`, for rank 0's rendezvous store."""
    host = address if address not in ("", "localhost") else "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def interface_for(address: str) -> str | None:
    """The network interface that owns `address`; gloo must bind there, not to loopback."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == address for a in addrs):
            return str(name)
    return None


def entry_argv(entrypoint: str) -> list[str]:
    """The job's command, with `python` meaning the interpreter Phalanx itself runs on."""
    argv = shlex.split(entrypoint)
    if argv and argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    return argv


def torchrun_command(a: Assignment, log_dir: Path) -> list[str]:
    """The whole command line of a cold torchrun."""
    return [sys.executable, "-m", "torch.distributed.run", *torchrun_args(a, log_dir)]


def torchrun_args(a: Assignment, log_dir: Path, warm_ranks: bool = False) -> list[str]:
    """torchrun's arguments (what follows `python -m torch.distributed.run`); `warm_ranks`: a
    `python` entrypoint runs through the rank shim, which has the fork-server fork each rank."""
    assert a.master_port is not None
    return [
        f"--nnodes={a.nnodes}",
        f"--node-rank={a.node_rank}",
        f"--nproc-per-node={a.nproc_per_node}",
        f"--master-addr={a.master_addr}",
        f"--master-port={a.master_port}",
        "--rdzv-backend=static",
        # Phalanx owns restarts: every attempt is a fresh torchrun on a fresh port (DESIGN.md).
        "--max-restarts=0",
        "--monitor-interval=0.1",
        "--tee=3",
        f"--log-dir={log_dir}",
        "--no-python",
        *_rank_entry(a, warm_ranks),
    ]


def plain_command(a: Assignment, warm_ranks: bool = False) -> list[str]:
    """`launcher: plain`: the entrypoint once per slot with the standard variables
    (plain_launcher.py), which speaks torchrun's dialect to the agent."""
    assert a.master_port is not None
    return [
        sys.executable,
        "-m",
        "worker_agent.plain_launcher",
        f"--nnodes={a.nnodes}",
        f"--node-rank={a.node_rank}",
        f"--nproc-per-node={a.nproc_per_node}",
        f"--master-addr={a.master_addr}",
        f"--master-port={a.master_port}",
        "--",
        *_rank_entry(a, warm_ranks),
    ]


def _rank_entry(a: Assignment, warm_ranks: bool) -> list[str]:
    """What each rank runs; a `python` entrypoint through the rank shim when ranks are forked."""
    entry = entry_argv(a.entrypoint)
    if warm_ranks and entry and entry[0] == sys.executable:
        return [sys.executable, "-m", "worker_agent.rank_shim", *entry[1:]]
    return entry


def rank_env(a: Assignment, base: dict[str, str], server_url: str, address: str) -> dict[str, str]:
    import json

    # The agent's own PHALANX_* settings (an admin token, the database URL in a one-machine stack)
    # are none of the training code's business: ranks get only what is set below.
    env = {k: v for k, v in base.items() if not k.startswith("PHALANX_")}
    env.update(a.env)
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    env.update(
        PYTHONUNBUFFERED="1",
        PHALANX_URL=server_url,
        # the attempt's own credential, never the agent's token: it reports for this allocation only
        PHALANX_TOKEN=a.credential,
        PHALANX_JOB_ID=str(a.job_id),
        PHALANX_ALLOCATION_ID=str(a.allocation_id),
        PHALANX_ATTEMPT=str(a.attempt),
        PHALANX_HPARAMS=json.dumps(a.hyperparameters),
        PHALANX_PRECISION=a.precision.value,
        PHALANX_DDP=a.ddp.model_dump_json(),
        PHALANX_CHECKPOINT_ROOT=a.checkpoint_root,
        PHALANX_PG_TIMEOUT=f"{a.pg_timeout:g}",
    )
    if a.resume is not None:
        env.update(PHALANX_RESUME_STEP=str(a.resume.step), PHALANX_RESUME_PATH=a.resume.path)
    if a.slot_type.value == "gpu":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in a.slot_indices)
    elif "OMP_NUM_THREADS" not in a.env:
        # A CPU slot is one core: ranks of neighbouring slots must not fight over every core.
        # (torchrun itself only sets this when it starts more than one rank.)
        env["OMP_NUM_THREADS"] = "1"
    iface = interface_for(address)
    if iface and not address.startswith("127."):
        env["GLOO_SOCKET_IFNAME"] = iface
    return env


class Torchrun(Protocol):
    """A started torchrun: a `subprocess.Popen`, or a `ForkedProcess` from the fork-server."""

    pid: int
    stdout: Any
    stderr: Any

    def wait(self, timeout: float | None = None) -> int: ...

    def poll(self) -> int | None: ...


class NodeProcess:
    """One torchrun and its ranks. `on_line(rank, stream, line)` gets every output line."""

    def __init__(
        self,
        proc: Torchrun,
        node_rank: int,
        nproc: int,
        on_line: Callable[[int | None, str, str], None],
    ) -> None:
        self._proc = proc
        self.pid = proc.pid
        self._nproc = nproc
        self._rank_failed = threading.Event()
        self._pumps = [
            threading.Thread(
                target=self._pump, args=(stream, name, node_rank * nproc, on_line, self._rank_failed), daemon=True
            )
            for stream, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))
        ]
        for pump in self._pumps:
            pump.start()

    @classmethod
    def start(
        cls,
        a: Assignment,
        env: dict[str, str],
        cwd: Path,
        log_dir: Path,
        on_line: Callable[[int | None, str, str], None],
        forkserver: ForkServer | None = None,
        popen_args: dict[str, Any] | None = None,
        fork_ranks: bool = False,
    ) -> tuple[NodeProcess, bool]:
        """torchrun for this node, forked by the fork-server when it can; (process, was it warm)."""
        user = popen_args or {}
        proc: Torchrun | None = None
        command = torchrun_command(a, log_dir)
        if a.launcher == "plain":
            # The plain launcher imports nothing heavy: it starts cold as fast as a fork would.
            rank_socket = forkserver.rank_socket() if forkserver is not None and fork_ranks else None
            if rank_socket is not None:
                env = {**env, "PHALANX_FORK_SOCKET": rank_socket}
            command = plain_command(a, warm_ranks=rank_socket is not None)
        elif forkserver is not None:
            rank_socket = forkserver.rank_socket() if fork_ranks else None
            if rank_socket is not None:
                env = {**env, "PHALANX_FORK_SOCKET": rank_socket}
            args = torchrun_args(a, log_dir, warm_ranks=rank_socket is not None)
            proc = forkserver.launch(args, env, cwd, user.get("user"), user.get("group"))
        was_warm = proc is not None
        if proc is None:
            proc = subprocess.Popen(
                command,
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                **(popen_args or {}),  # the jobs' OS user (`--run-as`)
            )
        return cls(proc, a.node_rank, a.nproc_per_node, on_line), was_warm

    @staticmethod
    def _pump(
        stream: object,
        name: str,
        first_rank: int,
        on_line: Callable[[int | None, str, str], None],
        rank_failed: threading.Event | None = None,
    ) -> None:
        """Every output line to `on_line`, a line longer than MAX_LINE_BYTES as several (the rest
        keeps its rank): memory stays bounded whatever a job prints, and nothing is dropped."""
        assert hasattr(stream, "readline")
        decoder = codecs.getincrementaldecoder("utf-8")("replace")  # never splits a character
        rank: int | None = None
        continued = False
        for raw in iter(lambda: stream.readline(MAX_LINE_BYTES), b""):
            ends = raw.endswith(b"\n")
            text = decoder.decode(raw, final=ends).removesuffix("\n")
            if not continued:
                match = _RANK_PREFIX.match(text)
                rank = first_rank + int(match.group(1)) if match else None
                text = text[match.end() :] if match else text
            if rank_failed is not None and rank is None and name == "stderr" and _RANK_FAILED in text:
                rank_failed.set()
            on_line(rank, name, text)
            continued = not ends

    def wait(self) -> int:
        """Wait for torchrun and for the end of its output; the exit code (negative: a signal)."""
        code = self._proc.wait()
        for pump in self._pumps:
            pump.join(timeout=10)
        for stream in (self._proc.stdout, self._proc.stderr):
            if not any(pump.is_alive() for pump in self._pumps):
                with contextlib.suppress(OSError):
                    stream.close()
        return code

    def poll(self) -> int | None:
        return self._proc.poll()

    def _short_of_ranks(self) -> bool:
        """Whether torchrun runs fewer live ranks than it should: one died (or, at the very start,
        not all are started yet), or it said a rank failed."""
        if self._rank_failed.is_set():
            return True
        try:
            children = psutil.Process(self.pid).children()
            return sum(1 for c in children if c.status() != psutil.STATUS_ZOMBIE) < self._nproc
        except psutil.Error:
            return False

    def stop(self, grace: float) -> None:
        """SIGTERM the whole tree, then SIGKILL whatever is left after `grace` seconds.

        With no grace (a kill), a torchrun short of ranks gets up to FAILURE_REPORT_WAIT seconds to
        exit by itself or to have all its ranks again: the gang's other nodes are killed when one
        fails, and a node whose own rank failed at the same moment must still say which."""
        if grace <= 0:
            deadline = time.monotonic() + FAILURE_REPORT_WAIT
            while time.monotonic() < deadline and self._proc.poll() is None and self._short_of_ranks():
                time.sleep(0.01)
        try:
            root = psutil.Process(self.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        if grace > 0:
            for proc in tree:
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            alive = [p for p in tree if _alive(p)]
            if not alive:
                return
            # New ranks may have appeared while we waited; include them.
            tree = alive + [c for p in alive for c in _children(p) if c not in alive]
            time.sleep(0.05)
        for proc in reversed(tree):  # ranks before their torchrun, so it cannot start more
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()


def _alive(proc: psutil.Process) -> bool:
    try:
        return bool(proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def _children(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return list(proc.children(recursive=True))
    except psutil.NoSuchProcess:
        return []
