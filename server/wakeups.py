"""Wake-ups: tell a long-polling agent that its work changed, or a watcher that a job's state
did, across processes.

With a Redis broker, publishers (routes, scheduler tasks) PUBLISH on `phalanx:wake:<channel>` and
each server process keeps one pattern subscription that sets in-process events. Without Redis
(the embedded default, one machine) publishers rewrite a file per channel under the data dir and
each server process keeps one inotify watch on that folder that sets the same events, so idle
long-polls cost nothing while training runs on the same cores. Where inotify is missing, waiters
stat their file every `POLL_SECONDS` instead.

Contract: publish and enqueue after commit, never inside a transaction; a lost wake-up only delays
an agent until its long-poll times out, because waiters always re-read the database. Code that
changes something notes the effect in its session (`note_job_change`, `note_agent_work`,
`note_schedule`, `note_task`, ...), and `publish_after_commit`, installed once on each process's
sessionmaker, carries the noted effects out after the commit succeeds; a rollback drops them.
Nothing else publishes or enqueues by hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import Executor
from pathlib import Path
from typing import Protocol, TypeVar

import redis
import redis.asyncio as aioredis
from sqlalchemy import event as orm_event
from sqlalchemy.orm import Session, SessionTransaction, sessionmaker
from starlette.concurrency import run_in_threadpool

from server.inotify import IN_CLOSE_WRITE, IN_MOVED_TO, FolderWatch
from server.task_names import ADVANCE_STUDY_TASK, SCHEDULE_TASK

T = TypeVar("T")
PREFIX = "phalanx:wake:"
POLL_SECONDS = 0.05
log = logging.getLogger(__name__)


_CHANGED_JOBS = "phalanx.changed_jobs"
_CHANGED_STUDIES = "phalanx.changed_studies"
_ENDED_TRIAL_STUDIES = "phalanx.ended_trial_studies"
_CHANNELS = "phalanx.channels"
_AGENTS = "phalanx.agents"
_TASKS = "phalanx.tasks"


class Enqueue(Protocol):
    """Send a task to the scheduler's queue (IDs only); a lost enqueue only delays the work,
    because every task is also run by a periodic pass."""

    def __call__(self, task: str, *args: int, countdown: float = 0.0) -> None: ...


def agent_channel(agent_id: int) -> str:
    return f"agent:{agent_id}"


def job_channel(job_id: int) -> str:
    return f"job:{job_id}"


def study_channel(study_id: int) -> str:
    return f"study:{study_id}"


def scaling_channel(run_id: int) -> str:
    return f"scaling:{run_id}"


def job_data_channel(job_id: int) -> str:
    """Woken when a job's metrics, logs or checkpoints arrive (the dashboard's live charts and logs);
    apart from `job_channel` so that state long-polls are not woken by every metric batch."""
    return f"job-data:{job_id}"


JOBS_CHANNEL = "jobs"  # any job changed state (the dashboard's jobs table and overview)


# --- effects noted inside a transaction, carried out after its commit, dropped on rollback ------


def note_job_change(session: Session, job_id: int) -> None:
    """Remember that `job_id` changed state in this session's transaction (published on commit)."""
    session.info.setdefault(_CHANGED_JOBS, set()).add(job_id)


def note_study_change(session: Session, study_id: int, *, trial_ended: bool = False) -> None:
    """Remember that the study or one of its trials changed (published on commit); `trial_ended`:
    a trial job reached a terminal state, so the study's driver must run (enqueued on commit)."""
    session.info.setdefault(_CHANGED_STUDIES, set()).add(study_id)
    if trial_ended:
        session.info.setdefault(_ENDED_TRIAL_STUDIES, set()).add(study_id)


def note_scaling_change(session: Session, run_id: int) -> None:
    """A scaling run moved on (a size started or measured, or it ended): its watchers answer."""
    session.info.setdefault(_CHANNELS, set()).add(scaling_channel(run_id))


def note_agent_work(session: Session, agent_ids: Iterable[int]) -> None:
    """These agents' assignments changed: their work long-polls answer after the commit."""
    session.info.setdefault(_AGENTS, set()).update(agent_ids)


def noted_agents(session: Session) -> set[int]:
    """The agents this transaction has noted so far (what a pass reports it woke)."""
    return set(session.info.get(_AGENTS, ()))


def note_job_data(session: Session, job_id: int) -> None:
    """Metrics, logs or a checkpoint of the job arrived (live charts and log views)."""
    session.info.setdefault(_CHANNELS, set()).add(job_data_channel(job_id))


def note_task(session: Session, task: str, *args: int) -> None:
    """Enqueue `task(*args)` once this transaction commits (once, however often it is noted)."""
    session.info.setdefault(_TASKS, {}).setdefault((task, args), None)


def note_schedule(session: Session) -> None:
    """Slots were freed or a job was queued: a scheduling pass should run after the commit."""
    note_task(session, SCHEDULE_TASK)


def publish_after_commit(sessions: sessionmaker[Session], publisher: Publisher, enqueue: Enqueue | None) -> None:
    """Carry out what a committed session noted: publish the job, study, agent and job-data
    channels, and enqueue the noted tasks and a driver pass for every study one of whose trial
    jobs ended. Everything noted is dropped when the transaction rolls back. `enqueue=None` (a
    process with no queue) only publishes.

    SQLAlchemy fires `after_commit` and `after_rollback` for savepoints too. A released savepoint
    carries nothing out: a wake-up before the real commit lets the woken read the old rows and
    then sleep through the change (a gang's rank 1 waited a whole work poll for its master port).
    A savepoint rolled back keeps what was noted, its own notes included: a wake-up too many costs
    one read, one too few a whole long-poll."""

    @orm_event.listens_for(sessions, "after_commit")
    def _carry_out(session: Session) -> None:
        if session.get_nested_transaction() is not None:  # a savepoint released, not the commit
            return
        jobs = session.info.pop(_CHANGED_JOBS, None) or set()
        studies = session.info.pop(_CHANGED_STUDIES, None) or set()
        ended = session.info.pop(_ENDED_TRIAL_STUDIES, None) or set()
        channels = set(session.info.pop(_CHANNELS, None) or ())
        channels |= {agent_channel(a) for a in session.info.pop(_AGENTS, None) or ()}
        tasks = list(session.info.pop(_TASKS, None) or ())
        channels |= {job_channel(j) for j in jobs} | {study_channel(s) for s in studies}
        if jobs:
            channels.add(JOBS_CHANNEL)
        if channels:
            publisher.publish(channels)
        if enqueue is not None:
            for task, args in [*tasks, *((ADVANCE_STUDY_TASK, (s,)) for s in sorted(ended))]:
                enqueue(task, *args)

    @orm_event.listens_for(sessions, "after_transaction_end")
    def _forget(session: Session, transaction: SessionTransaction) -> None:
        if transaction.parent is None:  # after a commit, `_carry_out` has taken everything already
            for key in (_CHANGED_JOBS, _CHANGED_STUDIES, _ENDED_TRIAL_STUDIES, _CHANNELS, _AGENTS, _TASKS):
                session.info.pop(key, None)


class Publisher:
    def __init__(self, redis_url: str | None, wake_dir: Path | None = None) -> None:
        self._redis = redis.Redis.from_url(redis_url) if redis_url else None
        self._wake_dir = wake_dir

    def publish(self, channels: Iterable[str]) -> None:
        if self._redis is None:
            if self._wake_dir is not None:
                self._wake_dir.mkdir(parents=True, exist_ok=True)
                for channel in set(channels):
                    (self._wake_dir / channel).write_bytes(os.urandom(8))  # a new mtime (and inode data)
            return
        try:
            with self._redis.pipeline(transaction=False) as pipe:
                for channel in set(channels):
                    pipe.publish(PREFIX + channel, b"1")
                pipe.execute()
        except redis.RedisError as exc:  # a lost wake-up costs latency, never correctness
            log.warning("wake-up publish failed: %s", exc)


class Waiter:
    """One per server process; `listen(channel)` yields an event set when the channel is woken."""

    def __init__(self, redis_url: str | None, wake_dir: Path | None = None) -> None:
        self._redis_url = redis_url
        self._wake_dir = wake_dir
        self._events: dict[str, set[asyncio.Event]] = defaultdict(set)
        self._task: asyncio.Task[None] | None = None
        self._watch: FolderWatch | None = None

    @property
    def polling(self) -> bool:
        return self._redis_url is None and self._watch is None

    async def start(self) -> None:
        if self._redis_url and self._task is None:
            self._task = asyncio.create_task(self._subscribe(self._redis_url))
        elif self._redis_url is None and self._wake_dir is not None and self._watch is None:
            self._wake_dir.mkdir(parents=True, exist_ok=True)
            self._watch = FolderWatch.open(self._wake_dir, IN_CLOSE_WRITE | IN_MOVED_TO)
            if self._watch is not None:
                asyncio.get_running_loop().add_reader(self._watch.fileno(), self._on_folder_event)

    def _on_folder_event(self) -> None:
        assert self._watch is not None
        for channel in self._watch.read_names():
            for event in self._events.get(channel, ()):
                event.set()

    async def stop(self) -> None:
        if self._watch is not None:
            asyncio.get_running_loop().remove_reader(self._watch.fileno())
            self._watch.close()
            self._watch = None
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _subscribe(self, url: str) -> None:
        while True:
            try:
                client = aioredis.Redis.from_url(url)
                async with client.pubsub() as pubsub:
                    await pubsub.psubscribe(PREFIX + "*")
                    async for message in pubsub.listen():
                        if message.get("type") != "pmessage":
                            continue
                        channel = message["channel"].decode()[len(PREFIX) :]
                        for event in self._events.get(channel, ()):
                            event.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis restarts must not kill the server
                log.warning("wake-up subscription lost (%s); retrying", exc)
                # Wake every waiter so nobody sleeps through the gap.
                for events in self._events.values():
                    for event in events:
                        event.set()
                await asyncio.sleep(1.0)

    @contextlib.asynccontextmanager
    async def listen(self, *channels: str) -> AsyncIterator[asyncio.Event]:
        """One event, set when any of `channels` is woken."""
        event = asyncio.Event()
        for channel in channels:
            self._events[channel].add(event)
        try:
            yield event
        finally:
            for channel in channels:
                self._events[channel].discard(event)
                if not self._events[channel]:
                    del self._events[channel]

    async def until_changed(
        self,
        channel: str,
        load: Callable[[], T],
        changed: Callable[[T], bool],
        timeout: float,
        interrupt: asyncio.Event | None = None,
        reread_at_timeout: bool = True,
        threads: Executor | None = None,
    ) -> T:
        """Long-poll: `load()` (in a worker thread, or one of `threads`) until `changed` says so, `timeout` passes or
        `interrupt` is set; re-read on every wake-up of `channel`. Returns the last value loaded.

        Without `reread_at_timeout`, a timeout that no wake-up preceded returns the last value
        without reading again (not when polling files): every change wakes its channel, and a
        wake-up that was lost (Redis reconnecting, a subscription not made yet) is caught by the
        caller's next long-poll, whose first read compares. For callers that poll again at once,
        the agents: at 1,000 agents that is half the work long-polls' reads."""
        deadline = time.monotonic() + timeout
        async with self.listen(channel) as event:
            relay = asyncio.create_task(_relay(interrupt, event)) if interrupt is not None else None
            try:
                while True:
                    event.clear()
                    mark = self.mark(channel)  # before the read: a wake-up during it is not lost
                    if threads is None:
                        value = await run_in_threadpool(load)
                    else:
                        value = await asyncio.get_running_loop().run_in_executor(threads, load)
                    remaining = deadline - time.monotonic()
                    if changed(value) or remaining <= 0 or (interrupt is not None and interrupt.is_set()):
                        return value
                    await self.wait(event, remaining, channel, mark)
                    if interrupt is not None and interrupt.is_set():
                        return value
                    quiet = not self.polling and not event.is_set()
                    if not reread_at_timeout and quiet and time.monotonic() >= deadline:
                        return value
            finally:
                if relay is not None:
                    relay.cancel()

    def listeners(self, channel: str) -> int:
        """How many requests listen on `channel` now."""
        return len(self._events.get(channel, ()))

    def mark(self, channel: str) -> object:
        """Call before reading the database; pass to `wait` so a wake-up in between is not missed."""
        # a 1-tuple, so "no file yet" (None inside) differs from "no mark given"
        return (_stamp(self._wake_dir / channel),) if self.polling and self._wake_dir is not None else None

    async def wait(self, event: asyncio.Event, timeout: float, channel: str = "", mark: object = None) -> None:
        """Until the channel is woken or `timeout` passes (callers re-read the database either way)."""
        if not self.polling:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), max(timeout, 0.0))
            return
        if self._wake_dir is None or not channel:
            await asyncio.sleep(min(timeout, POLL_SECONDS))
            return
        path = self._wake_dir / channel
        seen = mark[0] if isinstance(mark, tuple) else _stamp(path)
        deadline = time.monotonic() + max(timeout, 0.0)
        while time.monotonic() < deadline:
            await asyncio.sleep(min(POLL_SECONDS, max(deadline - time.monotonic(), 0.0)))
            if _stamp(path) != seen:
                return


async def _relay(source: asyncio.Event, target: asyncio.Event) -> None:
    await source.wait()
    target.set()


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_mtime_ns, stat.st_size + stat.st_ino
