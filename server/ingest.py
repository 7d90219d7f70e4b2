"""Bulk writes on the hot path: metric points. COPY on PostgreSQL, executemany elsewhere."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import insert
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from phalanx.schemas import MetricRecord
from server.models import Metric, MetricBatch

METRIC_COLUMNS = ("job_id", "allocation_id", "rank", "step", "name", "value", "time")
COPY_METRICS = f"COPY metrics ({', '.join(METRIC_COLUMNS)}) FROM STDIN"


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
    else:  # Core executemany: the ORM's bulk insert costs several times more CPU per row
        session.execute(
            insert(Metric.metadata.tables["metrics"]), [dict(zip(METRIC_COLUMNS, row, strict=True)) for row in rows]
        )


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
