"""Retention (`server.retention`) on PostgreSQL and on the embedded SQLite: old metric points
thinned to the M4 of their buckets, old log lines deleted, per kind of job, resumable by marks."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from phalanx.schemas import MetricRecord
from server import retention
from server.db import engine_for, session_scope, upgrade
from server.ingest import insert_metrics
from server.models import Allocation, Job, LogLine, Metric, RetentionMark, TuningStudy, TuningTrial, User
from server.settings import MetricTier, Retention, RetentionPolicy, Settings
from server.transitions import db_now
from tests.conftest import PG_ADMIN

Sessions = Callable[[], AbstractContextManager[Session]]


@pytest.fixture(params=["postgresql", "sqlite"])
def sessions(request: pytest.FixtureRequest, settings: Settings, tmp_path: Path) -> Iterator[Sessions]:
    url = settings.database_url
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'embedded.db'}"
        upgrade(url)
    yield partial(session_scope, url)
    if request.param == "sqlite":
        engine_for(url).dispose()


def policy(*tiers: tuple[float, int], log_days: float | None = None) -> RetentionPolicy:
    return RetentionPolicy(
        metric_tiers=[MetricTier(after_days=days, bucket_steps=width) for days, width in tiers], log_days=log_days
    )


NOTHING = RetentionPolicy()


def make_job(sessions: Sessions, *, trial: bool = False, days_ago: float = 40, ended: bool = False) -> tuple[int, int]:
    """A job (a study's trial when `trial`) started `days_ago` by the database clock: (job, allocation)."""
    with sessions() as session:
        now = db_now(session)
        user = session.scalars(select(User).where(User.name == "ret")).first()
        if user is None:
            user = User(name="ret", is_admin=False)
            session.add(user)
            session.flush()
        started = now - timedelta(days=days_ago)
        job = Job(
            name="ret", owner_id=user.id, state="COMPLETED" if ended else "RUNNING", spec={}, priority=0, nodes=1,
            slots_per_node=1, slot_type="cpu", started_at=started, ended_at=now - timedelta(days=1) if ended else None,
        )  # fmt: skip
        session.add(job)
        session.flush()
        allocation = Allocation(job_id=job.id, attempt=1, master_addr="127.0.0.1", active=not ended)
        session.add(allocation)
        if trial:
            study = TuningStudy(name="s", owner_id=user.id, optuna_name=f"s-{job.id}", state="RUNNING", spec={})
            session.add(study)
            session.flush()
            session.add(
                TuningTrial(
                    study_id=study.id, number=0, optuna_trial_id=job.id, job_id=job.id, params={}, state="RUNNING"
                )
            )
        session.flush()
        return job.id, allocation.id


Point = tuple[str, int, int, float, datetime]  # name, rank, step, value, time


def add_points(sessions: Sessions, job_id: int, allocation_id: int, points: list[Point]) -> None:
    """Through the metrics route's own writer (COPY on PostgreSQL; NaN as each store keeps it)."""
    records = [
        MetricRecord(rank=r, step=s, time=t.replace(tzinfo=UTC).timestamp(), values={n: v}) for n, r, s, v, t in points
    ]
    with sessions() as session:
        insert_metrics(session, job_id, allocation_id, records)


def stored(sessions: Sessions, job_id: int) -> set[tuple[str, int, int]]:
    with sessions() as session:
        rows = session.execute(select(Metric.name, Metric.rank, Metric.step).where(Metric.job_id == job_id)).all()
    return {(name, rank, step) for name, rank, step in rows}


def mark(sessions: Sessions, what: str) -> datetime:
    with sessions() as session:
        return session.execute(select(RetentionMark.until).where(RetentionMark.what == what)).scalar_one()


def m4(points: list[Point], width: int, older_than: datetime) -> set[tuple[str, int, int]]:
    """What thinning must keep, computed here from every point: the newer points, and of the
    older ones per (metric, rank, bucket) the first, last, lowest and highest (NaN highest, as
    both stores order it; ties to the lower step)."""
    keep = {(n, r, s) for n, r, s, _, t in points if t >= older_than}
    buckets: dict[tuple[str, int, int], list[tuple[int, float]]] = {}
    for n, r, s, v, t in points:
        if t < older_than:
            buckets.setdefault((n, r, s // width), []).append((s, v))
    for (n, r, _), members in buckets.items():

        def order(point: tuple[int, float]) -> tuple[bool, float, int]:
            return (math.isnan(point[1]), 0.0 if math.isnan(point[1]) else point[1], point[0])

        by_value = sorted(members, key=order)
        highest = max(members, key=lambda p: (math.isnan(p[1]), 0.0 if math.isnan(p[1]) else p[1], -p[0]))
        chosen = [min(members), max(members), by_value[0], highest]
        keep |= {(n, r, s) for s, _ in chosen}
    return keep


def series(now: datetime, steps: int, *, days: float, seed: int) -> list[Point]:
    """Two metrics on two ranks, one step every `days / steps` days ending now, with spikes and a NaN run."""
    rng = random.Random(seed)
    per_step = timedelta(days=days) / steps
    out: list[Point] = []
    for name in ("loss", "lr"):
        for rank in (0, 1):
            for step in range(steps):
                value = rng.gauss(1.0, 0.1)
                if rng.random() < 0.01:
                    value *= 50  # a spike the chart must keep
                if 500 <= step < 505 and name == "loss":
                    value = math.nan
                out.append((name, rank, step, value, now - timedelta(days=days) + per_step * step))
    return out


def job_with_points(
    sessions: Sessions, steps: int, *, days: float, seed: int, days_ago: float = 40
) -> tuple[int, datetime, list[Point]]:
    """A running job with `series` stored: its id, the database clock when made, the points."""
    job_id, allocation_id = make_job(sessions, days_ago=days_ago)
    with sessions() as session:
        now = db_now(session)
    points = series(now, steps, days=days, seed=seed)
    add_points(sessions, job_id, allocation_id, points)
    return job_id, now, points


def run_pass(sessions: Sessions, job: RetentionPolicy, trial: RetentionPolicy = NOTHING) -> retention.PassReport:
    return retention.retention_pass(sessions, Retention(job=job, trial=trial), budget_s=600)


def test_old_points_thin_to_the_m4_of_their_buckets_and_new_ones_stay(sessions: Sessions) -> None:
    job_id, now, points = job_with_points(sessions, 2_000, days=20, seed=1)

    report = run_pass(sessions, policy((7, 40)))
    assert report.finished and report.slices > 1  # in slices, each its own transaction
    assert abs(mark(sessions, "job:metrics/40") - (now - timedelta(days=7))) < timedelta(minutes=1)
    expected = m4(points, 40, mark(sessions, "job:metrics/40"))
    assert stored(sessions, job_id) == expected
    assert len(expected) < len(points) * 0.45  # 13 of 20 days thinned ~10x: 0.35 + 0.065

    # a second pass reads only the seconds since: the mark says the rest was done
    again = run_pass(sessions, policy((7, 40)))
    assert again.slices == 1 and again.deleted <= 4
    assert stored(sessions, job_id) == m4(points, 40, mark(sessions, "job:metrics/40"))


def test_thinning_in_pieces_and_in_coarser_tiers_keeps_what_thinning_at_once_keeps(sessions: Sessions) -> None:
    """A bucket thinned while half of it had aged is thinned again with its other half; the
    400-step tier thins what the 40-step tier kept. Both end where one thinning of every point does."""
    job_id, now, points = job_with_points(sessions, 3_000, days=30, seed=2)
    cuts = [now - timedelta(days=d) for d in (24.3, 17.7, 10.1)]
    since = None
    for cut in cuts:  # the age line moving in three steps that split buckets
        with sessions() as session:
            retention.thin_metrics(session, "job", since, cut, 40)
        since = cut
    assert stored(sessions, job_id) == m4(points, 40, cuts[-1])
    # the coarser tier over what the finer one kept, lagging behind it as an older age does: a
    # bucket across its age line is exact once all of it has aged
    fine = stored(sessions, job_id)
    with sessions() as session:
        retention.thin_metrics(session, "job", None, cuts[0], 400)
    assert stored(sessions, job_id) < fine
    with sessions() as session:
        retention.thin_metrics(session, "job", cuts[0], cuts[-1], 400)
    assert stored(sessions, job_id) == m4(points, 400, cuts[-1])


def test_each_kind_keeps_its_own_policy_and_old_logs_go(sessions: Sessions) -> None:
    plain, plain_allocation = make_job(sessions, ended=True)
    trial, trial_allocation = make_job(sessions, trial=True, ended=True)
    with sessions() as session:
        now = db_now(session)
    for job_id, allocation_id in ((plain, plain_allocation), (trial, trial_allocation)):
        add_points(sessions, job_id, allocation_id, series(now - timedelta(days=2), 1_000, days=30, seed=job_id))
        with sessions() as session:
            session.add_all(
                LogLine(job_id=job_id, allocation_id=allocation_id, rank=0, stream="stdout", line=f"{age}",
                        time=now - timedelta(days=age))
                for age in (35, 20, 5, 2)
            )  # fmt: skip
    before = {job_id: stored(sessions, job_id) for job_id in (plain, trial)}

    run_pass(sessions, job=NOTHING, trial=policy((7, 40), log_days=10))

    assert stored(sessions, plain) == before[plain]
    assert len(stored(sessions, trial)) < len(before[trial]) * 0.5
    with sessions() as session:
        lines = {
            job_id: sorted(line for (line,) in session.execute(select(LogLine.line).where(LogLine.job_id == job_id)))
            for job_id in (plain, trial)
        }
    assert lines[plain] == ["2", "20", "35", "5"]
    assert lines[trial] == ["2", "5"]


def test_a_mark_held_by_another_pass_is_skipped_and_each_task_keeps_its_own(sessions: Sessions) -> None:
    job_id, _, _ = job_with_points(sessions, 1_000, days=20, seed=4)
    rules = policy((7, 40), (14, 400))
    run_pass(sessions, rules)
    with sessions() as session:
        marks = {what: until for what, until in session.execute(select(RetentionMark.what, RetentionMark.until))}
    assert set(marks) == {"job:metrics/40", "job:metrics/400"}
    assert marks["job:metrics/40"] > marks["job:metrics/400"]  # each up to its own age
    thinned = stored(sessions, job_id)

    # the marks set back three days, as if that much had aged since; another scheduler's pass
    # holds the marks' rows meanwhile (PostgreSQL: SQLite has one writer at a time anyway)
    with sessions() as session:
        for what, until in marks.items():
            session.execute(
                update(RetentionMark).where(RetentionMark.what == what).values(until=until - timedelta(days=3))
            )
        postgres = session.get_bind().dialect.name == "postgresql"
    if postgres:
        with sessions() as holder:
            holder.execute(select(RetentionMark).with_for_update()).all()
            held = run_pass(sessions, rules)
        assert held.deleted == 0 and held.slices == len(marks)  # one look at each, skipped
        assert {what: mark(sessions, what) for what in marks} == {w: u - timedelta(days=3) for w, u in marks.items()}
    report = run_pass(sessions, rules)
    assert report.finished and report.slices > 0
    assert report.deleted == 0  # re-thinning what was thinned keeps it: idempotent
    assert all(mark(sessions, what) >= until for what, until in marks.items())
    assert stored(sessions, job_id) == thinned


def test_a_pass_stops_at_its_budget_and_the_next_carries_on(sessions: Sessions) -> None:
    job_id, _, points = job_with_points(sessions, 1_000, days=20, seed=3, days_ago=20)
    rules = Retention(job=policy((7, 40)), trial=NOTHING)
    first = retention.retention_pass(sessions, rules, budget_s=0)
    assert first.slices == 1 and not first.finished  # one slice at least, then the budget is spent
    passes = 1
    while not retention.retention_pass(sessions, rules, budget_s=0).finished:
        passes += 1
        assert passes < 1_000
    assert passes > 5
    assert stored(sessions, job_id) == m4(points, 40, mark(sessions, "job:metrics/40"))


def test_tiers_must_nest() -> None:
    with pytest.raises(ValueError, match="multiple of the one before"):
        policy((7, 40), (30, 100))
    with pytest.raises(ValueError, match="after the one before"):
        policy((7, 40), (7, 400))
    assert Settings(retention={"job": {"metric_tiers": [{"after_days": 1, "bucket_steps": 8}]}}).retention.trial


def test_a_database_user_that_does_not_own_the_tables_still_thins(settings: Settings) -> None:
    """Summarising BRIN ranges needs the index's owner; without it a pass goes on (autovacuum
    summarises them) and still thins."""
    role = "phalanx_not_owner"
    with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
        admin.execute(f"DROP ROLE IF EXISTS {role}")
        admin.execute(f"CREATE ROLE {role} LOGIN")
    database = settings.database_url.rsplit("/", 1)[1]
    with psycopg.connect(f"postgresql://postgres@127.0.0.1:5432/{database}", autocommit=True) as owner:
        owner.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}")
        owner.execute(f"GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO {role}")
    url = settings.database_url.replace("postgres@", f"{role}@")
    try:
        sessions = partial(session_scope, url)
        job_id, _, points = job_with_points(sessions, 1_000, days=20, seed=5)
        report = run_pass(sessions, policy((7, 40)))
        assert report.finished and report.deleted > 0
        assert stored(sessions, job_id) == m4(points, 40, mark(sessions, "job:metrics/40"))
    finally:
        engine_for(url).dispose()
        with psycopg.connect(f"postgresql://postgres@127.0.0.1:5432/{database}", autocommit=True) as owner:
            owner.execute(f"DROP OWNED BY {role}")
        with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
            admin.execute(f"DROP ROLE IF EXISTS {role}")
