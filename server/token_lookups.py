"""Token lookups in groups: every token that a request or a refresh asked for while the last
query ran is looked up in the next one, a statement per kind of token (`auth.lookup_many`).

At 1,000 agents and 7,000 running attempts, the agents' tokens leave the cache every 30 s and
the ranks' credentials are looked up at their batches' pace: a hundred lookups a second, each a
connection checkout, a statement and a rollback on a database the whole cluster keeps busy. Looked
up one by one on two threads, they queued; the agents' heartbeats waited behind the ranks' past
the agents' timeout, and the reaper declared agents lost. Grouped, they are a few queries a second.

Contract: `principal(token)` returns who the token belongs to (None: nobody), exactly as
`auth.lookup` would, and caches it; `refresh(token)` looks a cached token up again without
anyone waiting (`TokenCache.get_refreshing` asked for it). Both are called from the event loop.
A failed query fails its requests (the route answers 5xx; the clients retry) and leaves the
refreshed entries to expire.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor
from dataclasses import dataclass, field

from sqlalchemy.orm import Session, sessionmaker

from server.auth import Principal, TokenCache, hash_token, lookup_many

log = logging.getLogger(__name__)


@dataclass
class _Asked:
    answers: list[asyncio.Future[Principal | None]] = field(default_factory=list)
    refresh: bool = False  # a cached entry's lookup ahead of its expiry


class TokenLookups:
    def __init__(self, sessions: sessionmaker[Session], cache: TokenCache, threads: Executor) -> None:
        self._sessions = sessions
        self._cache = cache
        self._threads = threads
        self._waiting: dict[str, _Asked] = {}
        self._runner: asyncio.Task[None] | None = None

    async def principal(self, token: str) -> Principal | None:
        answer: asyncio.Future[Principal | None] = asyncio.get_running_loop().create_future()
        self._ask(token).answers.append(answer)
        return await answer

    def refresh(self, token: str) -> None:
        self._ask(token).refresh = True

    def _ask(self, token: str) -> _Asked:
        asked = self._waiting.setdefault(token, _Asked())
        if self._runner is None or self._runner.done():
            self._runner = asyncio.get_running_loop().create_task(self._run_while_waiting())
        return asked

    async def _run_while_waiting(self) -> None:
        while self._waiting:
            batch, self._waiting = self._waiting, {}
            try:
                found = await asyncio.get_running_loop().run_in_executor(self._threads, self._lookup, list(batch))
            except Exception as exc:
                log.warning("could not look %d tokens up: %s", len(batch), exc)
                for token, asked in batch.items():
                    if asked.refresh:
                        self._cache.refresh_failed(hash_token(token))
                    for answer in asked.answers:
                        if not answer.done():
                            answer.set_exception(exc)
                continue
            for token, asked in batch.items():
                principal = found.get(token)
                if asked.refresh:
                    self._cache.refreshed(hash_token(token), principal)
                elif principal is not None:
                    self._cache.put(hash_token(token), principal)
                for answer in asked.answers:
                    if not answer.done():  # its request may have been cancelled
                        answer.set_result(principal)

    def _lookup(self, tokens: list[str]) -> dict[str, Principal | None]:
        with self._sessions() as session:
            return lookup_many(session, tokens)
