"""`NodeCallAdmission`: past its limit of calls on the agents' threads, one more node call is
refused at the door (429, Retry-After, the app never sees it); everything else always goes
through, and a call still sending its body holds no place."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any, TypeVar, cast

import pytest
from starlette.types import Message, Receive, Scope, Send

from server.api.admission import BULK, BULK_SHARE, LIFECYCLE, SHEDDABLE, AgentBacklog, NodeCallAdmission
from server.api.deps import Services, in_agent_thread

SHED = [
    "/api/v1/agents/7/reports",
    "/api/v1/agents/7/logs",
    "/api/v1/agents/7/allocations/3/started",
    "/api/v1/agents/7/allocations/3/exit",
    "/api/v1/agents/7/allocations/3/rendezvous",
    "/api/v1/agents/7/allocations/3/logs",
    "/api/v1/allocations/3/metrics",
]
NEVER_SHED = [
    "/api/v1/agents/register",
    "/api/v1/agents/7/heartbeat",
    "/api/v1/agents/7/drain",
    "/api/v1/agents/7/allocations/3/environment",
    "/api/v1/allocations/3/checkpoints",
    "/api/v1/jobs",
    "/api/v1/allocations/3/metrics/extra",
]


T = TypeVar("T")


def run(story: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(story)` in a thread of its own: an earlier test in this process may have left
    an event loop set as running in the main thread, where asyncio.run refuses to start."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, story).result(timeout=60)


@pytest.mark.parametrize("path", SHED)
def test_the_nodes_calls_are_the_ones_that_may_be_refused(path: str) -> None:
    assert SHEDDABLE.fullmatch(path)


@pytest.mark.parametrize("path", SHED)
def test_each_of_them_is_a_node_report_or_telemetry(path: str) -> None:
    telemetry = path.endswith(("/logs", "/metrics"))
    assert (bool(BULK.fullmatch(path)), bool(LIFECYCLE.fullmatch(path))) == (telemetry, not telemetry)


@pytest.mark.parametrize("path", NEVER_SHED)
def test_no_other_call_is_ever_refused(path: str) -> None:
    assert not SHEDDABLE.fullmatch(path)


class HeldApp:
    """An app that holds each call on the agents' threads (counted in `backlog`, as
    `deps.in_agent_thread` does) until `release` is set, then answers 204; it counts the calls it
    saw."""

    def __init__(self, backlog: AgentBacklog) -> None:
        self.backlog = backlog
        self.release = asyncio.Event()
        self.entered = asyncio.Event()
        self.calls = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.calls += 1
        self.backlog.calls += 1
        self.entered.set()
        try:
            await self.release.wait()
        finally:
            self.backlog.calls -= 1
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})


async def call(app: Any, method: str, path: str) -> tuple[int, dict[bytes, bytes], bytes]:
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    await app({"type": "http", "method": method, "path": path, "headers": []}, receive, send)
    return sent[0]["status"], dict(sent[0]["headers"]), b"".join(m.get("body", b"") for m in sent[1:])


def test_past_the_limit_a_nodes_call_is_refused_and_the_rest_go_through() -> None:
    async def story() -> None:
        backlog = AgentBacklog()
        inner = HeldApp(backlog)
        admission = NodeCallAdmission(inner, limit=1, backlog=backlog)
        first = asyncio.create_task(call(admission, "POST", "/api/v1/allocations/3/metrics"))
        await inner.entered.wait()
        status, headers, body = await call(admission, "POST", "/api/v1/agents/7/reports")
        assert status == 429 and headers[b"retry-after"] == b"1"
        assert headers[b"x-frame-options"] == b"DENY", "a refusal carries the security headers too"
        assert "send this again" in json.loads(body)["error"]
        assert (inner.calls, admission.refused) == (1, 1), "the app never saw the refused call"

        others = [
            asyncio.create_task(call(admission, method, path))
            for method, path in [("POST", p) for p in NEVER_SHED] + [("GET", "/api/v1/agents/7/work")]
        ]
        while inner.calls < 1 + len(others):  # every one of them reached the app
            await asyncio.sleep(0.01)
        inner.release.set()
        assert [answer[0] for answer in await asyncio.gather(first, *others)] == [204] * (1 + len(others))
        assert backlog.calls == 0
        assert (await call(admission, "POST", "/api/v1/agents/7/reports"))[0] == 204, "admitted again"

    run(story())


def test_lines_and_metrics_are_refused_first_and_node_reports_keep_the_rest() -> None:
    """Past `BULK_SHARE` of the limit a metric batch or a log call is refused, a node's report
    still goes in, until the limit itself."""

    async def story() -> None:
        backlog = AgentBacklog()
        inner = HeldApp(backlog)
        admission = NodeCallAdmission(inner, limit=4, backlog=backlog)
        assert admission.bulk_limit == int(4 * BULK_SHARE) == 3
        held = [asyncio.create_task(call(admission, "POST", "/api/v1/allocations/3/metrics")) for _ in range(3)]
        while backlog.calls < 3:
            await asyncio.sleep(0.01)
        for path in ["/api/v1/allocations/3/metrics", "/api/v1/agents/7/logs", "/api/v1/agents/7/allocations/3/logs"]:
            assert (await call(admission, "POST", path))[0] == 429, path
        held.append(asyncio.create_task(call(admission, "POST", "/api/v1/agents/7/reports")))
        while backlog.calls < 4:  # admitted: the reserve was the reports'
            await asyncio.sleep(0.01)
        assert (await call(admission, "POST", "/api/v1/agents/7/allocations/3/exit"))[0] == 429, "at the limit"
        assert (inner.calls, admission.refused) == (4, 4)
        inner.release.set()
        assert [answer[0] for answer in await asyncio.gather(*held)] == [204] * 4

    run(story())


def test_a_call_still_sending_its_body_holds_no_place() -> None:
    """Counted from the door, as many clients as the limit trickling their bodies in kept every
    node's call out."""

    async def story() -> None:
        backlog = AgentBacklog()
        inner = HeldApp(backlog)
        trickled = asyncio.Event()

        async def reads_its_body_first(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["path"].endswith("/logs"):  # stands for a body that never ends
                await receive()
                trickled.set()
                await asyncio.Event().wait()
            await inner(scope, receive, send)

        admission = NodeCallAdmission(reads_its_body_first, limit=1, backlog=backlog)
        slow = asyncio.create_task(call(admission, "POST", "/api/v1/agents/7/logs"))
        await trickled.wait()
        admitted = asyncio.create_task(call(admission, "POST", "/api/v1/allocations/3/metrics"))
        await inner.entered.wait()
        assert (await call(admission, "POST", "/api/v1/agents/7/reports"))[0] == 429, "the thread's call counts"
        inner.release.set()
        assert (await admitted)[0] == 204
        slow.cancel()

    run(story())


def test_the_agents_threads_count_each_call_until_it_ends_or_fails() -> None:
    def fails() -> None:
        raise RuntimeError("the call failed")

    async def story() -> None:
        with ThreadPoolExecutor(1) as threads:
            services = cast(Services, SimpleNamespace(agent_threads=threads, agent_backlog=AgentBacklog()))
            counted: list[int] = []
            await in_agent_thread(services, lambda: counted.append(services.agent_backlog.calls))
            with pytest.raises(RuntimeError):
                await in_agent_thread(services, fails)
            assert counted == [1] and services.agent_backlog.calls == 0

    run(story())


def test_a_refused_calls_body_is_read_up_to_a_limit() -> None:
    """Answered with its body unread, the connection was closed under a client still sending it."""

    async def refused(chunks: list[bytes]) -> int:
        backlog = AgentBacklog()
        backlog.calls = 1  # one already on the agents' threads
        admission = NodeCallAdmission(HeldApp(backlog), limit=1, backlog=backlog)
        read: list[bytes] = []

        async def receive() -> Message:
            chunk = chunks[len(read)]
            read.append(chunk)
            return {"type": "http.request", "body": chunk, "more_body": len(read) < len(chunks)}

        async def send(message: Message) -> None:
            pass

        await admission({"type": "http", "method": "POST", "path": "/api/v1/allocations/3/metrics"}, receive, send)
        return len(read)

    assert run(refused([b"x" * 1000] * 3)) == 3, "every chunk read"
    big = [b"x" * (1 << 19)] * 8  # 4 MiB: reading stops past the limit
    assert run(refused(big)) == 3
