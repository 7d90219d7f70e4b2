"""Run Phalanx components as real, separate processes for integration and end-to-end tests.

Each component runs the same CLI command a deployment (and docker-compose.yml) runs, under the
one process supervisor (stack.supervisor) that `phalanx up` uses too.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

from phalanx.client import Client
from stack.supervisor import Supervisor, free_port
from tests.conftest import ADMIN_TOKEN, AGENT_TOKEN

PHALANX = [sys.executable, "-m", "stack"]  # the whole `phalanx` command: user commands and launchers
REPO = Path(__file__).resolve().parents[1]


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    """Poll `predicate` until it returns something truthy; fail naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


class Stack:
    """Server, scheduler(s) and agents as child processes sharing one database and broker.

    The children are supervised (stack.supervisor): each logs to `<tmp>/logs/<name>.log`, and dies
    with the test process even when that one is killed."""

    def __init__(self, tmp: Path, database_url: str, broker_url: str, **env: str) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.logs = tmp / "logs"
        self.env = {
            **os.environ,
            "PHALANX_DATA_DIR": str(tmp / "data"),
            "PHALANX_DATABASE_URL": database_url,
            "PHALANX_BROKER_URL": broker_url,
            "PHALANX_ADMIN_TOKEN": ADMIN_TOKEN,
            "PHALANX_AGENT_TOKEN": AGENT_TOKEN,
            "PHALANX_HEARTBEAT_INTERVAL": "0.5",
            "PHALANX_HEARTBEAT_TIMEOUT": "5",
            "PHALANX_SCHEDULE_INTERVAL": "1",
            "PHALANX_LOG_LEVEL": "info",
            **env,
        }
        self.supervisor = Supervisor(self.logs, env=self.env, grace=30.0)

    @property
    def procs(self) -> dict[str, subprocess.Popen[bytes]]:
        return self.supervisor.children

    def spawn(self, name: str, *args: str, netns: str | None = None) -> subprocess.Popen[bytes]:
        prefix = ["ip", "netns", "exec", netns] if netns else []
        return self.supervisor.spawn(name, [*prefix, *PHALANX, *args])

    def start_server(self, host: str | None = None, name: str = "server", port: int | None = None) -> None:
        """Listen on loopback, or on `host` (then the stack's URL points there); a replica behind
        a balancer listens on a `port` of its own under its own `name`."""
        if host is not None:
            self.url = f"http://{host}:{self.port}"
        port = port or self.port
        self.spawn(name, "server", "--port", str(port), *(["--host", host] if host else []))
        probe = Client(f"http://{host or '127.0.0.1'}:{port}", "")
        try:
            wait_for(lambda: probe.healthy() or self._died(name), 60, f"{name} to answer /healthz")
        finally:
            probe.close()

    def start_scheduler(self, name: str = "scheduler") -> None:
        self.spawn(name, "scheduler")

    def start_agent(
        self,
        name: str,
        cpu_slots: int = 1,
        kill_grace: float = 5.0,
        address: str = "127.0.0.1",
        netns: str | None = None,
        work_dir: Path | None = None,
        extra: tuple[str, ...] = (),
    ) -> None:
        """An agent on loopback, or inside network namespace `netns` advertising `address`;
        `extra`: more of `phalanx agent`'s options."""
        self.spawn(
            name,
            "agent",
            "--server",
            self.url,
            "--name",
            name,
            "--address",
            address,
            "--cpu-slots",
            str(cpu_slots),
            "--kill-grace",
            str(kill_grace),
            "--work-dir",
            str(work_dir or self.tmp / "agents" / name),
            *extra,
            netns=netns,
        )

    def wait_agents(self, count: int) -> None:
        with self.client() as client:
            wait_for(
                lambda: sum(a.state.value == "ACTIVE" for a in client.agents()) >= count,
                60,
                f"{count} agents to register",
            )

    def _died(self, name: str) -> bool:
        proc = self.procs[name]
        if proc.poll() is not None:
            raise AssertionError(f"{name} exited with {proc.returncode}:\n{self.log(name)[-3000:]}")
        return False

    def log(self, name: str) -> str:
        return self.supervisor.log(name)

    def client(self) -> Client:
        return Client(self.url, self.env["PHALANX_ADMIN_TOKEN"])

    def stop(self, name: str, sig: int = signal.SIGTERM) -> None:
        """Signal a component; whatever of its process tree outlives it (a torchrun tree
        after a kill -9, say) is killed too, so no test leaves a process behind."""
        self.supervisor.stop(name, sig)

    def dump(self) -> str:
        """Every component's thread stacks (SIGUSR1) and log tail: what a failed test shows."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGUSR1)
        time.sleep(0.5)  # let faulthandler write; there is no event to await for a signal handler
        return "\n".join(f"===== {name}\n{self.log(name)[-6000:]}" for name in self.procs)

    def close(self) -> None:
        # agents first: they stop their workers and report while the servers still listen
        control_plane = ("server", "scheduler", "balancer")
        self.supervisor.close(order=[name for name in self.procs if not name.startswith(control_plane)])


def cli(stack: Stack, *args: str, ok: bool = True, **env: str) -> subprocess.CompletedProcess[str]:
    """Run `phalanx ARGS` against the stack with its admin token; `ok`: assert it exited 0."""
    environ = {**stack.env, "PHALANX_URL": stack.url, "PHALANX_TOKEN": stack.env["PHALANX_ADMIN_TOKEN"], **env}
    done = subprocess.run([*PHALANX, *args], env=environ, capture_output=True, text=True, timeout=240)
    if ok:
        assert done.returncode == 0, done.stderr
    return done


def processes_of_allocation(stack: Stack, allocation_id: int) -> list[int]:
    """PIDs whose environment says they work for this allocation of this stack (ranks and their
    torchrun); other stacks on the machine number their allocations from 1 too."""
    return processes_with_env("PHALANX_ALLOCATION_ID", str(allocation_id), PHALANX_URL=stack.url)


@contextmanager
def two_agent_stack(
    tmp: Path,
    database_url: str,
    broker_url: str,
    cpu_slots: int = 1,
    start_servers: Callable[[Stack], None] = Stack.start_server,
    **env: str,
) -> Iterator[Stack]:
    """Server, scheduler and two agents of `cpu_slots` slots (node-a, node-b), registered; stopped
    on the way out, their logs printed when the body raises. `start_servers`: what answers on the
    stack's URL (one server by default)."""
    stack = Stack(tmp, database_url, broker_url, **env)
    try:
        start_servers(stack)
        stack.start_scheduler()
        stack.start_agent("node-a", cpu_slots=cpu_slots)
        stack.start_agent("node-b", cpu_slots=cpu_slots)
        stack.wait_agents(2)
        yield stack
    except BaseException:
        print(stack.dump())
        raise
    finally:
        stack.close()


def processes_with_env(name: str, value: str, **more: str) -> list[int]:
    """PIDs of live processes whose environment has name=value (and every `more` pair too);
    zombies have no environment."""
    markers = [f"{k}={v}".encode() for k, v in {name: value, **more}.items()]
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        variables = set(environ.split(b"\0"))
        if all(marker in variables for marker in markers):
            found.append(int(entry.name))
    return found


@contextmanager
def adopting_orphans() -> Iterator[None]:
    """Make this process a child subreaper for the block: what the trees it starts leave behind
    is reparented here, not to an init that may never reap it (this machine's does not), so that
    psutil.wait_procs sees those processes end, and reaps them."""
    import ctypes

    set_child_subreaper = 36  # PR_SET_CHILD_SUBREAPER
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    if prctl(set_child_subreaper, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    try:
        yield
    finally:
        prctl(set_child_subreaper, 0, 0, 0, 0)


def survivors(procs: list[psutil.Process], timeout: float) -> list[str]:
    """Wait up to `timeout` s for `procs` to end; describe those still running then (none: [])."""
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    found = []
    for proc in alive:
        try:
            found.append(f"{proc.pid} {proc.status()} {' '.join(proc.cmdline())[:200]}")
        except psutil.NoSuchProcess:
            continue
    return found


def sigkill_rank(stack: Stack, allocation_id: int, rank: int) -> None:
    """SIGKILL one rank of a running allocation, as a crash would."""
    (pid,) = wait_for(
        lambda: processes_with_env("PHALANX_ALLOCATION_ID", str(allocation_id), RANK=str(rank), PHALANX_URL=stack.url),
        30,
        f"rank {rank}'s process",
    )
    os.kill(pid, signal.SIGKILL)


def final_checksum(client: Client, job_id: int) -> str:
    """The `final-checksum:` rank 0 printed last (the examples print their parameters' sha256)."""
    lines = [line.line for line in client.logs(job_id, rank=0, limit=10_000)]
    sums = [line.split(":", 1)[1].strip() for line in lines if line.startswith("final-checksum:")]
    assert sums, f"rank 0 printed no checksum: {lines[-10:]}"
    return sums[-1]


class Balancer:
    """A TCP load balancer on loopback, as any HTTP load balancer in front of server replicas:
    each new connection goes to the next backend in turn, and a backend that refuses the connection
    (a dead replica) is skipped. Runs its own event loop in a thread for the `with` block."""

    def __init__(self, port: int, backends: list[int]) -> None:
        self.port = port
        self.backends = backends
        self.connections: dict[int, int] = dict.fromkeys(backends, 0)  # per backend, in all
        self._turn = 0
        self._writers: set[asyncio.StreamWriter] = set()  # every open side, closed on the way out
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="balancer", daemon=True)

    def __enter__(self) -> Balancer:
        self._thread.start()
        started = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._relay, "127.0.0.1", self.port), self._loop
        )
        self._server = started.result(timeout=10)
        return self

    def __exit__(self, *_: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _stop(self) -> None:
        """Stop listening, end every relay, and wait until every socket is closed (a socket left
        to the garbage collector is a ResourceWarning, an error in this test suite)."""
        self._server.close()
        relays = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in relays:
            task.cancel()
        await asyncio.gather(*relays, return_exceptions=True)
        for writer in list(self._writers):
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        await self._server.wait_closed()

    async def _relay(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self._writers.add(client_writer)
        for _ in self.backends:
            port = self.backends[self._turn % len(self.backends)]
            self._turn += 1
            try:
                backend_reader, backend_writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                continue
            self._writers.add(backend_writer)
            self.connections[port] += 1
            break
        else:
            client_writer.close()
            return

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            except OSError:
                pass
            finally:
                writer.close()  # one side gone (a killed replica): so is the other

        await asyncio.gather(pipe(client_reader, backend_writer), pipe(backend_reader, client_writer))
