"""Wake-ups: tell a long-polling agent that its work changed, across processes.

With a Redis broker, publishers (routes, scheduler tasks) PUBLISH on `phalanx:wake:<channel>` and
each server process keeps one pattern subscription that sets in-process events. Without Redis
(the embedded default) nothing is published and waiters fall back to re-checking the database
every `POLL_SECONDS`: cheap on SQLite with a handful of agents.

Contract: publish after commit, never inside a transaction; a lost wake-up only delays an agent
until its long-poll times out, because waiters always re-read the database.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import AsyncIterator, Iterable

import redis
import redis.asyncio as aioredis

PREFIX = "phalanx:wake:"
POLL_SECONDS = 0.1
log = logging.getLogger(__name__)


def agent_channel(agent_id: int) -> str:
    return f"agent:{agent_id}"


class Publisher:
    def __init__(self, redis_url: str | None) -> None:
        self._redis = redis.Redis.from_url(redis_url) if redis_url else None

    def publish(self, channels: Iterable[str]) -> None:
        if self._redis is None:
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

    def __init__(self, redis_url: str | None) -> None:
        self._redis_url = redis_url
        self._events: dict[str, set[asyncio.Event]] = defaultdict(set)
        self._task: asyncio.Task[None] | None = None

    @property
    def polling(self) -> bool:
        return self._redis_url is None

    async def start(self) -> None:
        if self._redis_url and self._task is None:
            self._task = asyncio.create_task(self._subscribe(self._redis_url))

    async def stop(self) -> None:
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
    async def listen(self, channel: str) -> AsyncIterator[asyncio.Event]:
        event = asyncio.Event()
        self._events[channel].add(event)
        try:
            yield event
        finally:
            self._events[channel].discard(event)
            if not self._events[channel]:
                del self._events[channel]

    async def wait(self, event: asyncio.Event, timeout: float) -> None:
        timeout = min(timeout, POLL_SECONDS) if self.polling else timeout
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), max(timeout, 0.0))
