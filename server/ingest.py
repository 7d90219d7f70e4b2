"""Bulk writes on the hot path: metric points. COPY on PostgreSQL, executemany elsewhere."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import ColumnElement, cast, func, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Session

from phalanx.schemas import MetricRecord
from server.models import Allocation, MetricBatch, utcnow

METRIC_COLUMNS = ("job_id", "allocation_id", "rank", "step", "name", "value", "time")
COPY_METRICS = f"COPY metrics ({', '.join(METRIC_COLUMNS)}) FROM STDIN"
INSERT_METRICS = f"INSERT INTO metrics ({', '.join(METRIC_COLUMNS)}) VALUES ({', '.join('?' * len(METRIC_COLUMNS))})"
SQLITE_TIME = "%Y-%m-%d %H:%M:%S.%f"  # how SQLAlchemy's DateTime stores a time in SQLite


def from_unix(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC).replace(tzinfo=None)


def metric_rows(job_id: int, allocation_id: int, records: list[MetricRecord]) -> list[tuple[Any, ...]]:
    rows = []
    for record in records:
        when = from_unix(record.time)
        for name, value in record.values.items():
            rows.append((job_id, allocation_id, record.rank, record.step, name, value, when))
    return rows


def insert_metrics(session: Session, rows: list[tuple[Any, ...]]) -> None:
    if not rows:
        return
    connection = session.connection()
    if connection.dialect.name == "postgresql":
        raw = connection.connection.driver_connection
        assert raw is not None
        with raw.cursor() as cursor, cursor.copy(COPY_METRICS) as copy:
            for row in rows:
                copy.write_row(row)
    else:
        # sqlite3's own executemany, the time formatted as SQLAlchemy stores it: in the embedded
        # mode the server shares the cores with training, and this costs a fraction of the CPU
        # of SQLAlchemy's executemany (which processes every parameter of every row).
        connection.exec_driver_sql(INSERT_METRICS, [(*row[:-1], row[-1].strftime(SQLITE_TIME)) for row in rows])


def record_progress(session: Session, allocation_id: int, records: list[MetricRecord]) -> None:
    """Stamp progress (database clock, for hang detection) and merge the batch's newest values
    into the allocation's latest metrics, in one UPDATE: the merge happens in the database, so
    concurrent batches need no lock beyond the row lock this statement takes until commit."""
    latest: dict[str, float] = {}
    for record in records:
        latest.update(record.values)
    step = max((record.step for record in records), default=None)
    values: dict[str, Any] = {"last_progress_at": utcnow()}
    merged: ColumnElement[Any]
    if latest:
        if session.get_bind().dialect.name == "postgresql":
            merged = func.coalesce(Allocation.latest_metrics, cast({}, JSONB)).op("||")(cast(latest, JSONB))
            newest = func.greatest(func.coalesce(Allocation.latest_step, step), step)
        else:
            merged = func.json_patch(func.coalesce(Allocation.latest_metrics, "{}"), json.dumps(latest))
            newest = func.max(func.coalesce(Allocation.latest_step, step), step)
        values.update(latest_metrics=merged, latest_step=newest)
    session.execute(update(Allocation).where(Allocation.id == allocation_id).values(**values))


def first_delivery(session: Session, allocation_id: int, batch_id: str) -> bool:
    """Record a batch id; False when it was recorded before (the sender retried a stored batch)."""
    dialect = session.get_bind().dialect.name
    make = postgresql.insert if dialect == "postgresql" else sqlite.insert
    statement = (
        make(MetricBatch)
        .values(allocation_id=allocation_id, batch_id=batch_id)
        .on_conflict_do_nothing()
        .returning(MetricBatch.batch_id)
    )
    return session.execute(statement).first() is not None
