"""Live dashboard data on a real PostgreSQL and Redis: the chart data (one series per metric,
LTTB-downsampled) and the Server-Sent Event streams, served by a real uvicorn server and woken
by the same Redis pub/sub that wakes agents."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient

from server.app import create_app
from server.dashboard.metric_series import lttb_indices
from server.settings import Settings
from tests.agent_tokens import as_agent, as_rank
from tests.conftest import ADMIN_TOKEN
from tests.integration.test_dashboard import USER, schedule, submit
from tests.processes import free_port, wait_for

pytestmark = pytest.mark.integration
COOKIE = {"phalanx_session": ADMIN_TOKEN}


def running_job(client: TestClient, settings: Settings, slots: int = 2) -> tuple[int, int]:
    """A job placed on the agent: (job id, allocation id)."""
    job_id = submit(client, resources={"nodes": 1, "slots_per_node": slots})
    schedule(settings)
    (allocation,) = client.get(f"/api/v1/jobs/{job_id}", headers=USER).json()["allocations"]
    return job_id, allocation["id"]


def post_metrics(client: Any, allocation_id: int, records: list[dict[str, Any]]) -> None:
    response = client.post(
        f"/api/v1/allocations/{allocation_id}/metrics",
        json={"records": records},
        headers=as_rank(client, allocation_id),
    )
    assert response.status_code == 204, response.text


def records(rank: int, steps: range, **values: Any) -> list[dict[str, Any]]:
    return [{"rank": rank, "step": s, "time": 1.0, "values": {k: f(s) for k, f in values.items()}} for s in steps]


def test_chart_data_charts_rank_zero_downsamples_and_keeps_the_shape(client: TestClient, settings: Settings) -> None:
    job_id, allocation_id = running_job(client, settings)
    wave = lambda s: math.sin(s / 50) + (5.0 if s == 3333 else 0.0)  # noqa: E731 - a spike LTTB must keep
    post_metrics(client, allocation_id, records(1, range(5000), loss=lambda s: -1.0))  # rank 1 differs
    post_metrics(client, allocation_id, records(0, range(5000), loss=wave))
    post_metrics(client, allocation_id, records(1, range(10), only_rank_1=float))
    assert client.get(f"/jobs/{job_id}/chart-data").status_code == 303  # no session: sign in
    client.cookies.update(COOKIE)
    data = client.get(f"/jobs/{job_id}/chart-data?points=500").json()
    series = {s["name"]: s for s in data["series"]}
    assert sorted(series) == ["loss", "only_rank_1"]
    loss = series["loss"]
    assert loss["rank"] == 0 and loss["total"] == 5000 and len(loss["steps"]) == len(loss["values"]) == 500
    assert loss["steps"][0] == 0 and loss["steps"][-1] == 4999 and loss["steps"] == sorted(loss["steps"])
    assert 3333 in loss["steps"] and max(loss["values"]) == pytest.approx(wave(3333))  # the spike survives
    assert all(v > -1.0 for v in loss["values"])  # nothing of rank 1's
    assert series["only_rank_1"]["rank"] == 1 and series["only_rank_1"]["steps"] == list(range(10))
    everything = client.get(f"/api/v1/jobs/{job_id}/metrics", headers=USER).json()
    assert data["cursor"] == len(everything)  # ids from 1: the stream carries on after the last
    full = client.get(f"/jobs/{job_id}/chart-data?points=100000").json()
    assert {s["name"]: len(s["steps"]) for s in full["series"]} == {"loss": 5000, "only_rank_1": 10}
    assert client.get("/jobs/999/chart-data").status_code == 404


def test_nan_and_infinities_reach_the_charts_as_breaks_even_downsampled(client: TestClient, settings: Settings) -> None:
    job_id, allocation_id = running_job(client, settings)

    def loss(step: int) -> Any:
        if 1000 <= step < 1200:
            return "NaN"  # a run of NaN: the chart must still show where it starts
        return "Infinity" if step == 3000 else math.cos(step / 100)

    post_metrics(client, allocation_id, records(0, range(5000), loss=loss))
    client.cookies.update(COOKIE)
    (series,) = client.get(f"/jobs/{job_id}/chart-data?points=500").json()["series"]
    assert series["total"] == 5000 and len(series["steps"]) <= 500
    marked = {
        step: value for step, value in zip(series["steps"], series["values"], strict=True) if isinstance(value, str)
    }
    assert marked == {1000: "NaN", 3000: "Infinity"}
    from server.dashboard.metric_series import points_after
    from server.db import session_scope

    with session_scope(settings.database_url) as session:
        new = points_after(session, job_id, 1000, limit=2)
    assert new.as_json()["points"] == {"loss": {"0": [(1000, "NaN"), (1001, "NaN")]}}


def test_points_after_says_when_its_limit_cut_the_read_short(client: TestClient, settings: Settings) -> None:
    from server.dashboard.metric_series import points_after
    from server.db import session_scope

    job_id, allocation_id = running_job(client, settings)
    post_metrics(client, allocation_id, records(0, range(30), loss=float))
    with session_scope(settings.database_url) as session:
        first = points_after(session, job_id, 0, limit=20)
        rest = points_after(session, job_id, first.cursor, limit=20)
    assert first.more and [p[0] for p in first.points["loss"][0]] == list(range(20))
    assert not rest.more and [p[0] for p in rest.points["loss"][0]] == list(range(20, 30))


def test_lttb_keeps_the_ends_and_returns_everything_when_short() -> None:
    import numpy as np

    steps = np.arange(10_000)
    values = np.sin(steps / 100.0)
    kept = lttb_indices(steps, values, 300)
    assert len(kept) == 300 and kept[0] == 0 and kept[-1] == 9_999 and (np.diff(kept) > 0).all()
    assert list(lttb_indices(steps[:50], values[:50], 300)) == list(range(50))


class LiveServer:
    """The app under uvicorn in a thread: SSE needs a real server (and a real disconnect)."""

    def __init__(self, settings: Settings) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            create_app(settings, enqueue=lambda *_, **__: None), port=self.port, log_level="warning"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        wait_for(lambda: self.server.started, 30, "uvicorn to start")
        return self

    def __exit__(self, *_: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def events(response: httpx.Response) -> Iterator[tuple[str, Any]]:
    """(event, data) pairs of a Server-Sent Event stream; pings (comments) are skipped."""
    name, data = "message", ""
    for line in response.iter_lines():
        if line.startswith("event:"):
            name = line.removeprefix("event:").strip()
        elif line.startswith("data:"):
            data += line.removeprefix("data:").strip()
        elif line == "" and data:
            yield name, json.loads(data)
            name, data = "message", ""


def test_a_jobs_stream_sends_new_points_and_lines_then_its_end(client: TestClient, settings: Settings) -> None:
    job_id, allocation_id = running_job(client, settings)
    post_metrics(client, allocation_id, records(0, range(3), loss=float))
    client.cookies.update(COOKIE)
    cursor = client.get(f"/jobs/{job_id}/chart-data").json()["cursor"]
    with LiveServer(settings) as live, httpx.Client(base_url=live.url, cookies=COOKIE, timeout=30) as http:
        assert http.get("/jobs/999/events").status_code == 404
        url = f"/jobs/{job_id}/events?metrics_after={cursor}&logs_after=0"
        with http.stream("GET", url) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            stream = events(response)
            # what lands after the stream opened arrives through the Redis wake-up
            post_metrics(http, allocation_id, records(0, range(3, 5), loss=float) + records(1, range(3, 5), loss=float))
            name, data = next(stream)
            assert name == "metrics" and data["points"] == {
                "loss": {"0": [[3, 3.0], [4, 4.0]], "1": [[3, 3.0], [4, 4.0]]}
            }
            line = {"rank": 1, "stream": "stdout", "time": 1.0, "line": "<hello>"}
            logs = http.post(
                f"/api/v1/agents/1/allocations/{allocation_id}/logs", json={"lines": [line]}, headers=as_agent(1)
            )
            assert logs.status_code == 204
            name, data = next(stream)
            assert name == "logs" and [(r["rank"], r["line"]) for r in data] == [(1, "<hello>")]
            assert http.post(f"/api/v1/jobs/{job_id}/kill", headers=USER).status_code == 200
            seen = dict(next(stream) for _ in range(2))
            assert seen == {"summary": {"state": "CANCELLED"}, "end": {"state": "CANCELLED"}}


def test_the_jobs_table_stream_says_when_any_job_changes(client: TestClient, settings: Settings) -> None:
    with LiveServer(settings) as live, httpx.Client(base_url=live.url, cookies=COOKIE, timeout=30) as http:
        with httpx.Client(base_url=live.url) as anonymous:
            assert anonymous.get("/events/jobs", follow_redirects=False).status_code == 303
        page = http.get("/jobs").text
        since = page.split("/events/jobs?since=")[1].split('"')[0]
        with http.stream("GET", f"/events/jobs?since={since}") as response:
            stream = events(response)
            job_id = submit(http)  # type: ignore[arg-type]
            name, version = next(stream)
            assert name == "changed" and version != since
            assert f'data-job="{job_id}"' in http.get("/jobs").text
