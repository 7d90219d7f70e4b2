"""Metric batches stored in groups (`server/metric_batches.py`), on each store: every batch of a
group gets the outcome a transaction of its own would have given it, a refused batch changes
nothing, a resend is stored once, and the latest values merge in arrival order."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import func, select, update

from phalanx.schemas import MetricRecord, ProfileOrder
from server.auth import Principal
from server.db import session_scope
from server.errors import Conflict, Forbidden, NotFound
from server.metric_batches import IncomingBatch, StudyObjectives, store_metric_batches
from server.models import Allocation, Metric
from server.settings import Settings
from tests.agent_tokens import as_rank
from tests.integration.test_api import USER, register, schedule, spec, submit


def running_allocations(client: TestClient, settings: Settings, count: int) -> list[int]:
    register(client, "n1", slots=count)
    jobs = [submit(client, spec(resources={"nodes": 1})).json()["id"] for _ in range(count)]
    schedule(settings)
    return [client.get(f"/api/v1/jobs/{job}", headers=USER).json()["allocations"][0]["id"] for job in jobs]


def rank_of(allocation_id: int) -> Principal:
    return Principal(kind="rank", token_id=0, name="rank", user_id=None, is_admin=False, allocation_id=allocation_id)


def agent(agent_id: int) -> Principal:
    return Principal(kind="agent", token_id=0, name="agent", user_id=None, is_admin=False, agent_id=agent_id)


def records(step: int, **values: float) -> list[MetricRecord]:
    return [MetricRecord(rank=0, step=step, time=time.time(), values=values)]


def points(settings: Settings, allocation_id: int) -> list[tuple[int, str, float]]:
    with session_scope(settings.database_url) as session:
        rows = session.execute(
            select(Metric.step, Metric.name, Metric.value)
            .where(Metric.allocation_id == allocation_id)
            .order_by(Metric.step, Metric.name)
        )
        return [(step, name, value) for step, name, value in rows]


def test_each_batch_of_a_group_gets_its_own_outcome(any_store: tuple[TestClient, Settings]) -> None:
    client, settings = any_store
    first, second, fenced = running_allocations(client, settings, 3)
    with session_scope(settings.database_url) as session:
        session.execute(update(Allocation).where(Allocation.id == fenced).values(fenced=True))
    agent_id = client.get("/api/v1/agents", headers=USER).json()[0]["id"]

    group = [
        IncomingBatch(rank_of(first), first, "a", records(1, loss=3.0, acc=0.1)),
        IncomingBatch(rank_of(second), second, "b", records(1, loss=9.0)),
        IncomingBatch(rank_of(first), first, "a", records(1, loss=3.0, acc=0.1)),  # resent in the same group
        IncomingBatch(rank_of(first), second, "c", records(5, loss=0.0)),  # another allocation's credential
        IncomingBatch(rank_of(987_654), 987_654, "d", records(1, loss=0.0)),
        IncomingBatch(rank_of(fenced), fenced, "e", records(1, loss=0.0)),
        IncomingBatch(agent(agent_id), first, "f", records(2, loss=2.0)),  # its agent may report too
        IncomingBatch(agent(agent_id + 1), first, "g", records(7, loss=0.0)),  # an agent not hosting it may not
    ]
    with session_scope(settings.database_url) as session:
        outcomes = store_metric_batches(session, group, StudyObjectives())
    kinds = [type(outcome) for outcome in outcomes]
    assert kinds == [type(None), type(None), type(None), Forbidden, NotFound, Conflict, type(None), Forbidden]
    assert "belongs to allocation" in str(outcomes[3]) and "no node on this agent" in str(outcomes[7])

    assert points(settings, first) == [(1, "acc", 0.1), (1, "loss", 3.0), (2, "loss", 2.0)], "each batch once"
    assert points(settings, second) == [(1, "loss", 9.0)], "the refused batch added nothing"
    assert points(settings, fenced) == []
    with session_scope(settings.database_url) as session:
        latest = {a: m for a, m in session.execute(select(Allocation.id, Allocation.latest_metrics))}
        steps = {a: s for a, s in session.execute(select(Allocation.id, Allocation.latest_step))}
    assert latest[first] == {"loss": 2.0, "acc": 0.1}, "merged in arrival order"
    assert (steps[first], steps[second], steps[fenced]) == (2, 1, None)

    # sent again in a later group: stored already, still answered as stored
    with session_scope(settings.database_url) as session:
        assert store_metric_batches(session, group[:1], StudyObjectives()) == [None]
    assert len(points(settings, first)) == 3


def test_the_answer_names_the_profile_asked_for(client: TestClient, settings: Settings) -> None:
    (allocation_id,) = running_allocations(client, settings, 1)
    job_id = client.get("/api/v1/jobs", headers=USER).json()[0]["id"]
    asked = client.post(f"/api/v1/jobs/{job_id}/profiles", json={"steps": 3}, headers=USER)
    assert asked.status_code == 201, asked.text
    with session_scope(settings.database_url) as session:
        (order,) = store_metric_batches(
            session,
            [IncomingBatch(rank_of(allocation_id), allocation_id, "a", records(1, loss=1.0))],
            StudyObjectives(),
        )
    assert isinstance(order, ProfileOrder) and order.steps == 3


def test_many_ranks_at_once_each_stored_once(client: TestClient, settings: Settings) -> None:
    """Through the route, from 16 threads at once: the batches that arrive together share
    transactions, and each is answered and stored as if alone."""
    allocations = running_allocations(client, settings, 2)
    headers = {a: as_rank(client, a) for a in allocations}

    def send(sender: int) -> list[int]:
        allocation_id = allocations[sender % 2]
        answers = []
        for step in range(5):
            body: dict[str, Any] = {
                "records": [{"rank": sender, "step": step, "time": time.time(), "values": {"loss": float(step)}}],
                "batch_id": f"s{sender}-{step}",
            }
            for _ in range(2):  # a resend is answered the same, and stored once
                url = f"/api/v1/allocations/{allocation_id}/metrics"
                answers.append(client.post(url, json=body, headers=headers[allocation_id]).status_code)
        return answers

    with ThreadPoolExecutor(16) as pool:
        answers = [status for statuses in pool.map(send, range(16)) for status in statuses]
    assert answers == [204] * 16 * 10
    with session_scope(settings.database_url) as session:
        stored = session.execute(select(func.count()).select_from(Metric)).scalar_one()
    assert stored == 16 * 5
