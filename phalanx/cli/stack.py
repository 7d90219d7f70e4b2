"""The embedded stack behind `phalanx up` and `phalanx demo`: one process tree, no services.

SQLite and kombu's filesystem broker live under the data dir; the server, the scheduler and the
local agents are child processes running the same commands a real deployment runs, so the
embedded mode exercises the real code paths. Tokens persist in `<data dir>/credentials.json`.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

from rich.console import Console

from phalanx.client import Client

REPO_ROOT = Path(__file__).resolve().parents[2]


def example_job_file() -> Path:
    return REPO_ROOT / "examples" / "digits" / "job.yaml"


class StackError(RuntimeError):
    pass


class EmbeddedStack:
    def __init__(self, port: int = 8000, data_dir: Path | None = None, agents: int = 2, cpu_slots: int = 1) -> None:
        self.port = port
        self.data_dir = (data_dir or Path(os.environ.get("PHALANX_DATA_DIR", Path.home() / ".phalanx"))).resolve()
        self.agents = agents
        self.cpu_slots = cpu_slots
        self.url = f"http://127.0.0.1:{port}"
        self._procs: list[tuple[str, subprocess.Popen[bytes]]] = []

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
        from server.db import upgrade
        from server.settings import Settings

        upgrade(Settings(data_dir=self.data_dir, database_url="", broker_url="").database_url)
        logs = self.data_dir / "logs"
        logs.mkdir(exist_ok=True)
        phalanx = [sys.executable, "-m", "phalanx.cli.main"]
        self._spawn("server", [*phalanx, "server", "--port", str(self.port)], env, logs)
        self._spawn("scheduler", [*phalanx, "scheduler"], env, logs)
        try:
            self._wait_healthy(timeout=60)
            for i in range(self.agents):
                name = f"local-{i}"
                argv = [
                    *phalanx,
                    "agent",
                    "--server",
                    self.url,
                    "--name",
                    name,
                    "--address",
                    "127.0.0.1",
                    "--cpu-slots",
                    str(self.cpu_slots),
                ]
                self._spawn(name, argv, env, logs)
            self._wait_agents(timeout=60)
        except BaseException:
            self.close()
            raise
        return self

    def _spawn(self, name: str, argv: list[str], env: dict[str, str], logs: Path) -> None:
        out = open(logs / f"{name}.log", "ab")  # noqa: SIM115 - lives as long as the child
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        out.close()
        self._procs.append((name, proc))

    def _check_children(self) -> None:
        for name, proc in self._procs:
            if proc.poll() is not None:
                raise StackError(
                    f"the {name} process exited with code {proc.returncode}; "
                    f"see {self.data_dir / 'logs' / (name + '.log')}"
                )

    def _wait_healthy(self, timeout: float) -> None:
        probe = Client(self.url, "")
        deadline = time.monotonic() + timeout
        try:
            while not probe.healthy():
                self._check_children()
                if time.monotonic() > deadline:
                    raise StackError(f"the server did not answer on {self.url} within {timeout:.0f} s")
                time.sleep(0.1)
        finally:
            probe.close()

    def _wait_agents(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self.client() as client:
            while sum(a.state.value == "ACTIVE" for a in client.agents()) < self.agents:
                self._check_children()
                if time.monotonic() > deadline:
                    raise StackError(f"{self.agents} local agents did not register within {timeout:.0f} s")
                time.sleep(0.1)

    def client(self) -> Client:
        return Client(self.url, self.creds["admin_token"])

    def announce(self, console: Console) -> None:
        console.print(f"Phalanx is up at [bold]{self.url}[/] (API docs: {self.url}/docs)")
        console.print(f"admin token: [bold]{self.creds['admin_token']}[/]")
        console.print(f"  export PHALANX_URL={self.url} PHALANX_TOKEN={self.creds['admin_token']}")
        console.print(f"data and logs: {self.data_dir}")

    def wait_forever(self) -> None:
        """Until Ctrl-C or SIGTERM (a service manager's stop): either ends the stack cleanly."""
        signal.signal(signal.SIGTERM, _interrupt)
        try:
            while True:
                self._check_children()
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass

    def close(self) -> None:
        # Agents first, so they stop their workers while the server can still hear their reports.
        for _name, proc in reversed(self._procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs.clear()

    def __exit__(self, *_: object | TracebackType | None) -> None:
        self.close()


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt
