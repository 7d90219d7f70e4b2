"""Models and migrations agree, on PostgreSQL and on the embedded SQLite."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic import command
from sqlalchemy import inspect

from server.db import VERSION_TABLE, alembic_config, check_schema, engine_for, upgrade

pytestmark = pytest.mark.integration


def test_postgres_schema_matches_the_models(pg_url: str) -> None:
    command.check(alembic_config(pg_url))  # raises if autogenerate would emit any operation
    check_schema(pg_url)


def test_sqlite_migrates_from_empty_and_matches(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'embedded.db'}"
    upgrade(url)
    command.check(alembic_config(url))
    check_schema(url)
    tables = set(inspect(engine_for(url)).get_table_names())
    # our version table never collides with Optuna's `alembic_version` in the same database
    assert VERSION_TABLE in tables and "alembic_version" not in tables
