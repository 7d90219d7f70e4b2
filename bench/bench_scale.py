"""The control plane at cluster size: simulated agents against one server and one scheduler.

    python bench/bench_scale.py [--agents 1000] [--slots 8] [--jobs 10000] [--gangs 100]
                                [--job-seconds 60] [--stationary] [--steady-seconds 60]
                                [--metrics-interval 60]
                                [--servers 1] [--heartbeat-server | --people-server [--reads-server]]
                                [--nodes-server-nice 0] [--probed-agents 50]
                                [--setting NAME=VALUE] [--json]

A fresh PostgreSQL database and Redis (the benchmarks' own database number) behind one server
process and one scheduler process, as `phalanx server` and `phalanx scheduler` run them. Everything
else is simulated in this process with asyncio, no torch:

- `--agents` agents of `--slots` CPU slots each speak the real agent protocol: register with the
  cluster's agent token (`--register-rate` a second), heartbeat every 2 s (the agents' default),
  long-poll for work; for each node they are given: rendezvous (node rank 0 of a gang), started,
  five log lines, then one metric batch every `--metrics-interval` seconds from the node's ranks
  with the attempt's own credential, and exit 0 after `--job-seconds` (±50 %). A node told to
  stop exits as stopped. With `--stationary`, the first node on each slot runs what is left of a
  node already running (`SimulatedAgent.run_time`): nodes end at the steady rate from the fill on.
  As the agent does, each agent sends its nodes' reports many in one call (what was reported
  while its last call was on its way) and its lines once a second, every allocation's in one
  call.
- The backlog: `--jobs` jobs of one slot, `--gangs` of them gangs of 2 nodes x `--slots` slots, in a
  team whose queue is held while they are submitted (8 submitters in parallel), then released at
  once; later a submitter tops the queue up to what the fill left queued, so that it never runs
  dry and as many jobs are submitted as end.
- A reader asks for the jobs list (newest 100) and one random job, alternately, 10 times a second,
  and the agents list once a second.
- The probe: a process of its own sends the heartbeats of `--probed-agents` of the agents (50 by
  default, spread evenly over them) and the reader's requests, and times them (`Probe`). A second
  process, the beater, sends every other agent's heartbeats, as each real agent heartbeats from a
  thread of its own: the simulator's one event loop, busy with every agent's nodes, runs a
  callback 100-250 ms late in the node-start storm and stalls for seconds when a minute later
  7,000 nodes send their first metric batches (its agents' heartbeats waited past the server's
  timeout, and the server declared agents lost that the probe's process kept alive). A probe that
  sent all 1,000 agents' heartbeats itself ran its own timers 50-70 ms late at p99, and every
  latency it timed included that; the beater's own timing (`heartbeat_p99_ms_in_beater`) still
  does (`beater_loop_lag_p99_ms`). The beater writes its HTTP/1.1 by hand (`BareHeartbeats`), and
  none of the simulator's processes runs full garbage collections (`CollectorPauses`): the load
  generator's own costs are the machine's, not the server's (`simulator_gc_pause_s`).
- The floor: the probe also sends a heartbeat's twin, 10 a second over 20 kept-alive connections,
  to a server of its own that answers 204 and does nothing else (`bench/floor_server.py`):
  `floor_p99_ms` is what the loaded machine adds to any call, the server's own share of a
  heartbeat's latency is what lies above it.

With `--servers N`, N server processes (replicas) share the database and Redis; agent i talks to
server i mod N, as round-robin DNS would spread them, and the admin, submitters and reader talk
to the first; `server_rss_mb` is then the largest one's. With `--heartbeat-server`, one more
replica serves the agents' heartbeats and nothing else (as a balancer's path rule would send them);
with `--people-server`, that replica serves the people's calls too (the admin, the submitters and
the reader), and the nodes' calls (work, reports, logs, metrics) have the others to themselves;
`--reads-server` with it moves the people's calls to one more replica (three pools).

Phases: register the agents, submit the backlog, release it and time the fill (allocations counted
in the database every 0.1 s until the count stops rising for 2 s or the cluster is full:
`placements_per_s` is the placements of the fill over its time, database writes included), wait
out the node-start storm (until every node the fill placed has started: `storm_s`), then
`--steady-seconds` of steady state in which jobs end and are replaced. Latencies are round trips
timed by the probe; the heartbeat's over the whole run after registration, the reader's while at
least `--jobs` jobs are stored, and both per phase (`phases`: submit, storm, steady). Database
writes, cores and completions per second are the steady state's.

Prints progress on stderr and, as its last stdout line, one JSON object (see `GOALS`).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import gc
import itertools
import json
import multiprocessing
import os
import random
import shutil
import socket
import sys
import tempfile
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, TypeVar

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import contextlib

import aiohttp
import psutil
import psycopg

from bench._common import (
    ADMIN_TOKEN,
    AGENT_TOKEN,
    BenchError,
    ProcessGroup,
    fresh_database,
    keep_logs_on_failure,
    log,
    postgres_env,
    start_server,
)
from phalanx._retry import (
    MAX_BACKOFF_S,
    METRICS_MAX_BACKOFF_S,
    backoff_delay,
    is_retryable_status,
    retry_after_s,
    retry_delay,
)
from phalanx.schemas.protocol import MAX_REPORTS_PER_CALL
from stack.supervisor import free_port

T = TypeVar("T")

API = "/api/v1"
TEAM = "scale"
HEARTBEAT_INTERVAL_S = 2.0  # the agents' default (worker_agent.agent.AgentConfig)
WORK_WAIT_S = 20.0  # the agents' long-poll, capped by the server's work_poll_seconds
READS_PER_S = 10.0
# The floor server's callers (`bench/floor_server.py`): as many kept-alive connections as this,
# each calling every heartbeat interval, as that many agents' heartbeat threads do.
FLOOR_CALLERS = 20
RECONNECTS = 2
REFUSED_RETRY_S = 120.0  # how long a call refused with 429 is sent again, as the clients' retries run
LOG_SHIP_INTERVAL_S = 1.0  # the agent's (worker_agent.agent.SHIP_INTERVAL_S)
PROGRESS_S = 10.0
SUBMITTERS = 8
QUEUED_SQL = "SELECT count(*) FROM jobs WHERE state = 'QUEUED'"
# The fill ends when the allocation count stopped rising for this long.
FILL_PLATEAU_S = 2.0
FIRST_PLACEMENT_TIMEOUT_S = 120.0
STORM_TIMEOUT_S = 300.0  # the most the steady state waits for the fill's nodes to start
GOALS = {
    "placements_per_s": (">=", 1000.0),
    "heartbeat_p99_ms": ("<=", 100.0),
    "api_p99_ms": ("<=", 150.0),
    "server_rss_mb": ("<=", 600.0),
}


class CollectorPauses:
    """The load generator's own garbage collector: full collections off, and every collection's
    pause timed. At 1,000 agents the simulator's heap holds ~550,000 tracked objects (7,000 nodes'
    tasks, their futures, coroutines and connections), and each full collection stopped its event
    loop for 1-2 s on the loaded machine (26 in a run, 25 s in all): every call delayed meanwhile
    then went at once, bursts that agents on machines of their own never send, and the servers'
    latencies carried them. Young collections still run; a cycle that lives long enough to reach
    the oldest generation stays until the process ends (one run)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.longest = 0.0
        self._began = 0.0
        gc.set_threshold(*gc.get_threshold()[:2], 1 << 30)
        gc.callbacks.append(self._timed)

    def _timed(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        pause = time.perf_counter() - self._began
        self.seconds += pause
        self.longest = max(self.longest, pause)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Tally:
    """What the simulated clients saw: latencies per route, answers that were not 2xx."""

    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    # when each latency's call ended (time.monotonic(): one clock for every process of the machine)
    ended: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    statuses: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    recording: set[str] = field(default_factory=set)  # routes whose latencies count now

    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def note(self, route: str, status: int, seconds: float) -> None:
        self.calls[route] += 1
        if route in self.recording:
            self.latencies[route].append(seconds * 1000)
            self.ended[route].append(time.monotonic())
        if status >= 300:
            self.statuses[f"{route} {status}"] += 1

    def p(self, route: str, q: float) -> float | None:
        value = percentile(self.latencies[route], q)
        return None if value is None else round(value, 1)

    def p_between(self, routes: tuple[str, ...], q: float, began: float, ended: float) -> float | None:
        """The `q` quantile of the calls of `routes` that ended between `began` and `ended`."""
        values = [
            latency
            for route in routes
            for latency, at in zip(self.latencies[route], self.ended[route], strict=True)
            if began <= at < ended
        ]
        value = percentile(values, q)
        return None if value is None else round(value, 1)


class Api:
    """One keep-alive connection pool for every simulated client; each call is timed per route."""

    def __init__(self, url: str, tally: Tally, connections: int = 0) -> None:
        """`connections`: at most this many at once (0: as many as there are calls)."""
        self.url = url
        self.tally = tally
        self.http = aiohttp.ClientSession(
            # idle connections closed before uvicorn's 5 s keep-alive closes them under a request
            connector=aiohttp.TCPConnector(limit=connections, force_close=False, keepalive_timeout=4.0),
            timeout=aiohttp.ClientTimeout(total=WORK_WAIT_S + 30),
        )

    async def call(
        self,
        route: str,
        method: str,
        path: str,
        token: str,
        *,
        expect: tuple[int, ...] = (200, 201, 204),
        max_backoff: float = MAX_BACKOFF_S,
        **kw: Any,
    ) -> Any:
        headers = {"Authorization": f"Bearer {token}"}
        started = time.perf_counter()
        refusals = 0
        while True:
            for attempt in range(RECONNECTS + 1):
                try:
                    async with self.http.request(method, self.url + API + path, headers=headers, **kw) as answer:
                        body = await answer.read()
                    break
                except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                    # a kept-alive connection the server closed as it was reused (disconnected, or
                    # reset when the close crossed the request): send again, as the agent's own
                    # client does (a report or a batch sent twice is applied once)
                    reset = isinstance(exc, aiohttp.ServerDisconnectedError) or exc.errno == errno.ECONNRESET
                    if attempt == RECONNECTS or not reset:
                        raise
            if answer.status != 429 or time.perf_counter() - started > REFUSED_RETRY_S:
                break
            # the server sheds load (429): back off, no sooner than its Retry-After, and send
            # again, as the agent's and the ranks' clients do (phalanx._retry)
            refusals += 1
            self.tally.statuses[f"{route} 429"] += 1
            await asyncio.sleep(retry_delay(refusals, retry_after_s(answer.headers.get("Retry-After")), max_backoff))
        self.tally.note(route, answer.status, time.perf_counter() - started)
        if answer.status not in expect:
            raise ApiFailed(route, answer.status, body[:300].decode(errors="replace"))
        return json.loads(body) if body else None

    async def close(self) -> None:
        await self.http.close()


class ApiFailed(RuntimeError):
    def __init__(self, route: str, status: int, text: str) -> None:
        super().__init__(f"{route}: {status} {text}")
        self.status = status


async def cancel_until_done(tasks: Sequence[asyncio.Future[None]]) -> None:
    """Cancel `tasks` (and those they spawn meanwhile into the same list) until every one ended.
    Once is not enough on Python 3.11: `asyncio.wait_for` swallows a cancellation that lands as its
    timeout fires (fixed in 3.12), and a node that went on then waited for ever on its agent's
    reporter, already cancelled (a run hung so after its steady phase)."""
    while pending := [task for task in tasks if not task.done()]:
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=1.0)
    await asyncio.gather(*tasks, return_exceptions=True)


async def reliably(
    call: Callable[[], Awaitable[T]], note: Callable[[BaseException], None], max_backoff: float = MAX_BACKOFF_S
) -> T:
    """`call` until it is answered, or refused for a reason no retry fixes (a 4xx but 408, 425 and
    429), as the agent's and the ranks' clients send a report, a log batch or a metric batch again
    (`phalanx._transport`): a simulated node that gave up on a call the server was too busy to
    answer left its attempt running on the server for ever."""
    attempt = 0
    while True:
        try:
            return await call()
        except (TimeoutError, aiohttp.ClientError, ApiFailed) as exc:
            if isinstance(exc, ApiFailed) and not is_retryable_status(exc.status):
                raise
            note(exc)
            attempt += 1
            await asyncio.sleep(backoff_delay(attempt, max_backoff))


@dataclass
class Node:
    """One node of one allocation on a simulated agent."""

    assignment: dict[str, Any]
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    rendezvous: asyncio.Event = field(default_factory=asyncio.Event)


class SimulatedAgent:
    def __init__(self, sim: Simulation, index: int) -> None:
        self.sim = sim
        self.api = sim.apis[index % len(sim.apis)]  # agents spread over the servers, as DNS would
        # its heartbeats come from the probe's process or the beater's (`Probe`)
        probed = min(sim.args.probed_agents, sim.args.agents)
        stride = max(1, sim.args.agents // max(1, probed))
        self.probed = index % stride == 0 and index // stride < probed
        self.name = f"sim-{index:05d}"
        self.agent_id = 0
        self.token = ""
        self.nodes: dict[int, Node] = {}
        self.version = ""
        # Node reports and log lines wait here for the agent's next call, as the agent's
        # NodeReporter and LogShipper keep them (worker_agent.agent)
        self.reports: list[tuple[dict[str, Any], asyncio.Future[int]]] = []
        self.reports_waiting = asyncio.Event()
        self.log_lines: dict[int, list[dict[str, Any]]] = defaultdict(list)
        self.logs_waiting = asyncio.Event()
        # with --stationary, the slots whose first node is still to start (`run_time`)
        self.first_slots_left = sim.args.slots if sim.args.stationary else 0

    def run_time(self, slots: int) -> tuple[float, float]:
        """A node's run time and the wait before its first metric batch.

        A node's run time is `--job-seconds` +-50 %. With `--stationary`, the first node on each
        slot runs what is left of a node already running, as on a cluster that has been up for a
        while: its run time is drawn length-biased (a longer node is more likely to be the one
        running) and a uniform share of it has passed, so nodes end at the steady rate (slots /
        job-seconds) from the fill on instead of all together one node's time after it, and their
        metric batches are spread over the interval instead of coming all at once."""
        low, high = 0.5 * self.sim.args.job_seconds, 1.5 * self.sim.args.job_seconds
        interval = self.sim.args.metrics_interval
        if self.first_slots_left < slots:
            return random.uniform(low, high), interval
        self.first_slots_left -= slots
        length_biased = (low**2 + random.random() * (high**2 - low**2)) ** 0.5
        return random.random() * length_biased, random.uniform(0.0, interval)

    async def register(self) -> None:
        answer = await self.api.call(
            "register",
            "POST",
            "/agents/register",
            AGENT_TOKEN,
            json={
                "name": self.name,
                "address": "127.0.0.1",
                "cpu_slots": self.sim.args.slots,
                "agent_token": self.token or None,  # proves it is this agent coming back
            },
        )
        self.agent_id, self.token = answer["id"], answer["agent_token"]

    async def report(self, body: dict[str, Any]) -> int:
        """The status of one node report, sent in the agent's next call of reports."""
        answered: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.reports.append((body, answered))
        self.reports_waiting.set()
        return await answered

    async def reporter(self) -> None:
        """Whatever the nodes reported while the last call was on its way goes in the next one."""
        while True:
            await self.reports_waiting.wait()
            taken, self.reports = self.reports[:MAX_REPORTS_PER_CALL], self.reports[MAX_REPORTS_PER_CALL:]
            if not self.reports:
                self.reports_waiting.clear()
            body = {"reports": [report for report, _ in taken]}
            try:
                answer = await reliably(
                    partial(
                        self.api.call, "reports", "POST", f"/agents/{self.agent_id}/reports", self.token, json=body
                    ),
                    partial(self.sim.note_error, "reports"),
                )
            except ApiFailed as exc:
                for _, answered in taken:
                    answered.set_exception(exc)
                continue
            for (_, answered), outcome in zip(taken, answer["results"], strict=True):
                answered.set_result(outcome["status"])

    async def shipper(self) -> None:
        """Every allocation's pending lines in one call, once a second while there are any."""
        while True:
            await self.logs_waiting.wait()
            await asyncio.sleep(LOG_SHIP_INTERVAL_S)
            self.logs_waiting.clear()
            pending, self.log_lines = self.log_lines, defaultdict(list)
            batches = [{"allocation_id": a, "lines": lines} for a, lines in pending.items()]
            for at in range(0, len(batches), MAX_REPORTS_PER_CALL):
                body = {"batches": batches[at : at + MAX_REPORTS_PER_CALL]}
                try:
                    await reliably(
                        partial(self.api.call, "logs", "POST", f"/agents/{self.agent_id}/logs", self.token, json=body),
                        partial(self.sim.note_error, "logs"),
                    )
                except ApiFailed as exc:
                    self.sim.note_error("logs", exc)

    async def work(self) -> None:
        while True:
            try:
                answer = await self.api.call(
                    "work",
                    "GET",
                    f"/agents/{self.agent_id}/work",
                    self.token,
                    # jittered as the agent jitters it (worker_agent.agent)
                    params={"version": self.version, "wait": str(WORK_WAIT_S * random.uniform(0.9, 1.0))},
                )
            except (TimeoutError, ApiFailed, aiohttp.ClientError) as exc:
                self.sim.note_error("work", exc)
                await asyncio.sleep(1.0)
                continue
            self.version = answer["version"]
            self.reconcile(answer["assignments"])

    def reconcile(self, assignments: list[dict[str, Any]]) -> None:
        seen = set()
        for a in assignments:
            key = a["allocation_id"] * 1000 + a["node_rank"]
            seen.add(key)
            node = self.nodes.get(key)
            if node is None:
                node = self.nodes[key] = Node(a)
                self.sim.spawn(self.run_node(key, node))
            node.assignment = a
            if a["master_port"] is not None:
                node.rendezvous.set()
            if a["desired"] != "run":
                node.stop.set()
        for key in set(self.nodes) - seen:  # the server forgot it: the node ended
            self.nodes.pop(key).stop.set()

    async def run_node(self, key: int, node: Node) -> None:
        a = node.assignment
        allocation, rank = a["allocation_id"], a["node_rank"]
        try:
            # 409: the attempt ended meanwhile (its agent was declared lost, a peer failed): the
            # agent stops the node, as the real one does
            if a["nnodes"] == 1:
                pass  # a one-node job meets on its own host: no rendezvous (worker_agent.agent)
            elif rank == 0:
                await self.report({"kind": "rendezvous", "allocation_id": allocation, "master_port": 29500})
            elif not await wait_or_stop(node.rendezvous, node.stop):
                return
            if await self.report({"kind": "started", "allocation_id": allocation, "node_rank": rank}) != 204:
                return  # 409: the attempt ended meanwhile; the agent stops the node
            self.log_lines[allocation] += [
                {"rank": rank, "stream": "stdout", "time": time.time(), "line": f"step {i}"} for i in range(5)
            ]
            self.logs_waiting.set()
            stopped = await self.train(node, *self.run_time(a["nproc_per_node"]))
            cause = "stopped" if stopped else "run"
            await self.report(
                {"kind": "exit", "allocation_id": allocation, "node_rank": rank, "exit_code": 0, "cause": cause}
            )
            if not stopped:
                self.sim.completed_nodes += 1
        except (TimeoutError, ApiFailed, aiohttp.ClientError) as exc:
            self.sim.note_error("node", exc)
        finally:
            self.nodes.pop(key, None)

    async def train(self, node: Node, seconds: float, first_metrics_s: float) -> bool:
        """Report metrics from the node's ranks, the first batch after `first_metrics_s`, then every
        `--metrics-interval`, until `seconds` passed (False) or it was told to stop (True)."""
        a = node.assignment
        credential = a["credential"]
        ranks = range(a["node_rank"] * a["nproc_per_node"], (a["node_rank"] + 1) * a["nproc_per_node"])
        deadline = time.monotonic() + seconds
        step = 0
        next_batch_s = first_metrics_s
        while True:
            wait = min(next_batch_s, deadline - time.monotonic())
            next_batch_s = self.sim.args.metrics_interval
            if wait <= 0:
                return False
            try:
                await asyncio.wait_for(node.stop.wait(), wait)
                return True
            except TimeoutError:
                pass
            step += 10
            now = time.time()
            records = [{"rank": r, "step": step, "time": now, "values": {"loss": 1.0 / step}} for r in ranks]
            await reliably(
                partial(
                    self.api.call,
                    "metrics",
                    "POST",
                    f"/allocations/{a['allocation_id']}/metrics",
                    credential,
                    json={"records": records},
                    expect=(200, 204, 409),
                    max_backoff=METRICS_MAX_BACKOFF_S,
                ),
                partial(self.sim.note_error, "metrics"),
                METRICS_MAX_BACKOFF_S,
            )


async def wait_or_stop(ready: asyncio.Event, stop: asyncio.Event) -> bool:
    """Until `ready` (True) or `stop` (False) is set."""
    waits = [asyncio.create_task(ready.wait()), asyncio.create_task(stop.wait())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()
    return ready.is_set()


class Probe:
    """Times what the goals time from a process of its own: the heartbeats of the probed agents
    (`--probed-agents`), and the reads (the jobs list and one random job alternately, 10 a second;
    the agents list once a second). The simulator's one event loop runs a thousand agents and
    seven thousand nodes, and during the node-start storm it runs a ready callback 100-250 ms
    late: every latency it times includes that. The probe's loop does nothing else. The load is
    the same either way: every agent heartbeats, and the reads are the reader's. An agent the
    server declares lost is counted, not registered again."""

    def __init__(self, url: str, beats_url: str, floor_url: str | None, commands: Connection) -> None:
        """`floor_url`: None in the beater, which sends heartbeats and nothing else."""
        self.url, self.beats_url, self.floor_url, self.commands = url, beats_url, floor_url, commands
        self.tally = Tally()
        self.tally.recording |= {"heartbeat", "floor", "probe loop lag"}
        self.errors: dict[str, int] = defaultdict(int)
        self.lost: set[int] = set()  # agents whose heartbeat was answered 409: declared lost
        self.newest_job = 1

    async def run(self) -> None:
        self.api = Api(self.url, self.tally)
        tasks = [asyncio.create_task(self.loop_lag())]
        if self.floor_url is not None:
            tasks += [asyncio.create_task(self.floor(i)) for i in range(FLOOR_CALLERS)]
        while True:
            command = await asyncio.get_running_loop().run_in_executor(None, self.commands.recv)
            if command[0] == "agent":
                tasks.append(asyncio.create_task(self.heartbeats(command[1], command[2])))
            elif command[0] == "reads":
                self.newest_job = max(1, command[1])
                self.tally.recording |= {"jobs list", "job show", "agents list"}
                tasks += [asyncio.create_task(self.reader()), asyncio.create_task(self.agents_reader())]
            else:
                break
        await cancel_until_done(tasks)
        await self.api.close()
        tally = self.tally
        answer = (dict(tally.latencies), dict(tally.ended), dict(tally.statuses), dict(self.errors), len(self.lost))
        self.commands.send(answer)

    def note_error(self, where: str, exc: BaseException) -> None:
        self.errors[f"{where}: {type(exc).__name__}"] += 1

    async def heartbeats(self, agent_id: int, token: str) -> None:
        await self.beat("heartbeat", self.beats_url, agent_id, token)

    async def floor(self, caller: int) -> None:
        """A heartbeat's twin sent to the floor server, which answers it without doing anything."""
        assert self.floor_url is not None
        await asyncio.sleep(caller * HEARTBEAT_INTERVAL_S / FLOOR_CALLERS)  # spread, as the agents' beats are
        await self.beat("floor", self.floor_url, caller + 1, "floor")

    async def beat(self, route: str, url: str, agent_id: int, token: str) -> None:
        """Agent `agent_id`'s heartbeat to `url` every interval, timed as `route`, on a connection of
        its own kept alive between beats, as a real agent's heartbeat thread keeps one: drawn from a
        pool that every agent shares, a beat opened a new connection whenever the others' were
        busy, and waited with it in the server's listen queue. The beater sends its agents' beats
        with `BareHeartbeats`, not aiohttp (see there); the probe times its own with aiohttp."""
        beats: Api | BareHeartbeats = (
            BareHeartbeats(url, self.tally) if self.floor_url is None else Api(url, self.tally, connections=1)
        )
        try:
            while True:
                began = time.monotonic()
                try:
                    await beats.call(route, "POST", f"/agents/{agent_id}/heartbeat", token)
                except (TimeoutError, ApiFailed, aiohttp.ClientError, OSError, asyncio.IncompleteReadError) as exc:
                    self.note_error(route, exc)  # a 409 (declared lost) is counted, not re-registered
                    if isinstance(exc, ApiFailed) and exc.status == 409:
                        self.lost.add(agent_id)
                await asyncio.sleep(max(0.0, HEARTBEAT_INTERVAL_S - (time.monotonic() - began)))
        finally:
            await beats.close()

    async def reader(self) -> None:
        tick = 0
        while True:
            tick += 1
            try:
                if tick % 2:
                    await self.api.call("jobs list", "GET", "/jobs", ADMIN_TOKEN, params={"limit": "100"})
                else:
                    job_id = random.randint(1, self.newest_job)
                    await self.api.call("job show", "GET", f"/jobs/{job_id}", ADMIN_TOKEN)
            except (TimeoutError, ApiFailed, aiohttp.ClientError) as exc:
                self.note_error("reader", exc)
            await asyncio.sleep(1 / READS_PER_S)

    async def agents_reader(self) -> None:
        while True:
            try:
                await self.api.call("agents list", "GET", "/agents", ADMIN_TOKEN)
            except (TimeoutError, ApiFailed, aiohttp.ClientError) as exc:
                self.note_error("reader", exc)
            await asyncio.sleep(1.0)

    async def loop_lag(self) -> None:
        while True:
            began = time.perf_counter()
            await asyncio.sleep(0.05)
            self.tally.note("probe loop lag", 200, max(0.0, time.perf_counter() - began - 0.05))


class BareHeartbeats:
    """One agent's heartbeats over one kept-alive HTTP/1.1 connection, written and parsed by hand:
    with the beater's 950 agents' beats through aiohttp, the probe's and the beater's processes
    took ~0.17 of the machine's 2 cores, ~0.12 with this: load that real agents put on their own
    machines, not the server's. The same requests and answers as `Api.call` for a heartbeat: a connection the server
    closed is opened again and the beat sent again, any other status is `ApiFailed`."""

    def __init__(self, url: str, tally: Tally) -> None:
        host, _, port = url.removeprefix("http://").partition(":")
        self.host, self.port, self.tally = host, int(port), tally
        self.streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def call(self, route: str, method: str, path: str, token: str) -> None:
        request = (
            f"{method} {API}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Authorization: Bearer {token}\r\nContent-Length: 0\r\n\r\n"
        ).encode()
        started = time.perf_counter()
        for attempt in range(RECONNECTS + 1):
            try:
                if self.streams is None:
                    self.streams = await asyncio.open_connection(self.host, self.port)
                reader, writer = self.streams
                writer.write(request)
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WORK_WAIT_S + 30)
                status, length, closes = _parse_head(head)
                body = await reader.readexactly(length) if length else b""
                if closes:
                    await self.close()
                break
            except (ConnectionError, asyncio.IncompleteReadError):
                # closed by the server between beats (its keep-alive), or reset as it closed: again
                await self.close()
                if attempt == RECONNECTS:
                    raise
            except BaseException:
                await self.close()  # a cancelled or timed-out beat leaves an answer unread behind it
                raise
        self.tally.note(route, status, time.perf_counter() - started)
        if status != 204:
            raise ApiFailed(route, status, body[:300].decode(errors="replace"))

    async def close(self) -> None:
        if self.streams is not None:
            writer = self.streams[1]
            self.streams = None
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


def _parse_head(head: bytes) -> tuple[int, int, bool]:
    """The status, the body's length and whether the server closes the connection after it."""
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    length, closes = 0, False
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"connection":
            closes = value.strip().lower() == b"close"
    return status, length, closes


def _run_probe(url: str, beats_url: str, floor_url: str | None, commands: Connection) -> None:
    CollectorPauses()
    asyncio.run(Probe(url, beats_url, floor_url, commands).run())


class ProbeProcess:
    """The simulator's side of the probe: agents to heartbeat, when reads begin, and at the end its
    latencies."""

    def __init__(self, url: str, beats_url: str, floor_url: str | None) -> None:
        context = multiprocessing.get_context("spawn")  # not a fork of a process with a running loop
        self._commands, theirs = context.Pipe()
        self._process = context.Process(target=_run_probe, args=(url, beats_url, floor_url, theirs), daemon=True)
        self.errors: dict[str, int] = {}
        self.lost = 0  # agents whose heartbeats the probe sent that were declared lost

    def start(self) -> None:
        self._process.start()

    def send(self, command: tuple[Any, ...]) -> None:
        self._commands.send(command)

    async def results(self) -> Tally:
        self.send(("stop",))
        answer = await asyncio.get_running_loop().run_in_executor(None, self._commands.recv)
        latencies, ended, statuses, self.errors, self.lost = answer
        self._process.join(timeout=30)
        tally = Tally()
        tally.latencies.update(latencies)
        tally.ended.update(ended)
        tally.statuses.update(statuses)
        return tally


class Simulation:
    def __init__(
        self,
        args: argparse.Namespace,
        urls: list[str],
        database_url: str,
        pids: Callable[[], dict[str, int]],
        floor_url: str,
        heartbeat_url: str | None = None,
        reads_url: str | None = None,
    ) -> None:
        self.args = args
        self.tally = Tally()
        self.apis = [Api(url, self.tally) for url in urls]
        self.heartbeat_api = None if heartbeat_url is None else Api(heartbeat_url, self.tally)
        people_url = reads_url or (heartbeat_url if args.people_server and heartbeat_url else urls[0])
        self.probe = ProbeProcess(people_url, heartbeat_url or urls[0], floor_url)
        self.beater = ProbeProcess(people_url, heartbeat_url or urls[0], None)
        # the admin's, the submitters' and the reader's
        self.api = self.heartbeat_api if args.people_server and self.heartbeat_api else self.apis[0]
        self.reads_api = None if reads_url is None else Api(reads_url, self.tally)
        if self.reads_api is not None:
            self.api = self.reads_api
        self.dsn = database_url.replace("postgresql+psycopg://", "postgresql://")
        self.pids = pids
        self.agents = [SimulatedAgent(self, i) for i in range(args.agents)]
        self.tasks: list[asyncio.Task[None]] = []
        self.errors: dict[str, int] = defaultdict(int)
        self.error_examples: dict[str, str] = {}
        self.completed_nodes = 0
        self.submitted = 0
        self.rss_mb = 0.0
        self.released_at = 0.0  # time.monotonic() when the backlog was released
        self.stored_jobs = 0

    def note_error(self, where: str, exc: BaseException) -> None:
        key = f"{where}: {type(exc).__name__}"
        self.errors[key] += 1
        self.error_examples.setdefault(key, str(exc)[:300])

    def spawn(self, coroutine: Awaitable[None]) -> None:
        self.tasks.append(asyncio.ensure_future(coroutine))

    async def admin(self, method: str, path: str, **kw: Any) -> Any:
        return await self.api.call("admin", method, path, ADMIN_TOKEN, **kw)

    async def register_agents(self) -> float:
        """Agents come up at `--register-rate` a second, each heartbeating and long-polling from
        its registration on, as a cluster's agents do when their machines start."""
        began = time.monotonic()

        async def one(agent: SimulatedAgent) -> None:
            await agent.register()
            (self.probe if agent.probed else self.beater).send(("agent", agent.agent_id, agent.token))
            self.spawn(agent.work())
            self.spawn(agent.reporter())
            self.spawn(agent.shipper())

        starting = []
        for i, agent in enumerate(self.agents):
            await asyncio.sleep(max(0.0, began + i / self.args.register_rate - time.monotonic()))
            starting.append(asyncio.ensure_future(one(agent)))
        await asyncio.gather(*starting)
        return time.monotonic() - began

    def job_spec(self, index: int, gang: bool) -> str:
        nodes, slots = (2, self.args.slots) if gang else (1, 1)
        return json.dumps(
            {
                "name": f"scale-{index}",
                "team": TEAM,
                "entrypoint": "python train.py",
                "resources": {"nodes": nodes, "slots_per_node": slots, "slot_type": "cpu"},
            }
        )

    async def submit(self, count: int, gangs: int) -> float:
        """Submit `count` jobs, `gangs` of them gangs spread evenly; returns the seconds it took."""
        began = time.monotonic()
        every = max(1, count // gangs) if gangs else 0
        numbers = itertools.count(self.submitted)
        remaining = iter(range(count))

        async def submitter() -> None:
            for i in remaining:
                form = aiohttp.FormData()
                form.add_field("spec", self.job_spec(next(numbers), bool(every) and i % every == every - 1))
                await self.api.call("submit", "POST", "/jobs", ADMIN_TOKEN, data=form)
                self.submitted += 1
                if self.submitted % 2000 == 0:
                    log(f"submitted {self.submitted} jobs")

        await asyncio.gather(*(submitter() for _ in range(SUBMITTERS)))
        return time.monotonic() - began

    async def count(self, sql: str) -> int:
        async with await psycopg.AsyncConnection.connect(self.dsn) as conn:
            row = await (await conn.execute(sql)).fetchone()
            return int(row[0]) if row else 0

    async def fill(self) -> dict[str, float]:
        """Release the held backlog; time the scheduler until it stops placing."""
        capacity = self.args.agents * self.args.slots
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:

            async def placed() -> int:
                row = await (await conn.execute("SELECT count(*) FROM allocations")).fetchone()
                return int(row[0]) if row else 0

            async def slots_held() -> int:
                row = await (await conn.execute("SELECT count(*) FROM slot_leases")).fetchone()
                return int(row[0]) if row else 0

            before = await placed()
            released = self.released_at = time.monotonic()
            await self.admin("POST", f"/teams/{TEAM}/release")
            last, last_rise, peak_held = before, released, 0
            while True:
                await asyncio.sleep(0.1)
                now_count = await placed()
                if now_count > last:
                    last, last_rise = now_count, time.monotonic()
                peak_held = max(peak_held, await slots_held())
                if peak_held >= capacity or (last > before and time.monotonic() - last_rise > FILL_PLATEAU_S):
                    break
                if time.monotonic() - released > FIRST_PLACEMENT_TIMEOUT_S and last == before:
                    raise BenchError(f"nothing was placed within {FIRST_PLACEMENT_TIMEOUT_S:.0f} s of the release")
            # the slots can fill between the two counts of one poll: count the attempts once more
            final = await placed()
            if final > last:
                last, last_rise = final, time.monotonic()
            log(f"fill: {last - before} attempts placed, {peak_held} slots held, {last_rise - released:.2f} s")
            seconds = last_rise - released
        placements = last - before
        return {
            "placements": placements,
            "fill_s": round(seconds, 2),
            "placements_per_s": round(placements / seconds, 1),
            "peak_slots_held": peak_held,
            "slots": capacity,
        }

    async def storm(self) -> tuple[float, int]:
        """Seconds from the fill's end until every node the fill placed has started (its agent
        reported it), at most `STORM_TIMEOUT_S`: the node-start storm of a cluster filled at once;
        and how many of its nodes had not started by then."""
        began = time.monotonic()
        unstarted = 0
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
            row = await (await conn.execute("SELECT coalesce(max(id), 0) FROM allocations")).fetchone()
            last_placed = int(row[0]) if row else 0
            while time.monotonic() - began < STORM_TIMEOUT_S:
                row = await (
                    await conn.execute(
                        "SELECT count(*) FROM allocation_nodes n JOIN allocations a ON a.id = n.allocation_id "
                        "WHERE a.id <= %s AND a.active AND n.started_at IS NULL",
                        (last_placed,),
                    )
                ).fetchone()
                unstarted = int(row[0]) if row else 0
                if unstarted == 0:
                    break
                await asyncio.sleep(0.5)
        return time.monotonic() - began, unstarted

    async def keep_backlog(self, stop: asyncio.Event) -> None:
        """Every few seconds, top the queue up to what the fill left queued: as many jobs are
        submitted as end, as in a cluster's steady state. (Topping it up to `--jobs` made the steady
        state a second backlog's submission: ~7,000 submits at the people's process's full rate,
        each waking a scheduling pass that read the whole queue.)"""
        target = await self.count(QUEUED_SQL)
        while not stop.is_set():
            queued = await self.count(QUEUED_SQL)
            if queued < target:
                try:
                    await self.submit(min(target - queued, 200), 0)
                except (TimeoutError, ApiFailed, aiohttp.ClientError) as exc:
                    self.note_error("submit", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 3.0)

    async def progress(self, stop: asyncio.Event) -> None:
        """Every 10 s on stderr: the calls sent, active agents, attempts running, jobs submitted."""
        calls_before: dict[str, int] = {}
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), PROGRESS_S)
            active = await self.count("SELECT count(*) FROM agents WHERE state = 'ACTIVE'")
            running = await self.count("SELECT count(*) FROM allocations WHERE active")
            calls = {k: v - calls_before.get(k, 0) for k, v in self.tally.calls.items()}
            calls_before = dict(self.tally.calls)
            log(f"calls in the last {PROGRESS_S:.0f} s: {calls}")
            log(
                f"{active} agents active; {running} attempts running; {self.submitted} jobs submitted; "
                f"errors {dict(self.errors)}"
            )

    async def watch_rss(self, stop: asyncio.Event) -> None:
        servers = [psutil.Process(pid) for name, pid in self.pids().items() if name.startswith("server")]
        while not stop.is_set():
            self.rss_mb = max(self.rss_mb, *(server.memory_info().rss / 2**20 for server in servers))
            await asyncio.sleep(0.5)

    async def database_writes(self) -> tuple[int, int]:
        """(commits, rows inserted + updated + deleted) of the bench's database so far."""
        async with await psycopg.AsyncConnection.connect(self.dsn) as conn:
            row = await (
                await conn.execute(
                    "SELECT xact_commit, tup_inserted + tup_updated + tup_deleted FROM pg_stat_database "
                    "WHERE datname = current_database()"
                )
            ).fetchone()
        assert row is not None
        return int(row[0]), int(row[1])

    async def run(self) -> dict[str, Any]:
        args = self.args
        await self.admin("POST", "/teams", json={"name": TEAM})
        await self.admin("POST", f"/teams/{TEAM}/hold")
        self.probe.start()
        self.beater.start()
        registered_s = await self.register_agents()
        log(f"{args.agents} agents registered in {registered_s:.1f} s")
        self.tally.recording |= {"simulator loop lag"}
        stop = asyncio.Event()
        self.spawn(self.watch_rss(stop))
        self.spawn(self.watch_loop_lag(stop))
        self.spawn(self.progress(stop))
        submit_began = time.monotonic()
        submit_s = await self.submit(args.jobs, args.gangs)
        log(f"{args.jobs} jobs submitted in {submit_s:.1f} s ({args.jobs / submit_s:.0f}/s)")
        self.probe.send(("reads", self.submitted))
        fill = await self.fill()
        log(f"fill: {fill}")
        self.spawn(self.keep_backlog(stop))
        storm_s, unstarted = await self.storm()
        if unstarted:
            log(f"{unstarted} nodes the fill placed had not started {storm_s:.1f} s after the fill")
        else:
            log(f"every node the fill placed started {storm_s:.1f} s after the fill")
        storm_ended = time.monotonic()
        cpu_before = self.cpu_seconds()
        commits_before, rows_before = await self.database_writes()
        steady_began = time.monotonic()
        completed_before = self.completed_nodes
        await asyncio.sleep(args.steady_seconds)
        steady_s = time.monotonic() - steady_began
        commits_after, rows_after = await self.database_writes()
        cpu_after = self.cpu_seconds()
        stop.set()
        self.stored_jobs = await self.count("SELECT count(*) FROM jobs")
        died = self.tasks_died()
        await cancel_until_done(self.tasks)
        for api in [*self.apis, *(api for api in (self.heartbeat_api, self.reads_api) if api is not None)]:
            await api.close()
        probed = await self.probe.results()
        beaten = await self.beater.results()
        for process, tally in ((self.probe, probed), (self.beater, beaten)):
            for name, count in tally.statuses.items():
                self.tally.statuses[name] += count
            for name, count in process.errors.items():
                self.errors[name] += count
        heartbeats = len(beaten.latencies["heartbeat"]) + len(probed.latencies["heartbeat"])
        reads = probed.latencies["jobs list"] + probed.latencies["job show"]
        steady_ended = time.monotonic()
        phases = {
            # the backlog's submission: the agents heartbeat and long-poll, nothing runs yet
            "submit": (submit_began, submit_began + submit_s),
            # the release: the fill, then every agent starting its nodes at once
            "storm": (self.released_at, storm_ended),
            "steady": (storm_ended, steady_ended),  # jobs end and others start in their place
        }
        return {
            "bench": "scale",
            "agents": args.agents,
            "servers": args.servers,
            "heartbeat_server": args.heartbeat_server,
            "people_server": args.people_server,
            "job_seconds": args.job_seconds,
            "stationary": args.stationary,
            "reads_server": args.reads_server,
            "nodes_server_nice": args.nodes_server_nice,
            "slots_per_agent": args.slots,
            "jobs_stored": self.stored_jobs,
            "register_s": round(registered_s, 1),
            "submit_per_s": round(args.jobs / submit_s, 1),
            **fill,
            "heartbeats": heartbeats,
            "agents_declared_lost": self.probe.lost + self.beater.lost,
            # timed by the probe's process (`Probe`), the `--probed-agents` agents' heartbeats
            "heartbeat_p50_ms": probed.p("heartbeat", 0.5),
            "heartbeat_p99_ms": probed.p("heartbeat", 0.99),
            # one beat later than the server's timeout (10 s) and its agent is declared lost
            "heartbeat_max_ms": probed.p("heartbeat", 1.0),
            # the other agents' heartbeats, timed by the beater, whose loop's lag they include
            "heartbeat_p99_ms_in_beater": beaten.p("heartbeat", 0.99),
            "beater_loop_lag_p99_ms": beaten.p("probe loop lag", 0.99),
            # the same call answered by a server that does nothing (`bench/floor_server.py`): what
            # the machine, as loaded, adds to any call; a heartbeat's time above it is the server's
            "floor_p50_ms": probed.p("floor", 0.5),
            "floor_p99_ms": probed.p("floor", 0.99),
            # how late each process's event loop ran a 50 ms timer: part of every latency it times
            "simulator_loop_lag_p99_ms": self.tally.p("simulator loop lag", 0.99),
            "probe_loop_lag_p99_ms": probed.p("probe loop lag", 0.99),
            "api_p50_ms": None if not reads else round(percentile(reads, 0.5) or 0, 1),
            "api_p99_ms": None if not reads else round(percentile(reads, 0.99) or 0, 1),
            "jobs_list_p99_ms": probed.p("jobs list", 0.99),
            "job_show_p99_ms": probed.p("job show", 0.99),
            "agents_list_p99_ms": probed.p("agents list", 0.99),
            "phases": {
                name: {
                    "s": round(ended - began, 1),
                    "heartbeat_p50_ms": probed.p_between(("heartbeat",), 0.5, began, ended),
                    "heartbeat_p99_ms": probed.p_between(("heartbeat",), 0.99, began, ended),
                    "floor_p99_ms": probed.p_between(("floor",), 0.99, began, ended),
                    "api_p50_ms": probed.p_between(("jobs list", "job show"), 0.5, began, ended),
                    "api_p99_ms": probed.p_between(("jobs list", "job show"), 0.99, began, ended),
                }
                for name, (began, ended) in phases.items()
            },
            "server_rss_mb": round(self.rss_mb, 1),
            "storm_s": round(storm_s, 1),
            "storm_nodes_unstarted": unstarted,  # nodes of the fill not started when the storm was cut off
            "steady_s": round(steady_s, 1),
            "db_commits_per_s": round((commits_after - commits_before) / steady_s, 1),
            "db_rows_written_per_s": round((rows_after - rows_before) / steady_s, 1),
            "nodes_completed_per_s": round((self.completed_nodes - completed_before) / steady_s, 2),
            # cores busy on average over the steady state, of the machine's 2 (`machine`: all of them)
            "cores_busy_steady": {
                name: round((cpu_after.get(name, 0) - cpu_before.get(name, 0)) / steady_s, 2) for name in cpu_after
            },
            # a simulated agent's task that ended on an error it did not expect: its agent stopped
            # reporting, and the run measured fewer agents than it says (the first one's traceback
            # is logged)
            "simulator_tasks_died": died,
            "non_2xx": dict(self.tally.statuses),
            "client_errors": dict(self.errors),
            "client_error_examples": self.error_examples,
        }

    def tasks_died(self) -> dict[str, int]:
        """The simulator's tasks that ended on an exception before the run's end, by its type."""
        died: Counter[str] = Counter()
        for task in self.tasks:
            if task.done() and not task.cancelled() and (exc := task.exception()) is not None:
                if not died:
                    log("a simulated agent's task died: " + "".join(traceback.format_exception(exc)))
                died[type(exc).__name__] += 1
        return dict(died)

    async def watch_loop_lag(self, stop: asyncio.Event) -> None:
        """How late a 50 ms sleep of this process wakes: the simulator's own share of the latencies."""
        while not stop.is_set():
            began = time.perf_counter()
            await asyncio.sleep(0.05)
            self.tally.note("simulator loop lag", 200, max(0.0, time.perf_counter() - began - 0.05))

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds so far of the server, the scheduler and this simulator, and of the whole
        machine: what is left is PostgreSQL's, Redis's and anything else running."""
        totals: dict[str, float] = {}
        roots = [(name.rstrip("0123456789"), pid) for name, pid in self.pids().items()]
        roots.append(("simulator", os.getpid()))
        for name, pid in roots:
            if name not in ("server", "server-heartbeats", "server-people", "scheduler", "simulator", "floor"):
                continue
            try:
                t = psutil.Process(pid).cpu_times()
            except psutil.Error:
                continue
            totals[name] = totals.get(name, 0.0) + t.user + t.system
        machine = psutil.cpu_times()
        totals["machine"] = machine.user + machine.system + machine.nice + getattr(machine, "softirq", 0.0)
        return totals


def met(result: dict[str, Any]) -> dict[str, bool]:
    verdicts = {}
    for key, (op, goal) in GOALS.items():
        value = result.get(key)
        verdicts[key] = value is not None and (value >= goal if op == ">=" else value <= goal)
    return verdicts


def renice(pid: int, niceness: int) -> None:
    """`pid` and its children at `niceness`, as a deployment would give the nodes' pool a smaller
    share of a machine it shares with the people's pool (compose's `cpu_shares`)."""
    process = psutil.Process(pid)
    for each in (process, *process.children(recursive=True)):
        each.nice(niceness)


def start_floor_server(group: ProcessGroup, port: int) -> str:
    url = f"http://127.0.0.1:{port}"
    script = Path(__file__).with_name("floor_server.py")
    group.supervisor.spawn("floor", [sys.executable, str(script), "--port", str(port)])

    def answers() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return True
        except OSError:
            return False

    group.wait_until(answers, 60, f"the floor server to answer on {url}")
    return url


def run(args: argparse.Namespace) -> dict[str, Any]:
    with fresh_database("phalanx_scale") as database_url, tempfile.TemporaryDirectory(prefix="phalanx-scale-") as tmp:
        # one work long-poll per agent is held open, beside the reader's requests
        settings = {"PHALANX_MAX_HELD_REQUESTS": str(args.agents + 256)}
        if args.worker_threads is not None:
            settings["PHALANX_WORKER_THREADS"] = str(args.worker_threads)
        for setting in args.setting:
            name, _, value = setting.partition("=")
            settings[f"PHALANX_{name.upper()}"] = value
        env = postgres_env(database_url, Path(tmp) / "data", **settings)
        group = ProcessGroup(Path(tmp) / "logs", env)
        with keep_logs_on_failure(group.logs):
            try:
                urls = [start_server(group, free_port(), f"server{i or ''}") for i in range(args.servers)]
                beats = (
                    start_server(group, free_port(), "server-heartbeats")
                    if args.heartbeat_server or args.people_server
                    else None
                )
                reads = start_server(group, free_port(), "server-people") if args.reads_server else None
                group.spawn("scheduler", "scheduler")
                floor = start_floor_server(group, free_port())
                if args.nodes_server_nice:
                    for i in range(args.servers):
                        renice(group.supervisor.children[f"server{i or ''}"].pid, args.nodes_server_nice)

                def pids() -> dict[str, int]:
                    return {name: popen.pid for name, popen in group.supervisor.children.items()}

                async def simulate() -> dict[str, Any]:  # aiohttp binds to the running loop
                    return await Simulation(args, urls, database_url, pids, floor, beats, reads).run()

                collector = CollectorPauses()
                result = asyncio.run(simulate())
                result["simulator_gc_pause_s"] = round(collector.seconds, 2)
                result["simulator_gc_longest_ms"] = round(collector.longest * 1000, 1)
                group.check()
            finally:
                group.close()
                if args.keep_logs:
                    shutil.copytree(group.logs, args.keep_logs, dirs_exist_ok=True)
    result["goals"] = {k: f"{op} {goal:g}" for k, (op, goal) in GOALS.items()}
    result["met"] = met(result)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=1000)
    parser.add_argument("--slots", type=int, default=8, help="CPU slots per agent")
    parser.add_argument("--register-rate", type=float, default=100.0, help="agents registering per second")
    parser.add_argument("--jobs", type=int, default=10_000, help="the backlog of queued jobs")
    parser.add_argument("--gangs", type=int, default=100, help="of the backlog: gangs of 2 nodes x all slots")
    parser.add_argument("--job-seconds", type=float, default=60.0, help="a node's run time (+-50%%)")
    parser.add_argument("--steady-seconds", type=float, default=60.0)
    parser.add_argument(
        "--stationary",
        action="store_true",
        help="the fill's nodes run what is left of nodes already running, so that nodes end at the steady rate "
        "(slots / job-seconds) from the fill on, not all at once one node's time after it",
    )
    parser.add_argument(
        "--metrics-interval", type=float, default=60.0, help="seconds between a node's metric batches (real ranks: 1 s)"
    )
    parser.add_argument(
        "--worker-threads", type=int, default=None, help="the server's PHALANX_WORKER_THREADS (default: its own)"
    )
    parser.add_argument(
        "--setting",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a setting of the server and scheduler (PHALANX_<NAME>), e.g. max_node_calls_in_flight=256",
    )
    parser.add_argument(
        "--servers", type=int, default=1, help="server processes (replicas); the agents are spread over them"
    )
    parser.add_argument(
        "--heartbeat-server",
        action="store_true",
        help="one more replica that serves every agent's heartbeats and nothing else, as a balancer's path rule would",
    )
    parser.add_argument(
        "--people-server",
        action="store_true",
        help="as --heartbeat-server, and that replica serves the people's calls too (the admin, the submitters, "
        "the reader): the nodes' calls alone on the others",
    )
    parser.add_argument(
        "--reads-server",
        action="store_true",
        help="with --people-server: one more replica for the people's calls (the admin, the submitters, the reader), "
        "so that the --people-server replica serves the agents' heartbeats alone: three pools",
    )
    parser.add_argument(
        "--nodes-server-nice",
        type=int,
        default=0,
        help="the niceness of the server processes that take the nodes' calls (with --people-server: all but "
        "the people's), e.g. 5: the people's process gets the CPU first when the machine is saturated",
    )
    parser.add_argument(
        "--probed-agents",
        type=int,
        default=50,
        help="of the agents, how many heartbeat from the probe's process, which times them; the others from the "
        "beater's (a process of its own, as each real agent heartbeats from a thread of its own)",
    )
    parser.add_argument(
        "--keep-logs", type=Path, default=None, help="copy the stack's logs into this folder at the end"
    )
    parser.add_argument("--json", action="store_true", help="only the JSON line on stdout (it is always the last)")
    args = parser.parse_args()
    result = run(args)
    if not args.json:
        for key in GOALS:
            log(f"{key}: {result.get(key)} (goal {result['goals'][key]}, {'met' if result['met'][key] else 'missed'})")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
