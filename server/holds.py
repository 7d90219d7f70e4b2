"""How many requests this server process holds open, and the caps on them.

A held request (a Server-Sent Event stream, a long-poll) costs a connection, a wake-up listener
and a slot in the server's event loop for as long as it lasts, while it asks nothing of the
database: without a cap one client can hold thousands. Each holder (a user, or one agent for its
work long-poll) may hold `per_holder`, all of them together `total`; a request past either is
refused with 429 and a Retry-After before anything is held.

Contract: counts are per process (each server process has its own caps) and in memory only: a
restarted server starts from zero, which is right, since its connections went with it. Safe from
any thread. `hold()` releases on every exit path; a stream's slot is released when its response
ends, whether it finished, failed, or the client went away (`HeldEventSource`).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sse_starlette import EventSourceResponse
from starlette.types import Receive, Scope, Send

from server.errors import TooManyRequests

# Long-polls end within the work poll (20 s) and streams are long-lived: a few seconds lets the
# client come back soon without hammering a server that is at its cap.
RETRY_AFTER_S = 5


class HeldRequests:
    def __init__(self, per_holder: int, total: int) -> None:
        self.per_holder = per_holder
        self.total = total
        self._lock = threading.Lock()
        self._held: Counter[str] = Counter()

    def acquire(self, holder: str, what: str) -> None:
        """Count one more request of `holder` (a name for messages: "user alice", "agent 3"), or
        raise `TooManyRequests` saying which cap it met. `what`: the request, for the message."""
        with self._lock:
            if self._held[holder] >= self.per_holder:
                raise TooManyRequests(
                    f"refused {what}: {holder} already holds {self._held[holder]} streams and long-polls, the "
                    f"limit per holder (PHALANX_MAX_HELD_REQUESTS_PER_HOLDER); close one (a dashboard tab, a "
                    f"watching command) or retry in {RETRY_AFTER_S} s",
                    retry_after=RETRY_AFTER_S,
                )
            if self._held.total() >= self.total:
                raise TooManyRequests(
                    f"refused {what}: the server holds {self._held.total()} streams and long-polls, its limit "
                    f"(PHALANX_MAX_HELD_REQUESTS); retry in {RETRY_AFTER_S} s",
                    retry_after=RETRY_AFTER_S,
                )
            self._held[holder] += 1

    def release(self, holder: str) -> None:
        with self._lock:
            self._held[holder] -= 1
            if self._held[holder] <= 0:
                del self._held[holder]

    @contextmanager
    def hold(self, holder: str, what: str) -> Iterator[None]:
        self.acquire(holder, what)
        try:
            yield
        finally:
            self.release(holder)

    def held(self, holder: str | None = None) -> int:
        with self._lock:
            return self._held.total() if holder is None else self._held[holder]

    def by_kind(self) -> Counter[str]:
        """Requests held now by kind of holder (a holder's name starts with its kind: "user",
        "agent", ...): what `/metrics` reports of each replica."""
        kinds: Counter[str] = Counter()
        with self._lock:
            for holder, count in self._held.items():
                kinds[holder.split(" ", 1)[0]] += count
        return kinds


class HeldEventSource(EventSourceResponse):
    """An SSE response holding its slot from the route (acquired before the response was made, so
    a refusal is a plain 429) until the response ends, however it ends."""

    def __init__(self, content: Any, holds: HeldRequests, holder: str, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._holds = holds
        self._holder = holder

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._holds.release(self._holder)
