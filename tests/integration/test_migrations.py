"""Models and migrations agree, on PostgreSQL and on the embedded SQLite."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic import command
from optuna.storages import RDBStorage
from sqlalchemy import inspect

from server.db import VERSION_TABLE, SchemaOutOfDate, alembic_config, check_schema, engine_for, upgrade

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
    # Optuna's tables are created at migration time beside ours, and its `alembic_version` never
    # collides with our version table
    assert {VERSION_TABLE, "alembic_version", "studies", "trials", "tuning_studies", "tuning_trials"} <= tables
    storage = RDBStorage(url, skip_table_creation=True)  # raises if Optuna's schema is not current
    assert storage.get_current_version() == storage.get_head_version()
    storage.engine.dispose()


def test_server_refuses_a_database_without_optunas_tables(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'no-optuna.db'}"
    command.upgrade(alembic_config(url), "head")  # ours only, as a Phalanx before studies did
    with pytest.raises(SchemaOutOfDate, match="phalanx db upgrade"):
        check_schema(url)
    upgrade(url)
    check_schema(url)
