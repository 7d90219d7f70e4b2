"""The server's CPU per agent request, one route at a time: heartbeats, work reads and the
routes a node's start costs.

    python bench/bench_request_cost.py [--agents 50] [--slots 8] [--seconds 8]

One server process and one scheduler on a fresh PostgreSQL database; `--agents` agents registered
through the API, and one one-slot job per slot submitted, so each agent is assigned `--slots`
nodes. Then, for each route, every agent calls it back to back for `--seconds`: its heartbeat, its
work (a read each time, with `--slots` assignments), and, cycling through its nodes, rendezvous,
started (idempotent after the first) and a log batch of 5 lines. Prints one JSON line per route:
requests per second, and the server process's CPU milliseconds per request (psutil, user + system,
over the same seconds).

Why: one server process is bound by the GIL to about one core, so its CPU per request is what
bounds how many agents it serves (`bench/bench_scale.py`, RESULTS.md "Control-plane scale").
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
import psutil

from bench._common import (
    ADMIN_TOKEN,
    AGENT_TOKEN,
    ProcessGroup,
    fresh_database,
    log,
    postgres_env,
    start_server,
)
from stack.supervisor import free_port

API = "/api/v1"
TEAM = "cost"
PLACED_TIMEOUT_S = 120.0

# route -> (method, path, JSON body); {agent}, {allocation} and {rank} are filled in per call
ROUTES: dict[str, tuple[str, str, Any]] = {
    "heartbeat": ("POST", "/agents/{agent}/heartbeat", None),
    "work": ("GET", "/agents/{agent}/work", None),  # no `wait`: a read each time
    "rendezvous": ("POST", "/agents/{agent}/allocations/{allocation}/rendezvous", {"master_port": 29500}),
    "started": ("POST", "/agents/{agent}/allocations/{allocation}/started", {"node_rank": 0}),
    "logs": ("POST", "/agents/{agent}/allocations/{allocation}/logs", "lines"),
}


async def call(http: aiohttp.ClientSession, method: str, url: str, token: str, body: Any = None) -> Any:
    async with http.request(method, url, headers={"Authorization": f"Bearer {token}"}, json=body) as answer:
        text = await answer.read()
        if answer.status >= 300:
            raise RuntimeError(f"{method} {url}: {answer.status} {text[:200]!r}")
        return json.loads(text) if text else None


async def setup(http: aiohttp.ClientSession, url: str, args: argparse.Namespace) -> list[tuple[int, str, list[int]]]:
    """Registered agents, each with its token and the allocations of the `--slots` nodes it holds."""
    agents = []
    for i in range(args.agents):
        body = {"name": f"cost-{i}", "address": "127.0.0.1", "cpu_slots": args.slots}
        registered = await call(http, "POST", f"{url}{API}/agents/register", AGENT_TOKEN, body)
        agents.append((registered["id"], registered["agent_token"]))
    await call(http, "POST", f"{url}{API}/teams", ADMIN_TOKEN, {"name": TEAM})
    spec = {"name": "cost", "team": TEAM, "entrypoint": "python train.py"}
    spec["resources"] = {"nodes": 1, "slots_per_node": 1, "slot_type": "cpu"}
    for _ in range(args.agents * args.slots):
        form = aiohttp.FormData()
        form.add_field("spec", json.dumps(spec))
        async with http.post(f"{url}{API}/jobs", data=form, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as a:
            if a.status != 201:
                raise RuntimeError(f"submit: {a.status} {await a.text()}")
    deadline = time.monotonic() + PLACED_TIMEOUT_S
    placed: list[tuple[int, str, list[int]]] = []
    for agent_id, token in agents:
        while True:
            work = await call(http, "GET", f"{url}{API}/agents/{agent_id}/work", token)
            if len(work["assignments"]) == args.slots:
                placed.append((agent_id, token, [a["allocation_id"] for a in work["assignments"]]))
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"agent {agent_id} holds {len(work['assignments'])} nodes, not {args.slots}")
            await asyncio.sleep(0.2)
    log(f"{args.agents} agents hold {args.slots} nodes each")
    return placed


async def measure(url: str, server_pid: int, args: argparse.Namespace) -> list[dict[str, object]]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        agents = await setup(http, url, args)
        beating = [asyncio.create_task(keep_alive(http, url, agent_id, token)) for agent_id, token, _ in agents]
        server = psutil.Process(server_pid)
        results = []
        for route, (method, path, body) in ROUTES.items():
            calls = 0
            began = time.monotonic()
            cpu_before = sum(server.cpu_times()[:2])

            async def client(
                agent_id: int,
                token: str,
                allocations: list[int],
                method: str = method,
                path: str = path,
                body: Any = body,
                began: float = began,
            ) -> None:
                nonlocal calls
                for n in itertools.count():
                    if time.monotonic() - began >= args.seconds:
                        return
                    target = url + API + path.format(agent=agent_id, allocation=allocations[n % len(allocations)])
                    if body == "lines":  # distinct lines: every batch is stored, none is a resend
                        now = time.time()
                        lines = [{"rank": 0, "stream": "stdout", "time": now, "line": f"{n} {i}"} for i in range(5)]
                        await call(http, method, target, token, {"lines": lines})
                    else:
                        await call(http, method, target, token, body)
                    calls += 1

            await asyncio.gather(*(client(*a) for a in agents))
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
        for task in beating:
            task.cancel()
        return results


async def keep_alive(http: aiohttp.ClientSession, url: str, agent_id: int, token: str) -> None:
    """The agent's own heartbeat every 2 s, so that it is not declared lost while other routes are
    measured (0.5 heartbeats a second an agent: a small share of any route's rate)."""
    while True:
        await call(http, "POST", f"{url}{API}/agents/{agent_id}/heartbeat", token)
        await asyncio.sleep(2.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=50)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args()
    with fresh_database("phalanx_cost") as database_url, tempfile.TemporaryDirectory(prefix="phalanx-cost-") as tmp:
        group = ProcessGroup(Path(tmp) / "logs", postgres_env(database_url, Path(tmp) / "data"))
        try:
            url = start_server(group, free_port())
            group.spawn("scheduler", "scheduler")
            results = asyncio.run(measure(url, group.supervisor.children["server"].pid, args))
        finally:
            group.close()
    for result in results:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
