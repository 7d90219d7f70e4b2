"""`MetricWriter`'s grouping, without a database: batches that arrive while a group is written go
in the next group together; a group that fails is written again batch by batch, so only the
batch that fails alone fails; a group stops growing at its size limit; batches waiting for a
group count in the agents' backlog. (Storing a group is `tests/integration/test_metric_batches.py`.)"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, cast

import pytest
from sqlalchemy.orm import Session, sessionmaker

from phalanx.schemas import MetricRecord
from server.api.admission import AgentBacklog
from server.auth import Principal
from server.errors import Conflict
from server.metric_batches import MAX_GROUP_VALUES, IncomingBatch, MetricWriter, Outcome

T = TypeVar("T")
RANK = Principal(kind="rank", token_id=0, name="rank", user_id=None, is_admin=False, allocation_id=1)


def run(story: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(story)` in a thread of its own (an earlier test may have left a loop running
    in the main thread)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, story).result(timeout=60)


def batch(identity: str, values: int = 1) -> IncomingBatch:
    """A batch of `values` values, in records of up to 1,000 (the most a record holds)."""
    records = [
        MetricRecord(rank=0, step=step, time=time.time(), values={f"m{i}": 1.0 for i in range(min(1000, values - at))})
        for step, at in enumerate(range(0, values, 1000))
    ]
    return IncomingBatch(RANK, 1, identity, records)


class RecordingWriter(MetricWriter):
    """Writes nothing: records each group, holds the first until `release`, and fails a group
    holding a batch named "poison" (refuses one named "refused")."""

    def __init__(self, threads: ThreadPoolExecutor, backlog: AgentBacklog) -> None:
        super().__init__(cast(sessionmaker[Session], None), threads, backlog)
        self.groups: list[list[str]] = []
        self.release = threading.Event()
        self.writing = threading.Event()

    def _write_group(self, batches: list[IncomingBatch]) -> list[Outcome]:
        self.groups.append([b.identity for b in batches])
        self.writing.set()
        self.release.wait(10)
        if any(b.identity == "poison" for b in batches):
            raise RuntimeError("the database refused the group")
        return [Conflict("refused") if b.identity == "refused" else None for b in batches]


def test_batches_that_arrive_during_a_write_share_the_next_group() -> None:
    async def story() -> None:
        with ThreadPoolExecutor(2) as threads:
            backlog = AgentBacklog()
            writer = RecordingWriter(threads, backlog)
            first = asyncio.create_task(writer.store(batch("first")))
            await asyncio.get_running_loop().run_in_executor(None, writer.writing.wait, 10)
            later = [asyncio.create_task(writer.store(batch(f"b{i}"))) for i in range(5)]
            await asyncio.sleep(0)  # every later batch is waiting
            assert backlog.calls == 6, "the batch being written and the five waiting"
            writer.release.set()
            assert await asyncio.gather(first, *later) == [None] * 6
            assert writer.groups == [["first"], ["b0", "b1", "b2", "b3", "b4"]]
            assert backlog.calls == 0

    run(story())


def test_a_second_group_is_written_beside_the_first() -> None:
    """Two ranks' large batches at once are written by two transactions at once, as before the
    groups (one COPY keeps one PostgreSQL core busy)."""

    async def story() -> None:
        with ThreadPoolExecutor(2) as threads:
            writer = RecordingWriter(threads, AgentBacklog())
            stores = [asyncio.create_task(writer.store(batch("first")))]
            await asyncio.get_running_loop().run_in_executor(None, writer.writing.wait, 10)
            stores.append(asyncio.create_task(writer.store(batch("second"))))
            while len(writer.groups) < 2:  # written while the first is still being written
                await asyncio.sleep(0.01)
            stores.append(asyncio.create_task(writer.store(batch("third"))))
            writer.release.set()
            assert await asyncio.gather(*stores) == [None] * 3
            assert writer.groups == [["first"], ["second"], ["third"]]

    run(story())


def test_a_failed_group_is_written_again_batch_by_batch() -> None:
    async def story() -> None:
        with ThreadPoolExecutor(2) as threads:
            writer = RecordingWriter(threads, AgentBacklog())
            first = asyncio.create_task(writer.store(batch("first")))
            await asyncio.get_running_loop().run_in_executor(None, writer.writing.wait, 10)
            stores = [asyncio.create_task(writer.store(batch(name))) for name in ("ok", "poison", "refused", "fine")]
            await asyncio.sleep(0)  # all four wait for the next group
            writer.release.set()
            await first
            outcomes = await asyncio.gather(*stores, return_exceptions=True)
            assert outcomes[0] is None and outcomes[3] is None
            assert isinstance(outcomes[1], RuntimeError), "only the batch that fails alone fails"
            assert isinstance(outcomes[2], Conflict), "a refusal stays that batch's own"
            assert writer.groups[1:] == [["ok", "poison", "refused", "fine"], ["ok"], ["poison"], ["refused"], ["fine"]]

    run(story())


def test_a_group_stops_growing_at_its_size_limit() -> None:
    async def story() -> None:
        with ThreadPoolExecutor(1) as threads:
            writer = RecordingWriter(threads, AgentBacklog())
            half = MAX_GROUP_VALUES // 2
            first = asyncio.create_task(writer.store(batch("first")))
            await asyncio.get_running_loop().run_in_executor(None, writer.writing.wait, 10)
            big = [asyncio.create_task(writer.store(batch(f"big{i}", half))) for i in range(3)]
            huge = asyncio.create_task(writer.store(batch("huge", MAX_GROUP_VALUES + 1)))
            writer.release.set()
            await asyncio.gather(first, *big, huge)
            assert writer.groups == [["first"], ["big0", "big1"], ["big2"], ["huge"]], "one batch always goes"

    run(story())


def test_a_database_failure_fails_every_batch_of_a_lone_group() -> None:
    async def story() -> None:
        with ThreadPoolExecutor(1) as threads:
            writer = RecordingWriter(threads, AgentBacklog())
            writer.release.set()
            with pytest.raises(RuntimeError, match="refused the group"):
                await writer.store(batch("poison"))
            assert await writer.store(batch("after")) is None, "the writer goes on"

    run(story())
