"""Retention: old metric points thinned and old log lines deleted, per kind of job
(`Settings.retention`: `trial` for a study's trials, `job` for every other job).

Metrics. Each tier of a policy thins the points older than its age, per series (job, metric,
rank; a failed attempt's superseded points apart from the rest), to the first, last, lowest and
highest point of each bucket of `bucket_steps` steps: M4 aggregation. A line chart drawn from
those has the same envelope as one drawn from every point (peaks, dips and where the series
broke with NaN included), from up to `bucket_steps / 4` times fewer rows. Buckets are aligned to
multiples of their width, so thinning is idempotent, and a bucket that straddled the age line is
simply thinned again once the rest of it has aged: the M4 of (the M4 of A) and B is the M4 of A and B.
For the same reason a coarser tier may thin what a finer one kept (a coarse bucket across the
coarse tier's age line is exact again once all of it has aged).

Logs. Lines older than `log_days` are deleted.

Work is bounded and resumable. Each task (a kind's tier, or its logs) has one `RetentionMark`:
everything older than its `until` is done. A pass takes the next slice of time after the mark
(rows found by the BRIN index on `time`), thins or deletes in it, and moves the mark, all in one
transaction that holds the mark's row lock (a second scheduler skips the task meanwhile). Slices
start at an hour and halve or double with what they found, so one stays a fraction of a second
whether the cluster stores a thousand points an hour or millions. A pass stops starting slices
after its time budget; the next one carries on from the marks.

Contract: readers never see a half-thinned bucket (a slice is one transaction); the REST
`/metrics` list returns what is stored, so points older than a tier are a thinned subset of them.

Pitfall: BRIN works because rows are stored in time order, and only over summarised block
ranges (an unsummarised one matches every query): each pass first summarises the new ones.
Thinned blocks are refilled by new rows after VACUUM, which widens those blocks' summaries:
slices then read more blocks, never wrong ones.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from sqlalchemy import ColumnElement, and_, delete, exists, func, select, text, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import InstrumentedAttribute, Session

from server.models import Job, LogLine, Metric, RetentionMark, TuningTrial
from server.settings import Retention, RetentionPolicy
from server.transitions import db_now

log = logging.getLogger(__name__)

Kind = Literal["job", "trial"]
KINDS: tuple[Kind, ...] = ("job", "trial")
SLICE = timedelta(hours=1)  # the first slice of a pass
MIN_SLICE, MAX_SLICE = timedelta(minutes=1), timedelta(days=7)
# Rows a slice should delete: past the upper bound the next slice halves, under the lower it doubles.
SLICE_ROWS = (20_000, 200_000)
# A mark starts this long before the kind's first job started: ranks stamp points with their own clocks.
CLOCK_SLACK = timedelta(days=1)


@dataclass(frozen=True)
class Task:
    """One thing retention does to one kind of job: a metric tier, or deleting its logs."""

    kind: Kind
    what: str  # its mark's key: "job:metrics/40", "trial:logs"
    age: timedelta
    bucket_steps: int | None  # None for logs


def tasks(retention: Retention) -> list[Task]:
    out = []
    for kind in KINDS:
        policy: RetentionPolicy = getattr(retention, kind)
        for tier in policy.metric_tiers:
            age = timedelta(days=tier.after_days)
            out.append(Task(kind, f"{kind}:metrics/{tier.bucket_steps}", age, tier.bucket_steps))
        if policy.log_days is not None:
            out.append(Task(kind, f"{kind}:logs", timedelta(days=policy.log_days), None))
    return out


def of_kind(kind: Kind, job_id: InstrumentedAttribute[int]) -> ColumnElement[bool]:
    is_trial = exists().where(TuningTrial.job_id == job_id)
    return is_trial if kind == "trial" else ~is_trial


@dataclass(frozen=True)
class Slice:
    done: bool  # the mark reached the cutoff, or another pass holds it
    deleted: int = 0


def advance(session: Session, task: Task, cutoff: datetime, length: timedelta) -> Slice:
    """The next slice (at most `length` of time after the task's mark, never past `cutoff`), in
    the caller's transaction."""
    make = postgresql.insert if session.get_bind().dialect.name == "postgresql" else sqlite.insert
    first_job = session.execute(select(func.min(Job.started_at)).where(of_kind(task.kind, Job.id))).scalar()
    if first_job is None:
        return Slice(done=True)  # no job of this kind has started: nothing was reported
    session.execute(make(RetentionMark).values(what=task.what, until=first_job - CLOCK_SLACK).on_conflict_do_nothing())
    since = session.execute(
        select(RetentionMark.until).where(RetentionMark.what == task.what).with_for_update(skip_locked=True)
    ).scalar()
    if since is None or since >= cutoff:
        return Slice(done=True)
    end = min(cutoff, since + length)
    if task.bucket_steps is None:
        result: Any = session.execute(
            delete(LogLine)
            .where(LogLine.time >= since, LogLine.time < end, of_kind(task.kind, LogLine.job_id))
            .execution_options(synchronize_session=False)
        )
        deleted = int(result.rowcount)
    else:
        if session.get_bind().dialect.name == "postgresql":
            # The planner's estimates for a slice cross JIT's threshold: compiling cost 0.5 s a
            # slice, more than the work.
            session.execute(text("SET LOCAL jit = off"))
        deleted = thin_metrics(session, task.kind, since, end, task.bucket_steps)
    session.execute(update(RetentionMark).where(RetentionMark.what == task.what).values(until=end))
    return Slice(done=end >= cutoff, deleted=deleted)


def thin_metrics(session: Session, kind: Kind, since: datetime | None, end: datetime, width: int) -> int:
    """M4 over every bucket of `width` steps that holds a point stored in [since, end) of a job of
    `kind`: of the bucket's points older than `end`, all but the first, last, lowest and highest
    go. Returns how many were deleted."""
    bucket = Metric.step // width
    fresh = (
        select(Metric.job_id, Metric.name, Metric.rank, Metric.superseded, bucket.label("bucket"))
        .where(
            Metric.time < end,
            *([Metric.time >= since] if since is not None else []),
            of_kind(kind, Metric.job_id),
        )
        .distinct()
        .cte("fresh")
    )
    # the whole of each bucket, found through the series index (its older part may predate `since`)
    points = (
        select(
            Metric.id,
            Metric.job_id,
            Metric.name,
            Metric.rank,
            Metric.superseded,
            bucket.label("bucket"),
            Metric.step,
            Metric.value,
        )
        .join(
            fresh,
            and_(
                Metric.job_id == fresh.c.job_id,
                Metric.name == fresh.c.name,
                Metric.rank == fresh.c.rank,
                Metric.superseded == fresh.c.superseded,
                Metric.step >= fresh.c.bucket * width,
                Metric.step < (fresh.c.bucket + 1) * width,
            ),
        )
        .add_columns(Metric.time)
        .cte("points")
        # Materialized, and aged only below: inside, `time < end` made PostgreSQL intersect each
        # bucket's few rows with the BRIN's every block older than `end` (20 s a slice at 100 M).
        .prefix_with("MATERIALIZED")
    )
    series = (points.c.job_id, points.c.name, points.c.rank, points.c.superseded, points.c.bucket)

    def position(*order: ColumnElement[Any]) -> ColumnElement[int]:
        return func.row_number().over(partition_by=series, order_by=order)

    ranked = (
        select(
            points.c.id,
            position(points.c.step, points.c.id).label("first"),
            position(points.c.step.desc(), points.c.id.desc()).label("last"),
            position(points.c.value, points.c.step).label("low"),
            position(points.c.value.desc(), points.c.step).label("high"),
        )
        .where(points.c.time < end)
        .subquery()
    )
    dropped = select(ranked.c.id).where(ranked.c.first > 1, ranked.c.last > 1, ranked.c.low > 1, ranked.c.high > 1)
    result: Any = session.execute(
        delete(Metric).where(Metric.id.in_(dropped)).execution_options(synchronize_session=False)
    )
    if result.rowcount < 0:  # sqlite3 counts only statements that begin with DELETE, not WITH
        return int(session.execute(select(func.changes())).scalar_one())
    return int(result.rowcount)


def summarize_new_rows(session: Session) -> None:
    """PostgreSQL: bring the BRIN indexes up to the rows stored since they were last summarised.
    A block range without a summary matches every query, so until autovacuum gets to them (the
    indexes ask it to, `autosummarize`), new ranges would each be read by every slice; this reads
    only those ranges, once."""
    if session.get_bind().dialect.name != "postgresql":
        return
    for index in ("ix_metrics_time", "ix_log_lines_time"):
        try:
            with session.begin_nested():
                session.execute(select(func.brin_summarize_new_values(text(f"'{index}'::regclass"))))
        except DBAPIError as exc:
            # Only the index's owner may summarise: a server whose database user does not own
            # the tables relies on autovacuum (slower slices until it has run, never wrong ones).
            log.warning("retention: cannot summarise %s, leaving it to autovacuum: %s", index, exc.orig)


@dataclass
class PassReport:
    slices: int = 0
    deleted: int = 0
    finished: bool = True  # False: the time budget ran out with work left


def retention_pass(
    sessions: Callable[[], AbstractContextManager[Session]], retention: Retention, budget_s: float
) -> PassReport:
    """Every task, slice by slice, each slice in a transaction of its own (`sessions()` opens
    one), until all are up to date or `budget_s` seconds have gone (one slice at least)."""
    deadline = time.monotonic() + budget_s
    report = PassReport()
    with sessions() as session:
        summarize_new_rows(session)
    for task in tasks(retention):
        with sessions() as session:
            cutoff = db_now(session) - task.age  # fixed for the pass, so the task ends
        length = SLICE
        while True:
            if report.slices and time.monotonic() >= deadline:
                report.finished = False
                return report
            with sessions() as session:
                done = advance(session, task, cutoff, length)
            report.slices += 1
            report.deleted += done.deleted
            if done.done:
                break
            if done.deleted > SLICE_ROWS[1]:
                length = max(MIN_SLICE, length / 2)
            elif done.deleted < SLICE_ROWS[0]:
                length = min(MAX_SLICE, length * 2)
    return report
