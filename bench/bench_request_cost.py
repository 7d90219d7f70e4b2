"""The server's CPU per agent request: heartbeats and work reads, one route at a time.

    python bench/bench_request_cost.py [--agents 200] [--clients 50] [--seconds 8]

One server process on a fresh PostgreSQL database (no scheduler, no agents of its own);
`--agents` agents registered through the API; then, for each route, `--clients` simulated agents
call it back to back for `--seconds`. Prints one JSON line per route: requests per second, and the
server process's CPU milliseconds per request (psutil, user + system, over the same seconds).

Why: one server process is bound by the GIL to about one core, so its CPU per request is what
bounds how many agents it serves (`bench/bench_scale.py`, RESULTS.md "Control-plane scale").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
import psutil

from bench._common import (
    AGENT_TOKEN,
    ProcessGroup,
    fresh_database,
    log,
    postgres_env,
    start_server,
)
from stack.supervisor import free_port

ROUTES = {
    "heartbeat": ("POST", "/api/v1/agents/{id}/heartbeat"),
    "work": ("GET", "/api/v1/agents/{id}/work"),  # no `wait`: a read each time
}


async def measure(url: str, server_pid: int, args: argparse.Namespace) -> list[dict[str, object]]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        agents = []
        for i in range(args.agents):
            body = {"name": f"cost-{i}", "address": "127.0.0.1", "cpu_slots": 8}
            headers = {"Authorization": f"Bearer {AGENT_TOKEN}"}
            async with http.post(f"{url}/api/v1/agents/register", json=body, headers=headers) as answer:
                registered = await answer.json()
            agents.append((registered["id"], registered["agent_token"]))
        server = psutil.Process(server_pid)
        results = []
        for route, (method, path) in ROUTES.items():
            calls = 0
            began = time.monotonic()
            cpu_before = sum(server.cpu_times()[:2])

            async def client(
                agent_id: int,
                token: str,
                route: str = route,
                method: str = method,
                path: str = path,
                began: float = began,
            ) -> None:
                nonlocal calls
                headers = {"Authorization": f"Bearer {token}"}
                while time.monotonic() - began < args.seconds:
                    async with http.request(method, url + path.format(id=agent_id), headers=headers) as answer:
                        await answer.read()
                        if answer.status >= 300:
                            raise RuntimeError(f"{route}: {answer.status}")
                    calls += 1

            await asyncio.gather(*(client(*a) for a in agents[: args.clients]))
            seconds = time.monotonic() - began
            cpu = sum(server.cpu_times()[:2]) - cpu_before
            results.append(
                {
                    "bench": "request_cost",
                    "route": route,
                    "requests_per_s": round(calls / seconds),
                    "server_cpu_ms_per_request": round(cpu / calls * 1000, 3),
                }
            )
            log(f"{route}: {results[-1]}")
        return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=200)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args()
    with fresh_database("phalanx_cost") as database_url, tempfile.TemporaryDirectory(prefix="phalanx-cost-") as tmp:
        group = ProcessGroup(Path(tmp) / "logs", postgres_env(database_url, Path(tmp) / "data"))
        try:
            url = start_server(group, free_port())
            results = asyncio.run(measure(url, group.supervisor.children["server"].pid, args))
        finally:
            group.close()
    for result in results:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
