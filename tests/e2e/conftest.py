"""The stack most end-to-end tests run on: server, scheduler and two one-slot agents on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import call_failed
from tests.processes import Stack, two_agent_stack


@pytest.fixture
def stack(clean_db: str, clean_redis: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Stack]:
    with two_agent_stack(tmp_path, clean_db, clean_redis) as running:
        yield running
        if call_failed(request):  # a failing test's exception never reaches this generator
            print(running.dump())  # pytest shows it with the failure
