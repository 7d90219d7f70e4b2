"""The per-process token cache (`server.auth.TokenCache`): bounded, and never emptied whole. A
cache cleared when it filled sent every agent's next heartbeat to a database lookup at once."""

from __future__ import annotations

import pytest

from server import auth
from server.auth import MAX_CACHED_TOKENS, Principal, TokenCache, agent_principal, rank_principal


def user(token_id: int) -> Principal:
    return Principal(kind="user", token_id=token_id, name="ada", user_id=1, is_admin=False)


def test_a_full_cache_keeps_its_newest_tokens() -> None:
    cache = TokenCache()
    agents = [f"agent-{i}" for i in range(1000)]
    for i, token_hash in enumerate(agents, start=1):
        cache.put(token_hash, agent_principal(i))
    for allocation_id in range(1, MAX_CACHED_TOKENS + 1):  # an attempt's credential each
        cache.put(f"rank-{allocation_id}", rank_principal(allocation_id))
    assert len(cache) <= MAX_CACHED_TOKENS
    assert cache.get(f"rank-{MAX_CACHED_TOKENS}") == rank_principal(MAX_CACHED_TOKENS)
    assert cache.get(f"rank-{MAX_CACHED_TOKENS // 2}") is not None, "more than the oldest were dropped"
    assert cache.get("agent-1") is None, "the oldest go first"


def test_the_expired_go_before_the_oldest(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = TokenCache(capacity=10)
    cache.put("oldest", agent_principal(1))
    monkeypatch.setattr(auth, "_CACHE_SECONDS", -1.0)  # users' tokens put now are expired at once
    for token_id in range(5):
        cache.put(f"expired-{token_id}", user(token_id))
    monkeypatch.undo()
    for allocation_id in range(1, 6):
        cache.put(f"rank-{allocation_id}", rank_principal(allocation_id))
    assert len(cache) == 6 and cache.get("oldest") == agent_principal(1)


def test_forgetting_a_token_drops_each_of_its_hashes() -> None:
    cache = TokenCache()
    cache.put("before-registering-again", agent_principal(7))
    cache.put("after-registering-again", agent_principal(7))
    cache.put("another-agent", agent_principal(8))
    cache.forget(auth.agent_token_id(7))
    assert cache.get("before-registering-again") is None and cache.get("after-registering-again") is None
    assert cache.get("another-agent") == agent_principal(8)
    assert len(cache) == 1


class Clock:
    """`server.auth`'s time, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(auth, "time", fake)
    return fake


def test_a_token_in_use_is_looked_up_again_once_in_its_last_third(clock: Clock) -> None:
    cache = TokenCache()
    cache.put("agent", agent_principal(1))  # 30 s
    assert cache.get_refreshing("agent") == (agent_principal(1), False)
    clock.now += 21
    assert cache.get_refreshing("agent") == (agent_principal(1), True), "due: the caller looks it up"
    assert cache.get_refreshing("agent") == (agent_principal(1), False), "one lookup at a time"
    cache.refreshed("agent", agent_principal(1))
    clock.now += 21
    assert cache.get("agent") == agent_principal(1), "renewed by the lookup"
    assert cache.get_refreshing("agent", refresh=False) == (agent_principal(1), False)


def due_for_its_lookup(clock: Clock) -> TokenCache:
    """A cache whose agent token "agent" (agent 1) was just handed out for its lookup."""
    cache = TokenCache()
    cache.put("agent", agent_principal(1))
    clock.now += 25
    assert cache.get_refreshing("agent") == (agent_principal(1), True)
    return cache


def test_a_lookup_that_no_longer_finds_the_token_drops_it(clock: Clock) -> None:
    cache = due_for_its_lookup(clock)
    cache.refreshed("agent", None)  # registered again elsewhere: a new token
    assert cache.get("agent") is None


def test_a_token_forgotten_during_its_lookup_is_not_put_back(clock: Clock) -> None:
    cache = due_for_its_lookup(clock)
    cache.forget(auth.agent_token_id(1))  # revoked while the lookup ran on the old rows
    cache.refreshed("agent", agent_principal(1))
    assert cache.get("agent") is None


def test_a_failed_lookup_is_asked_for_again_and_the_entry_kept_until_its_time(clock: Clock) -> None:
    cache = due_for_its_lookup(clock)
    cache.refresh_failed("agent")
    assert cache.get_refreshing("agent") == (agent_principal(1), True)
    clock.now += 5
    assert cache.get_refreshing("agent") == (None, False), "expired: looked up on the request's own path"
