"""Admission: how many requests of each kind this server process works on at once.

One server process has one core's worth of Python (the GIL). When a thousand agents each start
eight nodes at once, ~20,000 node reports (rendezvous, started, logs, a bundle each) arrive within
seconds; admitted all together, every one of them runs its middleware and routing on the event
loop, and a user's `jobs list` or an agent's heartbeat queued behind all of them for tens of
seconds (`bench/bench_scale.py`: heartbeats and reads at p99 15 s, agents declared lost while
the server was busy with their own reports).

So requests wait their turn before the framework sees them, in lanes, as Kubernetes' API
Priority and Fairness does: a lane works on at most `limit` requests at once and the rest wait
in line (first come, first served; a waiting request costs no CPU). A lane's line is bounded:
past `queue` waiting, the answer is 429 with Retry-After at once, which every Phalanx client
retries with backoff. Each lane has its own limit, so a storm of one kind (node reports, a
study's ranks reporting) does not hold up the others:

- `agents`: the agents' calls (register, work without a wait, node reports, logs, environment
  locks) and the job code they download (an admin's agent list, drain and undrain are `users`);
- `ranks`: what training ranks send (metrics, checkpoints, profiles);
- `users`: everything else: the REST API, the dashboard, the CLI.

Not gated: heartbeats (answered before this, `server/api/heartbeat_path.py`; the ones that fall
through must still be answered promptly), requests held open by design (long-polls with `wait`,
the dashboard's event streams: `server/holds.py` caps those), downloads of checkpoint archives
and profiler traces (a turn held for minutes would stall a lane), and the health and metrics
endpoints a balancer or Prometheus polls.

Contract: per process and in memory, like `server/holds.py`. The lane of a request depends on
its method and path only (`lane_of`), never on who sends it: authentication happens after.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from urllib.parse import parse_qsl

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from server.security_headers import ALWAYS, CONTENT_SECURITY_POLICY

LANES = ("agents", "ranks", "users")
RETRY_AFTER_S = 1
_AGENT_PATHS = re.compile(r"/api/v1/(agents/register|agents/[0-9]+/(work|allocations/.*)|jobs/[0-9]+/bundle)")
_RANK_PATHS = re.compile(r"/api/v1/allocations/.*")
_HEARTBEAT = re.compile(r"/api/v1/agents/[0-9]+/heartbeat")
# held open by design, or as long as a large file takes to send
_LONG_GETS = re.compile(r"/(jobs/[0-9]+/events|events/jobs|studies/[0-9]+/events)|.*/(archive|trace)")
_UNGATED = frozenset({"/healthz", "/metrics"})


def lane_of(method: str, path: str, query_string: bytes) -> str | None:
    """The lane a request waits in, or None for one that is not gated (see the module)."""
    if path in _UNGATED or _HEARTBEAT.fullmatch(path) or (method == "GET" and _LONG_GETS.fullmatch(path)):
        return None
    if method == "GET" and b"wait=" in query_string and _waits(query_string):
        return None
    if _AGENT_PATHS.fullmatch(path):
        return "agents"
    if _RANK_PATHS.fullmatch(path):
        return "ranks"
    return "users"


def _waits(query_string: bytes) -> bool:
    for name, value in parse_qsl(query_string.decode("latin-1")):
        if name == "wait":
            try:
                return float(value) > 0
            except ValueError:
                return False  # the route refuses it; answering that is no long wait
    return False


@dataclass
class Lane:
    name: str
    limit: int
    queue: int
    in_progress: int = 0
    waiting: int = 0
    refused: int = 0  # since the process started
    _turns: asyncio.Semaphore | None = field(default=None, repr=False)

    def turns(self) -> asyncio.Semaphore:
        # made on first use, inside the server's event loop
        if self._turns is None:
            self._turns = asyncio.Semaphore(self.limit)
        return self._turns


class Admission:
    """The lanes of one server process."""

    def __init__(self, limit: int, queue: int) -> None:
        self.lanes = {name: Lane(name, limit, queue) for name in LANES}


class AdmissionGate:
    """ASGI middleware: each gated request waits for its lane's turn (see the module)."""

    def __init__(self, app: ASGIApp, admission: Admission) -> None:
        self.app = app
        self.admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        name = lane_of(scope["method"], scope["path"], scope.get("query_string", b""))
        if name is None:
            await self.app(scope, receive, send)
            return
        lane = self.admission.lanes[name]
        turns = lane.turns()
        if turns.locked() and lane.waiting >= lane.queue:
            lane.refused += 1
            await _refuse(send, lane)
            return
        lane.waiting += 1
        try:
            await turns.acquire()
        finally:
            lane.waiting -= 1
        lane.in_progress += 1
        try:
            await self.app(scope, receive, send)
        finally:
            lane.in_progress -= 1
            turns.release()


async def _refuse(send: Send, lane: Lane) -> None:
    body = orjson.dumps(
        {
            "error": (
                f"the server is busy: {lane.waiting} requests of its {lane.name} lane wait already "
                f"(PHALANX_ADMISSION_QUEUE); retry in {RETRY_AFTER_S} s"
            ),
            "detail": None,
        }
    )
    headers = [
        *ALWAYS,
        (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", str(RETRY_AFTER_S).encode()),
    ]
    await send({"type": "http.response.start", "status": 429, "headers": headers})
    await send({"type": "http.response.body", "body": body})
