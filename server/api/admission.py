"""The nodes' reports, output lines and metric batches refused at the door while too many are
already in the server.

A cluster that fills or drains at once, or comes back after the server was unreachable, sends
thousands of these together, and every client sends again what timed out. Each one admitted cost
the event loop its parsing, routing and dependencies before it waited its turn on the agents'
threads (`deps.in_agent_thread`): past what those threads could store, calls queued for tens of
seconds, timed out at their clients, came back, and crowded the heartbeats out of the event loop
until the reaper declared live agents lost (`bench/bench_scale.py`, RESULTS.md "Eighth session").
Refused here, a call costs a fraction of that and comes back after its client's backoff: every
client of the server retries a 429 (`phalanx._retry`), and every one of these calls is stored once
however often it is sent (batch ids, report outcomes).

Contract: while `limit` calls of agents and ranks wait for or run on the agents' threads (counted
by `in_agent_thread` and `MetricWriter.store` in `AgentBacklog`), one more of these is answered 429
with a `Retry-After` and changes nothing; lines and metric batches already past `BULK_SHARE` of
`limit`, so that node reports (starts, exits) still go through while telemetry waits. A call
still sending its body, or still being authenticated, is not counted: counted from the door, as
many clients as the limit, sending their bodies slowly on purpose, kept every node's calls out.
Heartbeats, registration, the work long-poll, checkpoints and every person's request are never
refused here. One per server process, used from its event loop.
"""

from __future__ import annotations

import json
import re

from starlette.types import ASGIApp, Receive, Scope, Send

from server.security_headers import ALWAYS, CONTENT_SECURITY_POLICY

# POSTs of an agent's node reports (many in one call, or one node's): what moves nodes and jobs
LIFECYCLE = re.compile(r"/api/v1/agents/[0-9]{1,10}/(?:reports|allocations/[0-9]{1,10}/(?:rendezvous|started|exit))")
# POSTs of a node's output lines (an agent's, or one allocation's) and of a rank's metric batch
BULK = re.compile(
    r"/api/v1/(?:agents/[0-9]{1,10}/(?:logs|allocations/[0-9]{1,10}/logs)|allocations/[0-9]{1,10}/metrics)"
)
SHEDDABLE = re.compile(f"{LIFECYCLE.pattern}|{BULK.pattern}")
# Lines and metrics are refused once this share of the limit is in: the rest is kept for the node
# reports. Shared alike, a node's start reported in a storm of metric batches was refused again
# and again, each time after a longer backoff, and the node-start storm lasted minutes where it
# took 40 s (`bench/bench_scale.py`, RESULTS.md "Thirteenth session").
BULK_SHARE = 0.75
RETRY_AFTER_S = 1
DRAIN_LIMIT = 1 << 20
REFUSAL = json.dumps(
    {
        "error": "the server is busy storing other nodes' reports and metrics; "
        f"send this again after {RETRY_AFTER_S} s (it is stored once however often it is sent)",
        "detail": None,
    }
).encode()
REFUSAL_HEADERS = [
    *ALWAYS,
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"content-type", b"application/json"),
    (b"content-length", str(len(REFUSAL)).encode()),
    (b"retry-after", str(RETRY_AFTER_S).encode()),
]


class AgentBacklog:
    """The agents' and ranks' calls waiting for or running on the agents' threads. Changed and read
    only on the event loop's thread, so it needs no lock."""

    def __init__(self) -> None:
        self.calls = 0


class NodeCallAdmission:
    def __init__(self, app: ASGIApp, limit: int, backlog: AgentBacklog) -> None:
        self.app = app
        self.limit = limit
        self.bulk_limit = max(1, int(limit * BULK_SHARE))
        self.backlog = backlog
        self.refused = 0  # since the process started

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            self.backlog.calls >= self.bulk_limit
            and scope["type"] == "http"
            and scope["method"] == "POST"
            and (
                BULK.fullmatch(scope["path"])
                or (self.backlog.calls >= self.limit and LIFECYCLE.fullmatch(scope["path"]))
            )
        ):
            self.refused += 1
            await _drain(receive)
            await send({"type": "http.response.start", "status": 429, "headers": REFUSAL_HEADERS})
            await send({"type": "http.response.body", "body": REFUSAL})
            return
        await self.app(scope, receive, send)


async def _drain(receive: Receive) -> None:
    """Read the refused call's body, up to `DRAIN_LIMIT` bytes, and drop it: answered with its body
    unread, the server closed the connection as the client was still sending it (the client then
    connects again, through the listen queue). A larger body is left unread (the cap stops a client
    from making the server read gigabytes to refuse them)."""
    read = 0
    while read <= DRAIN_LIMIT:
        message = await receive()
        if message["type"] != "http.request":
            return
        read += len(message.get("body", b""))
        if not message.get("more_body", False):
            return
