"""Bulk writes on the hot path: metric points (COPY on PostgreSQL, executemany elsewhere), and
the batch ids that make a resent metric or log batch a no-op.

A value may be NaN or ±inf (`server.float_columns` says how each store keeps them): these writes
bypass the column types, so they encode the same way by hand.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import ColumnElement, cast, func, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Session

from phalanx import _wire
from phalanx.schemas import MetricRecord
from server.models import Allocation, LogBatch, MetricBatch, utcnow

METRIC_COLUMNS = ("job_id", "allocation_id", "rank", "step", "name", "value", "time")
COPY_METRICS = f"COPY metrics ({', '.join(METRIC_COLUMNS)}) FROM STDIN"
INSERT_METRICS = f"INSERT INTO metrics ({', '.join(METRIC_COLUMNS)}) VALUES ({', '.join('?' * len(METRIC_COLUMNS))})"


def from_unix(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC).replace(tzinfo=None)


def metric_rows(job_id: int, allocation_id: int, records: list[MetricRecord]) -> list[tuple[Any, ...]]:
    """One row per value, in METRIC_COLUMNS order, the time as a naive UTC datetime (for COPY)."""
    rows = []
    for record in records:
        when = from_unix(record.time)
        for name, value in record.values.items():
            rows.append((job_id, allocation_id, record.rank, record.step, name, value, when))
    return rows


def sqlite_metric_rows(job_id: int, allocation_id: int, records: list[MetricRecord]) -> list[tuple[Any, ...]]:
    """`metric_rows` with the time already in the text form SQLAlchemy's DateTime stores in SQLite
    ("YYYY-MM-DD HH:MM:SS.ffffff"), formatted once per record: in the embedded mode the server
    shares the cores with training, and strftime per value was a third of this route's CPU."""
    rows = []
    for record in records:
        when = from_unix(record.time).isoformat(" ", "microseconds")
        for name, value in record.values.items():
            # (sqlite3 binds NaN as NULL; infinities it stores as they are)
            stored = value if value == value else _wire.NAN
            rows.append((job_id, allocation_id, record.rank, record.step, name, stored, when))
    return rows


def insert_metrics(session: Session, job_id: int, allocation_id: int, records: list[MetricRecord]) -> None:
    insert_metric_batches(session, [(job_id, allocation_id, records)])


def insert_metric_batches(session: Session, batches: Sequence[tuple[int, int, list[MetricRecord]]]) -> None:
    """Every point of the (job id, allocation id, records) batches, in one COPY (PostgreSQL) or
    one executemany."""
    if not any(records for _, _, records in batches):
        return
    connection = session.connection()
    if connection.dialect.name == "postgresql":
        raw = connection.connection.driver_connection
        assert raw is not None
        with raw.cursor() as cursor, cursor.copy(COPY_METRICS) as copy:
            for job_id, allocation_id, records in batches:
                for row in metric_rows(job_id, allocation_id, records):
                    copy.write_row(row)
    else:
        # sqlite3's own executemany: a fraction of the CPU of SQLAlchemy's, which processes every
        # parameter of every row.
        rows = [row for job_id, a, records in batches for row in sqlite_metric_rows(job_id, a, records)]
        if rows:
            connection.exec_driver_sql(INSERT_METRICS, rows)


def record_progress(session: Session, allocation_id: int, records: list[MetricRecord]) -> None:
    """Stamp progress (database clock, for hang detection) and merge the batch's newest values
    into the allocation's latest metrics, in one UPDATE: the merge happens in the database, so
    concurrent batches need no lock beyond the row lock this statement takes until commit."""
    by_name: dict[str, float] = {}
    for record in records:
        by_name.update(record.values)
    latest = _wire.encode_floats(by_name)  # JSON: NaN and infinities as strings (`FloatsJSON`)
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


def batch_identity(batch_id: str | None, raw: bytes) -> str:
    """The sender's id for a batch or, when it gave none, a digest of the body: a resend of the
    same bytes is then recognised too. (Prefixed: no sender's id of 64 characters can equal it.)"""
    if batch_id is not None:
        return batch_id
    return "body-" + hashlib.blake2b(raw, digest_size=16).hexdigest()


def first_deliveries(
    session: Session, table: type[MetricBatch | LogBatch], batches: Collection[tuple[int, str]]
) -> set[tuple[int, str]]:
    """Record each (allocation id, batch id) in `table` (MetricBatch or LogBatch), in one
    statement; those recorded now. One recorded before is left out: its sender retried a batch
    whose answer it lost. The primary key decides, so two deliveries racing on two connections
    store it once too: the second waits for the first's commit."""
    if not batches:
        return set()
    dialect = session.get_bind().dialect.name
    make = postgresql.insert if dialect == "postgresql" else sqlite.insert
    statement = (
        make(table)
        .values([{"allocation_id": allocation_id, "batch_id": batch_id} for allocation_id, batch_id in sorted(batches)])
        .on_conflict_do_nothing()
        .returning(table.allocation_id, table.batch_id)
    )
    return {(allocation_id, batch_id) for allocation_id, batch_id in session.execute(statement)}
