"""`phalanx up` leaves no process behind however it ends: its terminal window closed (the kernel
hangs the terminal up: SIGHUP), or the `up` process SIGKILLed (its children die with it).

A user found the scheduler of a `phalanx up` still running, orphaned, after closing the terminal
it ran in: Celery takes SIGHUP as "restart", and the hangup reached every process of the tree.
"""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from phalanx.client import Client
from tests.conftest import ADMIN_TOKEN, AGENT_TOKEN
from tests.processes import PHALANX, adopting_orphans, free_port, survivors, wait_for

pytestmark = pytest.mark.e2e
AGENTS = 2


@dataclass
class Terminal:
    """`phalanx up` running as the session leader of a pseudo-terminal, as a shell runs it in a
    terminal window; `master` is the window's end."""

    pid: int
    master: int
    url: str
    output: bytearray
    tree: list[psutil.Process] = field(default_factory=list)  # once up: every process under it
    closed: bool = False

    def read_available(self) -> str:
        """What `up` printed so far (the terminal must be read, or a full buffer blocks it)."""
        while not self.closed and select.select([self.master], [], [], 0)[0]:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # EIO: the other side is gone
                break
            if not chunk:
                break
            self.output += chunk
        return self.output.decode(errors="replace")

    def close(self) -> None:
        """Close the window: the kernel hangs up the terminal and sends its session leader SIGHUP."""
        if not self.closed:
            self.closed = True
            os.close(self.master)


@contextmanager
def up_in_a_terminal(tmp_path: Path) -> Iterator[Terminal]:
    port = free_port()
    data = tmp_path / "data"
    data.mkdir()  # `phalanx up` keeps the tokens it finds there
    (data / "credentials.json").write_text(json.dumps({"admin_token": ADMIN_TOKEN, "agent_token": AGENT_TOKEN}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
    argv = [*PHALANX, "up", "--port", str(port), "--data-dir", str(data), "--agents", str(AGENTS)]
    pid, master = pty.fork()  # the child: a new session, the pty its controlling terminal
    if pid == 0:
        try:
            os.execve(sys.executable, argv, env)
        finally:
            os._exit(127)
    terminal = Terminal(pid, master, f"http://127.0.0.1:{port}", bytearray())
    try:
        yield terminal
    except BaseException:
        print(f"`phalanx up` printed:\n{terminal.read_available()}")
        for log in sorted((data / "logs").glob("*.log")):
            print(f"===== {log.name}\n{log.read_text(errors='replace')[-3000:]}")
        raise
    finally:
        # whatever the test left running goes: `up` and its tree, killed and reaped
        leftovers = [*terminal.tree, *descendants(pid), *([psutil.Process(pid)] if psutil.pid_exists(pid) else [])]
        for proc in leftovers:
            with suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(leftovers, timeout=10)
        terminal.close()
        with suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def wait_until_up(terminal: Terminal) -> list[psutil.Process]:
    """Until the stack serves and its agents registered; then every process of its tree: the
    server, the scheduler, the agents and what the agents started (their fork-servers, in
    sessions of their own, which no terminal signal reaches)."""
    with Client(terminal.url, ADMIN_TOKEN) as client:
        wait_for(
            lambda: "Phalanx is up" in terminal.read_available() and client.healthy(),
            120,
            "`phalanx up` to announce itself and answer /healthz",
        )
        assert sum(a.state.value == "ACTIVE" for a in client.agents()) == AGENTS
    components = psutil.Process(terminal.pid).children()
    assert len(components) == 2 + AGENTS, [c.cmdline() for c in components]
    agents = [c for c in components if "agent" in c.cmdline()]
    # an agent starts its fork-server right after it registers
    wait_for(lambda: all(a.children() for a in agents), 60, "every agent to start its fork-server")
    terminal.tree = descendants(terminal.pid)
    assert len(terminal.tree) > len(components)
    return terminal.tree


def test_closing_the_terminal_stops_the_whole_tree(tmp_path: Path) -> None:
    with adopting_orphans(), up_in_a_terminal(tmp_path) as terminal:
        tree = wait_until_up(terminal)
        terminal.close()
        # `up` stops its children (agents first, then the server and the scheduler) and exits
        psutil.Process(terminal.pid).wait(timeout=120)
        assert survivors(tree, timeout=30) == []


def test_a_sigkilled_up_takes_its_children_with_it(tmp_path: Path) -> None:
    with adopting_orphans(), up_in_a_terminal(tmp_path) as terminal:
        tree = wait_until_up(terminal)
        os.kill(terminal.pid, signal.SIGKILL)  # no handler runs: only the kernel can stop the children
        psutil.Process(terminal.pid).wait(timeout=30)
        assert survivors(tree, timeout=60) == []
