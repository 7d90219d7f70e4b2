"""Group commit for agent heartbeats: one transaction stamps every heartbeat that arrived while
the previous one was being written.

At 1,000 agents a 2 s heartbeat is 500 requests a second; written one transaction each, they
took the server and PostgreSQL's two cores and fell over ten seconds behind, and the reaper then
declared every agent lost (`bench/bench_scale.py`, RESULTS.md "Control-plane scale"). Batched,
they are a few transactions a second however many agents there are.

Contract: `beat(agent_id)` of an agent whose last heartbeat written by this process counted
answers at once, and the heartbeat goes in the next batch: under load, waiting for the batch was
most of a heartbeat's time, and an agent declared lost meanwhile hears it one beat later. Any other
heartbeat (the agent's first here, or one after a refusal or a failed write) returns once it is
in the database, exactly as a write of its own would: it raises `NotFound` for an agent that is
not registered and `Conflict` for one declared LOST. A heartbeat whose agent's row another
transaction holds (the reaper may be declaring it lost) waits for a later batch instead of
holding up the whole batch. A heartbeat that waits for its write is written at once, or as soon as
the write under way ends; heartbeats answered already gather for `GATHER_S` after the last write
began, so a busy server writes a few batches a second, whatever the number of agents, and the
stamp of a live agent lags its heartbeat by at most that much (against a timeout of seconds).
One per server process, used from its event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

from sqlalchemy import Engine
from sqlalchemy.orm import sessionmaker

from server.agents import HeartbeatOutcome, heartbeat_many
from server.db import make_engine
from server.errors import Conflict, NotFound


@lru_cache(maxsize=8)
def _engine(database_url: str) -> Engine:
    """One per database and process, kept like `db.engine_for`'s (the apps of a test run share it)."""
    return make_engine(database_url, pool_size=1, max_overflow=0)


# How soon a heartbeat whose agent's row was locked is tried again.
BUSY_RETRY_S = 0.05
# How long heartbeats that were answered already gather before they are written: written as soon
# as the previous write ended, 500 a second went in batches of a few, each a transaction of its own
# (a commit, its WAL flush and three round trips) and a sixth of the server process's busy time
# (`bench/bench_scale.py`). A heartbeat that waits for its write never waits for this.
GATHER_S = 0.25


class HeartbeatBatcher:
    """`database_url`: the batcher opens one connection of its own to it (see `__init__`)."""

    def __init__(self, database_url: str) -> None:
        # A connection and a thread of their own: behind the routes' shared pool and worker threads
        # (a thousand long-polls re-reading at once when agents start or a server restarts),
        # heartbeats waited past the agents' timeout and the reaper declared them lost.
        self._sessions = sessionmaker(_engine(database_url), expire_on_commit=False)
        # an agent's heartbeats that wait for the write; none for one answered at once
        self._waiting: dict[int, list[asyncio.Future[HeartbeatOutcome | None]]] = {}
        self._counted: set[int] = set()  # agents whose last heartbeat written here counted
        self._writer: asyncio.Task[None] | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="heartbeats")
        self._last_write = 0.0  # the event loop's time when the last write began
        # set to end the gathering early: a heartbeat waits for its write
        self._gathering: asyncio.Future[None] | None = None

    async def beat(self, agent_id: int) -> None:
        answers = self._waiting.setdefault(agent_id, [])
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_while_waiting())
        if agent_id in self._counted:
            return
        answer: asyncio.Future[HeartbeatOutcome | None] = asyncio.get_running_loop().create_future()
        answers.append(answer)
        if self._gathering is not None and not self._gathering.done():
            self._gathering.set_result(None)
        outcome = await answer
        if outcome == "unknown":
            raise NotFound(f"agent {agent_id} is not registered; register it first")
        if outcome == "lost":
            raise Conflict(f"agent {agent_id} was declared lost; register again to take work")

    async def _write_while_waiting(self) -> None:
        loop = asyncio.get_running_loop()
        while self._waiting:
            await self._gather(loop)
            batch, self._waiting = self._waiting, {}
            self._last_write = loop.time()
            try:
                outcomes = await asyncio.get_running_loop().run_in_executor(self._thread, self._write, sorted(batch))
            except Exception as exc:  # the database is down: every waiting heartbeat fails as its own would
                self._counted.difference_update(batch)
                for answers in batch.values():
                    for answer in answers:
                        if not answer.done():
                            answer.set_exception(exc)
                continue
            busy = False
            for agent_id, answers in batch.items():
                if outcomes.get(agent_id) == "busy":  # its row is locked: in the next batch
                    self._waiting.setdefault(agent_id, []).extend(answers)
                    busy = True
                    continue
                if outcomes.get(agent_id) is None:
                    self._counted.add(agent_id)
                else:
                    self._counted.discard(agent_id)
                for answer in answers:
                    if not answer.done():  # its request may have been cancelled
                        answer.set_result(outcomes.get(agent_id))
            if busy:
                await asyncio.sleep(BUSY_RETRY_S)

    async def _gather(self, loop: asyncio.AbstractEventLoop) -> None:
        """Until `GATHER_S` after the last write began, unless a heartbeat waits for its write."""
        delay = self._last_write + GATHER_S - loop.time()
        if delay <= 0 or any(self._waiting.values()):
            return
        self._gathering = loop.create_future()
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._gathering, delay)
        finally:
            self._gathering = None

    def _write(self, agent_ids: list[int]) -> dict[int, HeartbeatOutcome]:
        with self._sessions() as session, session.begin():
            return heartbeat_many(session, agent_ids)
