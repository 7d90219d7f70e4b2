"""What the dashboard's integration tests share: the app on a real PostgreSQL with one agent
registered (two CPU slots), nothing enqueued."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.settings import Settings
from tests.agent_tokens import register_agent


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    """Modules with a `client` of their own (other agents, an enqueue recorder) override it."""
    with TestClient(create_app(settings, enqueue=lambda *_, **__: None), follow_redirects=False) as test_client:
        body = {"name": "a0", "address": "127.0.0.1", "cpu_slots": 2}
        register_agent(test_client, **body)
        yield test_client
