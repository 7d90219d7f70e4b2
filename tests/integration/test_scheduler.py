"""Scheduler tasks through a real Redis broker and real Celery workers, two at once."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from server.app import create_app
from server.db import session_scope
from server.models import Allocation, AllocationNode, Job, SlotLease
from server.settings import Settings
from tests.agent_tokens import register_agent
from tests.conftest import ADMIN_TOKEN
from tests.processes import Stack, wait_for

pytestmark = pytest.mark.integration
USER = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
AGENTS, SLOTS = 12, 2


@pytest.fixture
def two_schedulers(settings: Settings, tmp_path: Path) -> Iterator[Stack]:
    stack = Stack(tmp_path, settings.database_url, settings.broker_url)
    try:
        stack.start_scheduler("scheduler-1")
        stack.start_scheduler("scheduler-2")
        yield stack
    finally:
        stack.close()


def test_two_schedulers_never_double_book(settings: Settings, two_schedulers: Stack) -> None:
    """Submits through the API (which enqueues a pass per submit on Redis) while two Celery workers
    with beat race to place the jobs; afterwards every slot is held at most once."""
    with TestClient(create_app(settings)) as client:
        for i in range(AGENTS):
            body = {"name": f"n{i}", "address": f"10.0.0.{i + 1}", "cpu_slots": SLOTS}
            register_agent(client, **body)
        shapes = [(1, 1), (2, 1), (1, 2), (3, 2), (2, 2)]
        job_ids = []
        for i in range(40):
            nodes, slots = shapes[i % len(shapes)]
            spec = {
                "name": f"j{i}",
                "entrypoint": "python x.py",
                "resources": {"nodes": nodes, "slots_per_node": slots},
            }
            response = client.post("/api/v1/jobs", files={"spec": (None, json.dumps(spec))}, headers=USER)
            assert response.status_code == 201, response.text
            job_ids.append(response.json()["id"])

        def settled() -> bool:
            with session_scope(settings.database_url) as session:
                used = len(session.scalars(select(SlotLease)).all())
                queued = session.scalars(select(Job).where(Job.state == "QUEUED")).all()
                # settled: the cluster is full, or nothing is left to place
                return (
                    not queued
                    or used == AGENTS * SLOTS
                    or all(j.wait_reason and "waiting for the scheduler" not in j.wait_reason for j in queued)
                )

        wait_for(settled, 60, "the schedulers to place what fits")

    with session_scope(settings.database_url) as session:
        leases = session.execute(select(SlotLease.agent_id, SlotLease.slot_index)).all()
        assert len(leases) == len(set(leases))
        nodes = session.execute(
            select(AllocationNode.agent_id, AllocationNode.slot_indices, Allocation.job_id).join(Allocation)
        ).all()
        held = Counter((agent, index) for agent, indices, _ in nodes for index in indices)
        assert held and max(held.values()) == 1, "a slot was given twice"
        per_agent = Counter(agent for agent, _ in held)
        assert max(per_agent.values()) <= SLOTS
        attempts = Counter(job for _, _, job in nodes)
        jobs = {j.id: j for j in session.scalars(select(Job))}
        for job_id, count in attempts.items():
            assert count == jobs[job_id].nodes, f"job {job_id} was placed more than once"
            assert jobs[job_id].state == "SCHEDULED" and jobs[job_id].attempts == 1
        assert sum(per_agent.values()) >= AGENTS * SLOTS - 4  # the schedulers really placed work
    for name in ("scheduler-1", "scheduler-2"):
        log = two_schedulers.log(name)
        assert "IntegrityError" not in log and "Traceback" not in log, log[-2000:]


def test_a_pass_waits_for_the_pass_in_progress(settings: Settings) -> None:
    """Pass B starts while pass A holds its transaction open: B must wait and then see A's leases.
    (Without the advisory lock, B would place the same jobs on the same slots and die on commit.)"""
    import threading

    from scheduler.service import schedule_pass

    with TestClient(create_app(settings, enqueue=lambda *_, **__: None)) as client:
        for i in range(2):
            body = {"name": f"n{i}", "address": "127.0.0.1", "cpu_slots": 1}
            register_agent(client, **body)
        for i in range(3):
            spec = {"name": f"j{i}", "entrypoint": "python x.py", "resources": {"nodes": 1}}
            assert (
                client.post("/api/v1/jobs", files={"spec": (None, json.dumps(spec))}, headers=USER).status_code == 201
            )

    a_placed, release, b_done = threading.Event(), threading.Event(), threading.Event()
    results: dict[str, object] = {}

    def pass_a() -> None:
        with session_scope(settings.database_url) as session:
            results["a"] = schedule_pass(session)
            a_placed.set()
            release.wait(30)

    def pass_b() -> None:
        try:
            with session_scope(settings.database_url) as session:
                results["b"] = schedule_pass(session)
        except Exception as exc:  # recorded for the assertion below
            results["b"] = exc
        b_done.set()

    thread_a = threading.Thread(target=pass_a)
    thread_a.start()
    assert a_placed.wait(30)
    thread_b = threading.Thread(target=pass_b)
    thread_b.start()
    assert not b_done.wait(1.0), "pass B ran while pass A held the scheduler lock"
    release.set()
    thread_a.join(30)
    thread_b.join(30)
    assert len(results["a"]) == 2  # type: ignore[arg-type]
    assert results["b"] == set()
    with session_scope(settings.database_url) as session:
        assert len(session.scalars(select(SlotLease)).all()) == 2
        assert sorted(j.state for j in session.scalars(select(Job))) == ["QUEUED", "SCHEDULED", "SCHEDULED"]
