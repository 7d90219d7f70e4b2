"""Where every queued job stands: its place in line, why it waits, and when it may start.

Read-only: it runs the placement policy (`server.placement.place`) over what the database holds
now, exactly as the next scheduling pass would, so a position is the order that pass would consider
the job in; then `server.forecast` replays the running jobs' ends for start estimates. Nothing is
written: the scheduling pass stays the only writer of `wait_reason`.

Cost: one placement pass over the whole queue and at most a few dozen small ones, a cost of the
cluster's size (~0.15 s at 300 queued jobs and 1,000 agents, seconds at 3,000). So each server
process keeps its newest snapshot and serves it to the requests of the next
`Settings.queue_snapshot_seconds`; one request computes the next while the others wait for it, not
beside it (`bench/bench_scale.py`: ten list reads a second each computed one, and took the
server's core from heartbeats). Only a read that shows a job newer than the kept snapshot on its
own page waits for a computation; an old snapshot is shown while a thread of its own computes the
next (at 10,000 queued and 7,000 running jobs a computation is ~1 s of the server's core, and
every fifth second's read waited for it).

A kept snapshot is computed in a process of its own (`SnapshotProcess`), not on a thread of the
server's: at 10,000 queued jobs a computation held the server's one interpreter lock for a second
or two of every five, its event loop stopped accepting connections meanwhile, and agents whose
heartbeats waited in the listen queue past the timeout were declared lost (`bench/bench_scale.py`).
The server only unpickles the result. An in-memory SQLite database, which no other process can
open, is computed here.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Collection
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import lru_cache

from sqlalchemy import URL, Engine, func, make_url, select
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from phalanx.schemas import AgentState, JobState
from server import agents as agent_rules
from server import sharing
from server.db import make_engine
from server.forecast import estimate_starts
from server.models import Agent, Allocation, AllocationNode, Job
from server.placement import place
from server.settings import Settings
from server.transitions import db_now

NEXT_PASS = "it starts at the scheduler's next pass"
SUBMITTED_SINCE = "submitted after the queue's places were last worked out: its place shows within seconds"
NO_ESTIMATE = (
    "no estimate: the jobs it waits for have not declared total_steps in their job file, or have not reported steps yet"
)


@dataclass
class QueueSnapshot:
    now: datetime
    order: list[int] = field(default_factory=list)  # job ids in line, in placement order
    positions: dict[int, int] = field(default_factory=dict)  # 1 is next
    team_positions: dict[int, int] = field(default_factory=dict)
    reasons: dict[int, str] = field(default_factory=dict)  # every QUEUED job, held ones included
    estimates: dict[int, datetime] = field(default_factory=dict)
    queued: list[int] = field(default_factory=list)  # every QUEUED job's id, held ones included
    _known: frozenset[int] | None = field(default=None, repr=False, compare=False)

    def knows(self, job_id: int) -> bool:
        """Whether the job was queued when the snapshot was taken (one submitted since is not in it)."""
        if self._known is None:
            self._known = frozenset(self.queued)
        return job_id in self._known

    def estimate_note(self, job_id: int) -> str:
        if job_id in self.estimates:
            if self.estimates[job_id] <= self.now:
                return "now: slots it fits in are free"
            return "from the running jobs' reported steps and declared total_steps"
        if job_id not in self.positions:
            return "no estimate while it is held or can never run"
        return NO_ESTIMATE


def remaining_seconds(session: Session, now: datetime, grace_s: float) -> dict[int, float]:
    """Running job id -> seconds until it ends, for the jobs that declared `total_steps` and report
    steps (and the ones already stopping: their grace at most)."""
    # the active attempts' nodes only: grouping every node ever placed grew with the cluster's
    # history (with 100,000 ended nodes and 1,000 running, 34 ms of each snapshot where it is 16)
    started = (
        select(AllocationNode.allocation_id, func.min(AllocationNode.started_at).label("started"))
        .join(Allocation, Allocation.id == AllocationNode.allocation_id)
        .where(Allocation.active.is_(True))
        .group_by(AllocationNode.allocation_id)
        .subquery()
    )
    # `total_steps` read by the database: parsing every running job's spec cost ~0.3 s at 7,000
    total_steps = Job.spec["total_steps"].as_integer()
    rows = session.execute(
        select(Job.id, Job.state, total_steps, Allocation.end_reason, Allocation.latest_step, Allocation.resume_step)
        .add_columns(started.c.started)
        .join(Allocation, Allocation.job_id == Job.id)
        .join(started, started.c.allocation_id == Allocation.id)
        .where(Allocation.active.is_(True))
    ).all()
    remaining: dict[int, float] = {}
    for job_id, state, total, end_reason, latest, resumed, began in rows:
        if end_reason is not None or state not in (JobState.RUNNING.value, JobState.SCHEDULED.value):
            remaining[job_id] = grace_s
            continue
        if total is None or latest is None or began is None:
            continue
        elapsed = (now - began).total_seconds()
        done = latest - (resumed or 0)
        if elapsed <= 0 or done <= 0:
            continue
        remaining[job_id] = max(0.0, (total - latest) * elapsed / done)
    return remaining


@dataclass(frozen=True)
class _Taken:
    snapshot: QueueSnapshot
    at: float  # _clock() when its reads began


@dataclass
class _Kept:
    lock: threading.Lock = field(default_factory=threading.Lock)  # held while one is computed
    taken: _Taken | None = None  # replaced whole: a reader never sees half of two snapshots


log = logging.getLogger(__name__)
_kept: dict[str, _Kept] = {}  # by database URL: tests run several databases in one process
_kept_lock = threading.Lock()
_clock = time.monotonic


def queue_snapshot(
    session: Session, settings: Settings, showing: Collection[int] = (), *, exact: bool = True
) -> QueueSnapshot:
    """The kept queue snapshot and, when `exact`, one as of later than every QUEUED job in `showing`
    (the jobs the caller shows: one job's page must never show it without its place); only that
    waits for a computation. One older than `settings.queue_snapshot_seconds` is still shown, while
    a thread of its own computes the next: at 10,000 queued jobs a computation is ~1 s of the
    server's core, and a job's page that waited for it every fifth second was the API's p99 at
    1,000 agents (`bench/bench_scale.py`). Lists are not exact: the newest jobs of a busy
    cluster's list are nearly always newer than the snapshot, and a fresh one for each list read
    cost the server a third of its core; such a job shows `SUBMITTED_SINCE`."""
    max_age = settings.queue_snapshot_seconds
    if max_age <= 0:
        return compute_queue_snapshot(session, settings)
    engine = session.get_bind().engine
    key = engine.url.render_as_string(hide_password=True)
    with _kept_lock:
        kept = _kept.setdefault(key, _Kept())

    def usable() -> _Taken | None:
        taken = kept.taken
        if taken is None or (exact and not all(taken.snapshot.knows(job_id) for job_id in showing)):
            return None
        return taken

    if (taken := usable()) is not None:
        if _clock() - taken.at > max_age:
            _replace_in_background(kept, engine, settings)
        return taken.snapshot
    with kept.lock:  # one request computes; the ones that came meanwhile take its result
        if (taken := usable()) is not None:
            return taken.snapshot
        kept.taken = _take(session, settings)
        return kept.taken.snapshot


def _take(session: Session, settings: Settings) -> _Taken:
    at = _clock()
    if SnapshotProcess.serves(session.get_bind().engine.url):
        return _Taken(SnapshotProcess.compute(settings), at)
    return _Taken(compute_queue_snapshot(session, settings), at)


PARENT_CHECK_S = 1.0  # how soon the snapshot process notices that its server is gone


class SnapshotProcess:
    """One process per server process that computes its kept snapshots, started when the server
    starts (`warm`: spawning it imports the server's modules, seconds that the first job page
    would otherwise wait) or on first use; spawned, since the server's threads and event loop must
    not be forked. Each computation opens a connection of its own and closes it, so the process
    holds none between them."""

    enabled = True  # tests that count computations in this process turn it off
    _pool: ProcessPoolExecutor | None = None
    _lock = threading.Lock()

    @classmethod
    def serves(cls, url: URL) -> bool:
        """Not SQLite: there every transaction takes the write lock at its start
        (`db.sqlite_pragmas`), and a computation in another process waited for the very
        transaction that waited for it, until SQLite's 30 s busy timeout (`phalanx demo --once`
        timed out on its job's first page). The embedded stack's queues are small."""
        return cls.enabled and url.get_backend_name() != "sqlite"

    @classmethod
    def warm(cls, settings: Settings) -> None:
        """Start the process now, without waiting for it, if this server's snapshots will need it."""
        if settings.queue_snapshot_seconds > 0 and cls.serves(make_url(settings.database_url)):
            cls._started().submit(int)

    @classmethod
    def stop(cls) -> None:
        """End the process (the server is shutting down); a later computation starts another."""
        with cls._lock:
            pool, cls._pool = cls._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    @classmethod
    def _started(cls) -> ProcessPoolExecutor:
        with cls._lock:
            if cls._pool is None:
                cls._pool = ProcessPoolExecutor(
                    max_workers=1,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_exit_with_parent,
                    initargs=(os.getpid(),),
                )
            return cls._pool

    @classmethod
    def compute(cls, settings: Settings) -> QueueSnapshot:
        pool = cls._started()
        try:
            return pool.submit(_compute_in_snapshot_process, settings).result()
        except BrokenProcessPool:  # it died (killed, out of memory): the next computation starts another
            with cls._lock:
                if cls._pool is pool:
                    cls._pool = None
            pool.shutdown(wait=False)
            raise


def _exit_with_parent(parent: int) -> None:
    """In the snapshot process: exit once the server process is gone. A server that is killed
    cannot shut its pool down, and the process would live on, orphaned, for ever."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


@lru_cache(maxsize=8)
def _snapshot_engine(database_url: str) -> Engine:
    # NullPool: no connection kept between computations (a database is never held open by it)
    return make_engine(database_url, poolclass=NullPool)


def _compute_in_snapshot_process(settings: Settings) -> QueueSnapshot:
    with Session(_snapshot_engine(settings.database_url)) as session, session.begin():
        return compute_queue_snapshot(session, settings)


def _replace_in_background(kept: _Kept, engine: Engine, settings: Settings) -> None:
    """Compute the next snapshot in a thread of its own (which waits for `SnapshotProcess`),
    unless one is being computed already."""
    if not kept.lock.acquire(blocking=False):
        return

    def replace() -> None:
        try:
            with Session(engine) as session, session.begin():
                kept.taken = _take(session, settings)
        except Exception:  # the next read tries again; the old one is shown meanwhile
            log.exception("could not compute the queue snapshot")
        finally:
            kept.lock.release()

    threading.Thread(target=replace, name="queue-snapshot", daemon=True).start()


def compute_queue_snapshot(session: Session, settings: Settings) -> QueueSnapshot:
    now = db_now(session)
    snapshot = QueueSnapshot(now=now)
    # columns, as the scheduling pass reads them: at 10,000 queued jobs, ORM rows with their specs
    # cost more than the placement itself
    pending = [queued.pending for queued in sharing.queued_jobs(session, winding_down=True)]
    if not pending:
        return snapshot
    snapshot.queued = [job.job_id for job in pending]
    agents = list(session.scalars(select(Agent).where(Agent.state == AgentState.ACTIVE.value).order_by(Agent.id)))
    slots = agent_rules.agent_slot_views(session, agents)
    policy = sharing.load_sharing(session, now, settings)
    result = place(pending, slots, policy)
    snapshot.order = list(result.order)
    by_team: dict[str, int] = {}
    by_id = {job.job_id: job for job in pending}
    for position, job_id in enumerate(result.order, start=1):
        snapshot.positions[job_id] = position
        team = by_id[job_id].team
        by_team[team] = by_team.get(team, 0) + 1
        snapshot.team_positions[job_id] = by_team[team]
    snapshot.reasons = dict(result.waiting)
    for placement in result.placements:
        snapshot.reasons[placement.job_id] = NEXT_PASS
    in_line = [by_id[job_id] for job_id in result.order]
    remaining = remaining_seconds(session, now, settings.preemption_grace)
    for job_id, seconds in estimate_starts(in_line, slots, policy, remaining).items():
        snapshot.estimates[job_id] = now + timedelta(seconds=seconds)
    return snapshot
