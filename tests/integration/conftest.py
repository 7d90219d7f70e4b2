"""What the integration tests share: the app on a real PostgreSQL with one agent registered (two
CPU slots), nothing enqueued; and the app on each store (`any_store`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.db import engine_for, upgrade
from server.settings import Settings
from tests.agent_tokens import register_agent
from tests.conftest import ADMIN_TOKEN, AGENT_TOKEN


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    """Modules with a `client` of their own (other agents, an enqueue recorder) override it."""
    with TestClient(create_app(settings, enqueue=lambda *_, **__: None), follow_redirects=False) as test_client:
        body = {"name": "a0", "address": "127.0.0.1", "cpu_slots": 2}
        register_agent(test_client, **body)
        yield test_client


@pytest.fixture(params=["postgresql", "sqlite"])
def any_store(
    request: pytest.FixtureRequest, settings: Settings, tmp_path: Path
) -> Iterator[tuple[TestClient, Settings]]:
    """The app on PostgreSQL, and on the embedded SQLite (which stores a bound NaN as NULL)."""
    if request.param == "sqlite":
        settings = Settings(data_dir=tmp_path / "embedded", admin_token=ADMIN_TOKEN, agent_token=AGENT_TOKEN)
        upgrade(settings.database_url)
    with TestClient(create_app(settings, enqueue=lambda *_, **__: None)) as test_client:
        yield test_client, settings
    if request.param == "sqlite":
        engine_for(settings.database_url).dispose()
