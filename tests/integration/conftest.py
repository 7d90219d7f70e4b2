"""What the dashboard's integration tests share: the app on a real PostgreSQL with one agent
registered (two CPU slots), nothing enqueued."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.settings import Settings
from tests.conftest import AGENT_TOKEN

AGENT = {"Authorization": f"Bearer {AGENT_TOKEN}"}


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    """Modules with a `client` of their own (other agents, an enqueue recorder) override it."""
    with TestClient(create_app(settings, enqueue=lambda *_, **__: None), follow_redirects=False) as test_client:
        body = {"name": "a0", "address": "127.0.0.1", "cpu_slots": 2}
        assert test_client.post("/api/v1/agents/register", json=body, headers=AGENT).status_code == 200
        yield test_client
