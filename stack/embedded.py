"""The embedded stack behind `phalanx up` and `phalanx demo`: one process tree, no services.

SQLite and kombu's filesystem broker live under the data dir; the server, the scheduler and the
local agents are child processes running the same commands a real deployment runs, so the
embedded mode exercises the real code paths. Tokens persist in `<data dir>/credentials.json`.

Its children are supervised (stack.supervisor): inside `with EmbeddedStack(...)` SIGHUP, SIGINT
and SIGTERM stop the whole stack, agents first, and every child dies with the process that
started it, even when that one is SIGKILLed.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType

from rich.console import Console

from phalanx.client import Client
from stack.supervisor import Supervisor, SupervisorError

REPO_ROOT = Path(__file__).resolve().parents[1]
# `python -m stack`: the command a deployment runs as `phalanx`, whatever the console script says
PHALANX = [sys.executable, "-m", "stack"]


def example_job_file() -> Path:
    return REPO_ROOT / "examples" / "digits" / "job.yaml"


class StackError(RuntimeError):
    """The stack did not come up, or one of its processes died."""


class EmbeddedStack:
    def __init__(
        self,
        port: int = 8000,
        data_dir: Path | None = None,
        agents: int = 2,
        cpu_slots: int = 1,
        grace: float = 20.0,
    ) -> None:
        self.port = port
        self.data_dir = (data_dir or Path(os.environ.get("PHALANX_DATA_DIR", Path.home() / ".phalanx"))).resolve()
        self.agents = agents
        self.cpu_slots = cpu_slots
        self.grace = grace
        self.url = f"http://127.0.0.1:{port}"
        self.supervisor: Supervisor | None = None
        self._running = ExitStack()

    def _credentials(self) -> dict[str, str]:
        path = self.data_dir / "credentials.json"
        if path.exists():
            creds: dict[str, str] = json.loads(path.read_text())
            return creds
        creds = {
            "admin_token": f"phx_u_{secrets.token_urlsafe(24)}",
            "agent_token": f"phx_a_{secrets.token_urlsafe(24)}",
        }
        path.write_text(json.dumps(creds))
        path.chmod(0o600)
        return creds

    def __enter__(self) -> EmbeddedStack:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.creds = self._credentials()
        env = {
            **os.environ,
            "PHALANX_DATA_DIR": str(self.data_dir),
            "PHALANX_DATABASE_URL": "",
            "PHALANX_BROKER_URL": "",
            "PHALANX_ADMIN_TOKEN": self.creds["admin_token"],
            "PHALANX_AGENT_TOKEN": self.creds["agent_token"],
        }
        supervisor = Supervisor(self.data_dir / "logs", env=env, grace=self.grace)
        with ExitStack() as starting:
            # From here a stop signal, a failure or a dead child stops whatever has started.
            self.supervisor = starting.enter_context(supervisor)
            try:
                self._start(supervisor)
            except SupervisorError as exc:
                raise StackError(str(exc)) from exc
            self._running = starting.pop_all()
        return self

    def _start(self, supervisor: Supervisor) -> None:
        from server.db import upgrade
        from server.settings import Settings

        upgrade(Settings(data_dir=self.data_dir, database_url="", broker_url="").database_url)
        supervisor.spawn("server", [*PHALANX, "server", "--port", str(self.port)])
        supervisor.spawn("scheduler", [*PHALANX, "scheduler"])
        with Client(self.url, "") as probe:
            supervisor.wait_until(probe.healthy, 60, f"the server to answer on {self.url}")
        for i in range(self.agents):
            name = f"local-{i}"
            argv = [*PHALANX, "agent", "--server", self.url, "--name", name, "--address", "127.0.0.1"]
            supervisor.spawn(name, [*argv, "--cpu-slots", str(self.cpu_slots)])
        with self.client() as client:
            supervisor.wait_until(
                lambda: sum(a.state.value == "ACTIVE" for a in client.agents()) >= self.agents,
                60,
                f"{self.agents} local agents to register",
            )

    def check(self) -> None:
        """Raise StackError if one of the stack's processes exited."""
        if self.supervisor is not None:
            try:
                self.supervisor.check()
            except SupervisorError as exc:
                raise StackError(str(exc)) from exc

    def pids(self) -> dict[str, int]:
        """The stack's own processes by name (server, scheduler, local-0, ...)."""
        children = self.supervisor.children if self.supervisor is not None else {}
        return {name: popen.pid for name, popen in children.items()}

    def client(self) -> Client:
        return Client(self.url, self.creds["admin_token"])

    def announce(self, console: Console) -> None:
        console.print(f"Phalanx is up at [bold]{self.url}[/] (API docs: {self.url}/docs)")
        console.print(f"admin token: [bold]{self.creds['admin_token']}[/]")
        console.print(f"  export PHALANX_URL={self.url} PHALANX_TOKEN={self.creds['admin_token']}")
        console.print(f"data and logs: {self.data_dir}")

    def wait_forever(self) -> None:
        """Until SIGHUP, SIGINT (Ctrl-C) or SIGTERM (a service manager's stop): each ends the stack
        cleanly. A process of the stack that dies raises StackError."""
        if self.supervisor is None:
            raise RuntimeError("the stack is not running: use `with EmbeddedStack(...)`")
        try:
            self.supervisor.wait_exit()
        except KeyboardInterrupt:  # supervisor.Stopped included
            return
        except SupervisorError as exc:
            raise StackError(str(exc)) from exc

    def close(self) -> None:
        """Stop every process of the stack: agents first, so that they stop their workers while the
        server can still hear their reports."""
        self._running.close()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
