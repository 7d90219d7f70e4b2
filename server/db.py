"""The one place that makes engines and sessions, and that migrates and checks the schema:
Phalanx's Alembic revisions and Optuna's tables (its RDBStorage shares the database).

Contract: callers own their transactions (`with session_scope(...)` or a route's session); the
functions that read and write rows (`server.lifecycle`, `studies`, `ingest`, `checkpoints`,
`views`, ...) take a session and only flush. This module imports nothing of Phalanx's but the
models (lazily): `server.tuning` builds on it, never the other way round.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, inspect, make_url, select
from sqlalchemy.orm import Session, sessionmaker

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
# Optuna's RDBStorage keeps its own `alembic_version` in the same database; ours must not collide.
VERSION_TABLE = "phalanx_alembic_version"
OPTUNA_MARKER_TABLE = "version_info"  # Optuna's schema version; present once its tables exist


class SchemaOutOfDate(RuntimeError):
    pass


# Phalanx's own option in a PostgreSQL URL, taken out before the URL reaches the driver: psycopg
# prepares a statement on the server after its fifth run on a connection, and behind PgBouncer in
# transaction mode (before 1.21) the next transaction may get another server connection, which
# has no such statement or one by the same name ("prepared statement "_pg3_0" does not exist").
# `?prepare_threshold=none` turns that off; a number sets psycopg's threshold.
PREPARE_THRESHOLD = "prepare_threshold"


def driver_options(url: str) -> tuple[str, dict[str, Any]]:
    """`url` without Phalanx's own options, and those options as the driver's connect arguments.
    Raises ValueError naming the option when its value is neither a count nor `none`."""
    if url.startswith("sqlite") or f"{PREPARE_THRESHOLD}=" not in url:
        return url, {}
    parsed = make_url(url)
    value = parsed.query.get(PREPARE_THRESHOLD)
    if value is None:
        return url, {}
    if not isinstance(value, str):
        raise ValueError(f"the database URL gives {PREPARE_THRESHOLD} more than once; give it once")
    stripped = parsed.difference_update_query([PREPARE_THRESHOLD]).render_as_string(hide_password=False)
    if value.lower() in ("none", "off", ""):
        return stripped, {PREPARE_THRESHOLD: None}
    if not value.isdigit():
        raise ValueError(
            f"the database URL's {PREPARE_THRESHOLD}={value!r} is neither a count nor 'none' "
            "('none' behind PgBouncer in transaction mode)"
        )
    return stripped, {PREPARE_THRESHOLD: int(value)}


def make_engine(url: str, **kwargs: Any) -> Engine:
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False}, **kwargs)
        sqlite_pragmas(engine)
        return engine
    url, connect_args = driver_options(url)
    if connect_args:
        kwargs["connect_args"] = {**connect_args, **kwargs.get("connect_args", {})}
    if "poolclass" not in kwargs:
        # At least the server's worker threads (`Settings.worker_threads`): connections over
        # pool_size are opened and closed per checkout, each a PostgreSQL backend forked and torn
        # down (with 40 threads on 10 connections, a third of the server's time at 1,000 agents).
        kwargs.setdefault("pool_size", 10)
        kwargs.setdefault("max_overflow", 20)
    return create_engine(url, pool_pre_ping=True, **kwargs)


def sqlite_pragmas(engine: Engine) -> None:
    # pysqlite's own transaction handling defers BEGIN and upgrades read locks to write locks late,
    # which deadlocks two writers; take the write lock up front instead (SQLAlchemy's recipe).
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


@lru_cache(maxsize=8)
def engine_for(url: str) -> Engine:
    return make_engine(url)


def session_factory(url: str) -> sessionmaker[Session]:
    return sessionmaker(engine_for(url), expire_on_commit=False)


@contextmanager
def session_scope(url: str) -> Iterator[Session]:
    """A session whose transaction commits on success and rolls back on error."""
    with session_factory(url)() as session, session.begin():
        yield session


def alembic_config(url: str) -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    cfg.attributes["version_table"] = VERSION_TABLE
    return cfg


def optuna_storage_options(url: str) -> tuple[str, dict[str, Any]]:
    """The URL and engine options of an Optuna RDBStorage on `url` (the migration's and
    `server.tuning`'s): Phalanx's own options in the URL become the driver's, as in `make_engine`."""
    if url.startswith("sqlite"):
        return url, {"connect_args": {"timeout": 30, "check_same_thread": False}}
    url, connect_args = driver_options(url)
    return url, {"pool_pre_ping": True, "pool_size": 4, "max_overflow": 4, "connect_args": connect_args}


def upgrade(url: str, revision: str = "head") -> None:
    """Phalanx's migrations, then Optuna's tables (studies keep their trials there)."""
    from alembic import command

    command.upgrade(alembic_config(url), revision)
    if revision == "head":
        upgrade_optuna(url)


def upgrade_optuna(url: str) -> None:
    """Create Optuna's tables (or bring them to this Optuna's version). Migration time only."""
    from optuna.storages import RDBStorage  # ≈0.4 s: paid here only by whoever migrates

    storage_url, engine_kwargs = optuna_storage_options(url)
    storage = RDBStorage(storage_url, engine_kwargs=engine_kwargs, skip_compatibility_check=True)
    try:
        if storage.get_current_version() != storage.get_head_version():
            storage.upgrade()
    finally:
        storage.engine.dispose()


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
    assert head is not None
    return head


def current_revision(url: str) -> str | None:
    from alembic.migration import MigrationContext

    with engine_for(url).connect() as conn:
        context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        return context.get_current_revision()


def check_schema(url: str) -> None:
    """Refuse to run on an unmigrated or older schema, saying which command fixes it."""
    current, head = current_revision(url), head_revision()
    if current != head:
        state = "has no Phalanx schema" if current is None else f"is at revision {current}"
        raise SchemaOutOfDate(
            f"the database {state}, but this Phalanx needs revision {head}. "
            "Run `phalanx db upgrade` (with the same PHALANX_DATABASE_URL) and start again."
        )
    check_optuna_schema(url)


def check_optuna_schema(url: str) -> None:
    if OPTUNA_MARKER_TABLE not in inspect(engine_for(url)).get_table_names():
        raise SchemaOutOfDate(
            "the database has no Optuna tables (hyperparameter studies keep their trials there). "
            "Run `phalanx db upgrade` (with the same PHALANX_DATABASE_URL) and start again."
        )


SERVER_STARTED = "server_started"


def mark_server_start(session: Session) -> None:
    """Agents could not heartbeat while no server ran; the reaper reads this to grant them grace."""
    from server.models import ControlPlane, utcnow

    row = session.get(ControlPlane, SERVER_STARTED)
    now = session.execute(select(utcnow())).scalar_one()
    if row is None:
        session.add(ControlPlane(key=SERVER_STARTED, time=now))
    else:
        row.time = now
