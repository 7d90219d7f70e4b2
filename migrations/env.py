"""Alembic environment: URL and version table come from `server.db.alembic_config`."""

from __future__ import annotations

from alembic import context
from sqlalchemy import pool

from server.db import VERSION_TABLE, make_engine
from server.models import Base

config = context.config
target_metadata = Base.metadata


def only_ours(name: str | None, type_: str, parent_names: object) -> bool:
    """Optuna's tables share the database; autogenerate must neither drop nor compare them."""
    return type_ != "table" or name in target_metadata.tables


def run_migrations_online() -> None:
    url = config.get_main_option("sqlalchemy.url")
    assert url
    connectable = make_engine(url, poolclass=pool.NullPool)
    with connectable.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            version_table=VERSION_TABLE,
            render_as_batch=connection.dialect.name == "sqlite",
            compare_type=True,
            include_name=only_ours,
        )
        with context.begin_transaction():
            context.run_migrations()


run_migrations_online()
