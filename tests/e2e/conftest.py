"""The stack most end-to-end tests run on: server, scheduler and two one-slot agents on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import call_failed
from tests.processes import Stack


@pytest.fixture
def stack(clean_db: str, clean_redis: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Stack]:
    running = Stack(tmp_path, clean_db, clean_redis)
    try:
        running.start_server()
        running.start_scheduler()
        running.start_agent("node-a")
        running.start_agent("node-b")
        running.wait_agents(2)
        yield running
        if call_failed(request):
            print(running.dump())  # pytest shows it with the failure
    finally:
        running.close()
