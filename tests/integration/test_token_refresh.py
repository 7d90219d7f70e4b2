"""Tokens in use are looked up again before they leave a process's cache, on the auth threads,
while the requests are answered from the cache: an agent's heartbeats never wait for a lookup, and
a token that no longer holds (its agent registered again through another replica) leaves the cache
at that lookup."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from server import auth
from server.db import session_scope
from server.models import Agent
from server.settings import Settings
from tests.agent_tokens import as_agent, register_agent
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
