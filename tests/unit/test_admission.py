"""Admission lanes (`server/admission.py`): which lane a request waits in, the limit of requests
worked on at once, first come first served, 429 past a full line, and a lane's storm leaving
the other lanes alone. The gate wraps a stand-in app whose requests end when the test says."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from starlette.types import Receive, Scope, Send

from server.admission import Admission, AdmissionGate, lane_of


@pytest.mark.parametrize(
    ("method", "path", "query", "lane"),
    [
        ("POST", "/api/v1/agents/7/allocations/3/started", b"", "agents"),
        ("POST", "/api/v1/agents/register", b"", "agents"),
        ("GET", "/api/v1/agents/7/work", b"version=abc", "agents"),
        ("GET", "/api/v1/jobs/12/bundle", b"", "agents"),
        ("POST", "/api/v1/allocations/3/metrics", b"", "ranks"),
        ("GET", "/api/v1/jobs", b"limit=100", "users"),
        ("GET", "/api/v1/jobs/12", b"", "users"),
        ("GET", "/jobs", b"", "users"),
        ("POST", "/api/v1/jobs", b"", "users"),
        ("GET", "/api/v1/agents", b"", "users"),  # an admin's read
        ("POST", "/api/v1/agents/7/drain", b"", "users"),
        # not gated
        ("POST", "/api/v1/agents/7/heartbeat", b"", None),
        ("GET", "/api/v1/agents/7/work", b"version=abc&wait=20", None),
        ("GET", "/api/v1/jobs/12", b"state=RUNNING&wait=30", None),
        ("GET", "/jobs/12/events", b"", None),
        ("GET", "/events/jobs", b"", None),
        ("GET", "/api/v1/jobs/12/checkpoints/40/archive", b"", None),
        ("GET", "/healthz", b"", None),
        ("GET", "/metrics", b"", None),
        # a wait of 0 or one the route refuses is no long wait
        ("GET", "/api/v1/jobs/12", b"wait=0", "users"),
        ("GET", "/api/v1/jobs/12", b"wait=soon", "users"),
    ],
)
def test_each_request_waits_in_the_lane_of_its_path(method: str, path: str, query: bytes, lane: str | None) -> None:
    assert lane_of(method, path, query) == lane


class Held:
    """A stand-in app: each request records its path and ends when `release(path)` is called."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self._ends: dict[str, asyncio.Event] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.started.append(scope["path"])
        await self._ends.setdefault(scope["path"], asyncio.Event()).wait()
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    def release(self, path: str) -> None:
        self._ends.setdefault(path, asyncio.Event()).set()


async def call(gate: AdmissionGate, path: str, answers: dict[str, Any]) -> None:
    sent: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        sent.append(message)

    async def receive() -> Any:
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {"type": "http", "method": "POST", "path": path, "query_string": b"", "headers": []}
    await gate(scope, receive, send)
    start = sent[0]
    answers[path] = (start["status"], dict(start["headers"]), sent[1]["body"])


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def test_a_lane_works_on_its_limit_at_once_in_arrival_order_and_refuses_past_its_queue() -> None:
    async def story() -> None:
        app = Held()
        admission = Admission(limit=2, queue=2)
        gate = AdmissionGate(app, admission)
        answers: dict[str, Any] = {}
        paths = [f"/api/v1/allocations/{i}/metrics" for i in range(1, 6)]
        tasks = []
        for path in paths:
            tasks.append(asyncio.create_task(call(gate, path, answers)))
            await settle()
        lane = admission.lanes["ranks"]
        assert app.started == paths[:2] and (lane.in_progress, lane.waiting) == (2, 2)
        status, headers, body = answers[paths[4]]  # the fifth: two at work, two waiting
        assert status == 429 and headers[b"retry-after"] == b"1" and lane.refused == 1
        assert "2 requests of its ranks lane wait" in orjson.loads(body)["error"]

        app.release(paths[1])
        await settle()
        assert app.started == paths[:3], "the first to wait is the first let in"
        for path in paths[:4]:
            app.release(path)
        await asyncio.gather(*tasks)
        assert [answers[p][0] for p in paths] == [204, 204, 204, 204, 429]
        assert (lane.in_progress, lane.waiting) == (0, 0)

    asyncio.run(story())


def test_a_full_lane_holds_up_no_other_lane_nor_what_is_not_gated() -> None:
    async def story() -> None:
        app = Held()
        gate = AdmissionGate(app, Admission(limit=1, queue=100))
        answers: dict[str, Any] = {}
        reports = [f"/api/v1/agents/1/allocations/{i}/started" for i in range(50)]
        storm = [asyncio.create_task(call(gate, path, answers)) for path in reports]
        await settle()
        assert len(app.started) == 1
        others = ["/api/v1/jobs", "/api/v1/allocations/9/metrics", "/api/v1/agents/1/heartbeat"]
        for path in others:
            app.release(path)
        await asyncio.wait_for(asyncio.gather(*(call(gate, path, answers) for path in others)), 5)
        assert all(answers[path][0] == 204 for path in others)
        for path in reports:
            app.release(path)
        await asyncio.gather(*storm)
        assert len(answers) == 53

    asyncio.run(story())
