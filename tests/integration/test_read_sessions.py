"""Reads that write nothing run each statement in autocommit on PostgreSQL
(`db.read_session_factory`): no BEGIN and COMMIT round trips. The connection goes back to the
pool as it came, and the next session that writes has its transaction again."""

from __future__ import annotations

from sqlalchemy import text

from server.db import engine_for, read_session_factory, session_factory
from server.settings import Settings


def test_a_read_runs_in_autocommit_and_leaves_the_pool_s_connections_transactional(settings: Settings) -> None:
    engine = engine_for(settings.database_url)
    engine.dispose()
    reads, writes = read_session_factory(settings.database_url), session_factory(settings.database_url)
    with reads() as session, session.begin():
        session.execute(text("SELECT 1"))
        assert session.connection().connection.dbapi_connection.autocommit  # type: ignore[union-attr]
    with writes() as session:
        with session.begin():
            session.execute(text("CREATE TEMPORARY TABLE scratch (n int) ON COMMIT PRESERVE ROWS"))
        session.begin()
        assert not session.connection().connection.dbapi_connection.autocommit  # type: ignore[union-attr]
        session.execute(text("INSERT INTO scratch VALUES (1)"))
        session.rollback()
        assert session.execute(text("SELECT count(*) FROM scratch")).scalar_one() == 0, "the insert was committed"
    assert engine.pool.checkedout() == 0
