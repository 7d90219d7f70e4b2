"""`server/heartbeats.py` against the real database: heartbeats answered already gather into one
write, and a heartbeat that waits for its write never waits for the gathering."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from server import heartbeats
from server.db import session_scope
from server.heartbeats import HeartbeatBatcher
from server.models import Agent
from server.settings import Settings
from tests.integration.test_api import register

GATHER_S = 3.0  # long enough that a write not held by the gathering is plainly sooner


class CountedBatcher(HeartbeatBatcher):
    """The batcher as the server runs it, remembering the agents of each write."""

    def __init__(self, database_url: str) -> None:
        super().__init__(database_url)
        self.writes: list[list[int]] = []

    def _write(self, agent_ids: list[int]) -> dict[int, heartbeats.HeartbeatOutcome]:
        self.writes.append(agent_ids)
        return super()._write(agent_ids)


def stamps(settings: Settings, agent_ids: list[int]) -> dict[int, datetime]:
    with session_scope(settings.database_url) as session:
        return dict(session.execute(select(Agent.id, Agent.last_heartbeat).where(Agent.id.in_(agent_ids))).all())


def test_answered_heartbeats_gather_into_one_write_and_a_waiting_one_is_not_held(
    client: TestClient, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(heartbeats, "GATHER_S", GATHER_S)
    counted = [register(client, f"gathered-{i}") for i in range(5)]
    newcomer = register(client, "newcomer")

    async def scenario() -> tuple[list[list[int]], float, dict[int, datetime], dict[int, datetime]]:
        batcher = CountedBatcher(settings.database_url)
        for agent_id in counted:  # their first beats: each waits for its write
            await batcher.beat(agent_id)
        written_first = stamps(settings, counted)
        writes_before = len(batcher.writes)
        for agent_id in counted:  # counted now: answered at once, written later together
            await batcher.beat(agent_id)
        deadline = time.monotonic() + 10
        while batcher._gathering is None and len(batcher.writes) == writes_before:  # gathering, or written
            assert time.monotonic() < deadline, "the answered beats were neither gathered nor written"
            await asyncio.sleep(0.01)
        began = time.monotonic()
        await batcher.beat(newcomer)  # waits for its write: the gathering must not hold it
        newcomer_waited = time.monotonic() - began
        # the writer ends once nothing waits: the gathered beats went with the newcomer's, or after
        # GATHER_S at the latest
        assert batcher._writer is not None
        await asyncio.wait_for(batcher._writer, GATHER_S + 10)
        return batcher.writes[writes_before:], newcomer_waited, written_first, stamps(settings, counted)

    # in a thread of its own: an earlier test of the process may have left a loop running in this one
    with ThreadPoolExecutor(1) as thread:
        writes, newcomer_waited, first, second = thread.submit(lambda: asyncio.run(scenario())).result(timeout=60)
    assert newcomer_waited < GATHER_S / 2, f"a first heartbeat waited {newcomer_waited:.2f} s for the gathering"
    assert len(writes) == 1 and sorted(writes[0]) == sorted([*counted, newcomer]), writes
    assert all(second[agent_id] > first[agent_id] for agent_id in counted)
