"""Tokens in use are looked up again before they leave a process's cache, on the auth threads,
while the requests are answered from the cache: an agent's heartbeats never wait for a lookup, and
a token that no longer holds (its agent registered again through another replica) leaves the cache
at that lookup."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, update

from server import auth
from server.db import session_scope
from server.models import Agent, Allocation
from server.settings import Settings
from tests.agent_tokens import as_agent, as_rank, register_agent
from tests.conftest import ADMIN_TOKEN
from tests.integration.test_api import USER
from tests.integration.test_fair_share import schedule, submit
from tests.processes import wait_for
from tests.unit.test_token_cache import Clock


def test_a_token_in_use_is_looked_up_again_while_its_heartbeats_are_answered_from_the_cache(
    client: TestClient, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    monkeypatch.setattr(auth, "time", clock)
    agent_id = register_agent(client, "refreshed")
    headers = as_agent(agent_id)
    token_hash = auth.hash_token(headers["Authorization"].removeprefix("Bearer "))
    cache = client.app.state.services.token_cache  # type: ignore[attr-defined]
    assert client.post(f"/api/v1/agents/{agent_id}/heartbeat", headers=headers).status_code == 204

    with session_scope(settings.database_url) as session:  # registered again through another replica
        session.execute(update(Agent).where(Agent.id == agent_id).values(credential_hash=auth.hash_token("new")))
    assert client.post(f"/api/v1/agents/{agent_id}/heartbeat", headers=headers).status_code == 204, "cached"

    clock.now += 21  # in the last third of its 30 s
    assert client.post(f"/api/v1/agents/{agent_id}/heartbeat", headers=headers).status_code == 204, "not waited for"
    wait_for(lambda: cache.get(token_hash) is None, 10, "the lookup to drop the old token", interval=0.01)
    assert client.post(f"/api/v1/agents/{agent_id}/heartbeat", headers=headers).status_code == 401


def test_tokens_looked_up_together_are_found_as_one_by_one(client: TestClient, settings: Settings) -> None:
    agent_id = register_agent(client, "grouped")
    submit(client, USER, "grouped")
    schedule(settings)
    with session_scope(settings.database_url) as session:
        allocation_id = session.scalars(select(Allocation.id)).one()
    rank = as_rank(client, allocation_id)["Authorization"].removeprefix("Bearer ")
    agent = as_agent(agent_id)["Authorization"].removeprefix("Bearer ")
    tokens = [
        agent,
        rank,
        ADMIN_TOKEN,
        auth.agent_token(agent_id, "not-its-secret"),
        auth.agent_token(agent_id + 1000, "no-such-agent"),
        auth.rank_token(allocation_id, "not-its-credential"),
        auth.rank_token(allocation_id + 1000, "no-such-allocation"),
        "phx_u_no-such-token",
        "phx_n_malformed",
    ]
    with session_scope(settings.database_url) as session:
        together = auth.lookup_many(session, tokens)
        one_by_one = {token: auth.lookup(session, token) for token in tokens}
    assert together == one_by_one
    assert {token for token, principal in together.items() if principal is not None} == {agent, rank, ADMIN_TOKEN}
