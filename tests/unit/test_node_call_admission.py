"""`NodeCallAdmission`: past its limit of nodes' calls in the process, one more is refused at the
door (429, Retry-After, the app never sees it); everything else always goes through."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import pytest
from starlette.types import Message, Receive, Scope, Send

from server.api.admission import SHEDDABLE, NodeCallAdmission

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


@pytest.mark.parametrize("path", NEVER_SHED)
def test_no_other_call_is_ever_refused(path: str) -> None:
    assert not SHEDDABLE.fullmatch(path)


class HeldApp:
    """An app that answers 204 once `release` is set, counting the calls it saw."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.entered = asyncio.Event()
        self.calls = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.calls += 1
        self.entered.set()
        await self.release.wait()
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
        inner = HeldApp()
        admission = NodeCallAdmission(inner, limit=1)
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
        assert admission.in_flight == 0
        assert (await call(admission, "POST", "/api/v1/agents/7/reports"))[0] == 204, "admitted again"

    run(story())


def test_a_call_that_fails_leaves_its_place() -> None:
    async def failing(scope: Scope, receive: Receive, send: Send) -> None:
        raise RuntimeError("the app failed")

    async def story() -> None:
        admission = NodeCallAdmission(failing, limit=1)
        with pytest.raises(RuntimeError):
            await call(admission, "POST", "/api/v1/allocations/3/metrics")
        assert admission.in_flight == 0

    run(story())


def test_a_refused_calls_body_is_read_up_to_a_limit() -> None:
    """Answered with its body unread, the connection was closed under a client still sending it."""

    async def refused(chunks: list[bytes]) -> int:
        inner = HeldApp()
        admission = NodeCallAdmission(inner, limit=1)
        admission.in_flight = 1  # one already in
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
