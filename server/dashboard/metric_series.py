"""A job's metrics as chart series: one series per metric (x = step), downsampled on the server.

A metric that several ranks report is charted from rank 0, or else from the lowest rank that
reports it, so a chart has one point per reported step.
Points of a failed attempt that a resumed attempt re-did (`superseded`) are left out.

Long series are downsampled with LTTB (largest triangle three buckets, via tsdownsample's
compiled implementation): it keeps the points that shape the line, peaks and dips included, so
a 100,000-step chart of 2,000 points looks like the full one. Live updates after the first load
send every new point (see `live.py`); the cursor is the highest metric id the load saw.

A NaN or infinite value is sent as its wire string ("NaN", "Infinity", "-Infinity"): the chart
breaks its line there and names the value on hover. Downsampling keeps where each run of them
starts, so a long series still shows where it went bad.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sqlalchemy import func, select
from sqlalchemy.orm import Session
from tsdownsample import LTTBDownsampler

from phalanx import _wire
from server.models import Allocation, Metric

MAX_POINTS = 2000  # per series: about the pixel width of a wide chart


@dataclass
class Series:
    name: str
    rank: int
    steps: list[int]
    values: list[float | str]  # NaN and infinities as "NaN", "Infinity", "-Infinity"
    total: int  # points before downsampling

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "rank": self.rank, "steps": self.steps, "values": self.values, "total": self.total}


@dataclass
class NewPoints:
    """Points stored after a cursor, grouped by metric and rank: {name: {rank: [[step, value], ...]}}."""

    points: dict[str, dict[int, list[tuple[int, float | str]]]] = field(default_factory=dict)
    cursor: int = 0
    more: bool = False  # the limit cut the read short: read again from `cursor` at once

    def as_json(self) -> dict[str, Any]:
        points = {name: {str(rank): pts for rank, pts in by_rank.items()} for name, by_rank in self.points.items()}
        return {"cursor": self.cursor, "points": points}


def lttb_indices(steps: np.ndarray, values: np.ndarray, n_out: int) -> np.ndarray:
    """Indices of the `n_out` points LTTB keeps (all of them when there are no more than that)."""
    if len(steps) <= n_out:
        return np.arange(len(steps))
    indices: np.ndarray = LTTBDownsampler().downsample(steps, values, n_out=max(n_out, 3))  # type: ignore[no-untyped-call]
    return indices


def _wire_values(values: np.ndarray) -> list[float | str]:
    return [_wire.encode(v) for v in values.tolist()]


def load_series(session: Session, job_id: int, max_points: int = MAX_POINTS) -> tuple[list[Series], int]:
    """Every metric of the job as a series of at most `max_points` points, by name; and the
    cursor for live updates (the highest metric id read, 0 when there is none)."""
    series, cursor = [], 0
    for name in metric_names(session, job_id):
        rank = 0
        newest, steps, values = fetch_points(session, job_id, name, rank)
        if not len(steps):  # rank 0 does not report it: the lowest rank that does
            lowest = session.execute(
                select(func.min(Metric.rank)).where(Metric.job_id == job_id, Metric.name == name)
            ).scalar_one()
            if lowest is None:
                continue
            rank = lowest
            newest, steps, values = fetch_points(session, job_id, name, rank)
        if len(steps):
            series.append(_series(name, rank, steps, values, max_points))
            cursor = max(cursor, newest)
    return series, cursor


def metric_names(session: Session, job_id: int) -> list[str]:
    """The names the job's attempts reported, from each allocation's merged latest values (kept
    up to date by every metric batch), so finding them reads no metric row."""
    names: set[str] = set()
    for latest in session.scalars(select(Allocation.latest_metrics).where(Allocation.job_id == job_id)):
        names.update(latest or {})
    return sorted(names)


_SERIES_QUERY = (
    "SELECT id, step, value FROM metrics WHERE job_id = {job} AND name = {name} AND rank = {rank}"
    " AND NOT superseded ORDER BY step"
)
# PostgreSQL packs the series into two byte strings (big-endian int8 and float8) that numpy reads
# as they are: a 100,000-point series in ~30 ms, where fetching rows as Python objects (or a COPY,
# one message per row) took 70-500 ms. The aggregate reads the index-ordered subquery in order, as
# PostgreSQL does in practice; `fetch_points` checks and sorts if it ever did not.
_PACKED_SERIES_QUERY = (
    "SELECT max(id), string_agg(int8send(step), ''::bytea), string_agg(float8send(value), ''::bytea)"
    f" FROM ({_SERIES_QUERY.format(job='%s', name='%s', rank='%s')}) AS series"
)


def fetch_points(session: Session, job_id: int, name: str, rank: int) -> tuple[int, np.ndarray, np.ndarray]:
    """(highest id, steps, values) of one metric of one rank, by step; (0, [], []) for none."""
    connection = session.connection()
    if connection.dialect.name == "postgresql":
        newest, packed_steps, packed_values = connection.exec_driver_sql(
            _PACKED_SERIES_QUERY, (job_id, name, rank)
        ).one()
        if newest is None:
            return 0, np.empty(0, np.int64), np.empty(0, np.float64)
        steps = np.frombuffer(packed_steps, dtype=">i8").astype(np.int64)
        values = np.frombuffer(packed_values, dtype=">f8").astype(np.float64)
    else:
        fetched = connection.exec_driver_sql(
            _SERIES_QUERY.format(job="?", name="?", rank="?"), (job_id, name, rank)
        ).fetchall()
        table = np.array(fetched, dtype=np.float64).reshape(-1, 3)
        newest = int(table[:, 0].max()) if len(table) else 0
        steps, values = table[:, 1].astype(np.int64), table[:, 2]
    if len(steps) > 1 and (np.diff(steps) < 0).any():
        order = np.argsort(steps, kind="stable")
        steps, values = steps[order], values[order]
    return int(newest), steps, values


def _series(name: str, rank: int, steps: np.ndarray, values: np.ndarray, max_points: int) -> Series:
    total = len(steps)
    if total > max_points:
        finite = np.isfinite(values)
        if finite.all():
            keep = lttb_indices(steps, values, max_points)
        else:
            # LTTB needs numbers: it downsamples the finite points; of the others the first of
            # each run is kept (where the line breaks), up to a quarter of the points
            starts = np.flatnonzero(~finite & np.concatenate(([True], finite[:-1])))[: max_points // 4]
            finite_at = np.flatnonzero(finite)
            kept = finite_at[lttb_indices(steps[finite_at], values[finite_at], max_points - len(starts))]
            keep = np.union1d(kept, starts)
        steps, values = steps[keep], values[keep]
    return Series(name, rank, steps.tolist(), _wire_values(values), total)


def points_after(session: Session, job_id: int, cursor: int, limit: int = 20_000) -> NewPoints:
    """The job's points with an id above `cursor`, oldest first, at most `limit`; the new cursor.
    Ranks of one metric arrive in separate batches, so a reader keeps to the rank it charts."""
    rows = session.execute(
        select(Metric.id, Metric.name, Metric.rank, Metric.step, Metric.value)
        .where(Metric.job_id == job_id, Metric.id > cursor, Metric.superseded.is_(False))
        .order_by(Metric.id)
        .limit(limit)
    ).all()
    new = NewPoints(cursor=cursor)
    for metric_id, name, rank, step, value in rows:
        new.points.setdefault(name, {}).setdefault(rank, []).append((step, _wire.encode(value)))
        new.cursor = metric_id
    new.more = len(rows) == limit
    return new
