"""The pool pings a connection that sat idle before handing it out (`server.db.ping_idle_connections`):
one whose backend is gone (a database restart, a dropped connection) is replaced, not handed to a
transaction that would fail."""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy import Engine, text

from server import db
from server.settings import Settings


def backend_pid(engine: Engine) -> int:
    with engine.connect() as connection:
        return int(connection.execute(text("SELECT pg_backend_pid()")).scalar_one())


def test_an_idle_connection_whose_backend_is_gone_is_replaced(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = db.make_engine(settings.database_url, pool_size=1, max_overflow=0)
    try:
        gone = backend_pid(engine)
        assert backend_pid(engine) == gone, "the pool hands the same connection out again"
        dsn = settings.database_url.replace("postgresql+psycopg://", "postgresql://")
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (gone,))
        monkeypatch.setattr(db, "IDLE_BEFORE_PING_S", 0.0)  # as if it had sat in the pool a while
        replaced = backend_pid(engine)
        assert replaced != gone
    finally:
        engine.dispose()
