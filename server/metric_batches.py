"""Group commit for the ranks' metric batches: one transaction stores every batch that arrived
while the previous group was being written.

At 1,000 agents with ~7,000 nodes running, metric batches were the largest share of the server's
time and of PostgreSQL's (`bench/bench_scale.py`, RESULTS.md "Ninth session"): each was a
transaction of its own, ~6 round trips (the allocation's row, the batch id, the points, the
allocation's progress, the commit) plus a wake-up, and past what the agents' threads could store
they were refused at the door by the ten thousand. In a group they are one statement of each
kind, whatever the group's size, and the groups grow with the load instead of the queue.

Contract: `MetricWriter.store(batch)` returns once the batch is in the database, or was already
(a resend of a batch whose answer was lost), with the profile the ranks are asked for, if any:
exactly what a transaction of its own would have returned. It raises the batch's own refusal
(`Forbidden`, `NotFound`, `Conflict`) and never another batch's; a refused batch changes nothing.
When a group's transaction fails (a deadlock with an attempt ending, a constraint), each batch of
it is written again in a transaction of its own, so only a batch that fails alone fails. Groups
are written on the agents' threads, at most `WRITERS` at once, their batches counted in
`AgentBacklog` with the calls waiting for those threads (the door refuses past its limit,
`server/api/admission.py`). A lone batch on an idle server is written at once. One
`MetricWriter` per server process, used from its event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from phalanx import schemas
from phalanx.schemas import MetricRecord
from server import access
from server.api.admission import AgentBacklog
from server.auth import Principal
from server.errors import Conflict, NotFound, PhalanxError
from server.ingest import first_deliveries, insert_metric_batches, record_progress
from server.models import Allocation, MetricBatch, Profile, TuningStudy, TuningTrial
from server.task_names import ADVANCE_STUDY_TASK
from server.wakeups import note_job_data, note_task

log = logging.getLogger("phalanx.server.metrics")

# Groups written at once. One group's COPY runs on one PostgreSQL backend, one core: with one writer,
# two ranks sending 20,000-point batches together were stored one after the other (`bench_ingest.py`:
# 0.55 x COPY, against 0.77 x with a transaction each). Two groups never wait on each other in a cycle:
# each takes its row locks in id order.
WRITERS = 2
# A group stops growing past this many values (it always takes one batch): a group is held in
# memory and written in one COPY, and a client's batch is at most 5,000 records.
MAX_GROUP_VALUES = 200_000

Outcome = schemas.ProfileOrder | Exception | None


@dataclass(frozen=True, slots=True)
class IncomingBatch:
    reporter: Principal
    allocation_id: int
    identity: str  # `ingest.batch_identity`: a resend carries the same
    records: list[MetricRecord]

    @property
    def values(self) -> int:
        return sum(len(record.values) for record in self.records)


class StudyObjectives:
    """The metrics each study optimises, per process (a study's spec never changes)."""

    def __init__(self) -> None:
        self._known: dict[int, frozenset[str]] = {}

    def of(self, session: Session, study_id: int) -> frozenset[str]:
        if study_id not in self._known:
            spec = session.execute(select(TuningStudy.spec).where(TuningStudy.id == study_id)).scalar_one()
            self._known[study_id] = frozenset(o.metric for o in schemas.StudySpec.model_validate(spec).objectives)
        return self._known[study_id]


def store_metric_batches(
    session: Session, batches: Sequence[IncomingBatch], objectives: StudyObjectives
) -> list[schemas.ProfileOrder | PhalanxError | None]:
    """Every batch, in the caller's transaction, in a constant number of statements (one progress
    update per allocation); for each, the profile order of its answer or its refusal. Every check
    comes before any write. The live charts of each job with new points are woken, and a trial's
    study is driven when a batch carries its objective."""
    refusals: list[PhalanxError | None] = list(
        access.may_report_for_each(session, [(b.reporter, b.allocation_id) for b in batches])
    )
    rows = {
        row.id: row
        for row in session.execute(
            select(
                Allocation.id,
                Allocation.job_id,
                Allocation.active,
                Allocation.fenced,
                TuningTrial.study_id,
                Profile.id.label("profile_id"),
                Profile.steps.label("profile_steps"),
            )
            .outerjoin(TuningTrial, TuningTrial.job_id == Allocation.job_id)
            .outerjoin(Profile, Profile.id == Allocation.profile_request)
            .where(Allocation.id.in_(sorted({b.allocation_id for b in batches})))
        )
    }
    for at, batch in enumerate(batches):
        row = rows.get(batch.allocation_id)
        if refusals[at] is not None:
            continue
        if row is None:
            refusals[at] = NotFound(f"allocation {batch.allocation_id} does not exist")
        elif row.fenced or not row.active:
            refusals[at] = Conflict(f"allocation {batch.allocation_id} is no longer current; its workers must stop")
    accepted = [batch for batch, refusal in zip(batches, refusals, strict=True) if refusal is None]
    # a batch sent again after its answer was lost is stored already (also twice in one group)
    first = first_deliveries(session, MetricBatch, {(b.allocation_id, b.identity) for b in accepted})
    new: list[IncomingBatch] = []
    for batch in accepted:
        if (batch.allocation_id, batch.identity) in first:
            first.discard((batch.allocation_id, batch.identity))
            new.append(batch)
    insert_metric_batches(session, [(rows[b.allocation_id].job_id, b.allocation_id, b.records) for b in new])
    by_allocation: dict[int, list[MetricRecord]] = {}
    for batch in new:
        by_allocation.setdefault(batch.allocation_id, []).extend(batch.records)
    # last (row locks until commit), in the order of their ids so that two groups never wait on
    # each other: progress for hang detection, and the latest values, merged in arrival order
    for allocation_id in sorted(by_allocation):
        record_progress(session, allocation_id, by_allocation[allocation_id])
    for job_id in sorted({rows[b.allocation_id].job_id for b in new}):
        note_job_data(session, job_id)
    studies = set()
    for batch in new:
        study_id = rows[batch.allocation_id].study_id
        if study_id is not None and any(objectives.of(session, study_id).intersection(r.values) for r in batch.records):
            studies.add(study_id)
    for study_id in sorted(studies):
        note_task(session, ADVANCE_STUDY_TASK, study_id)
    outcomes: list[schemas.ProfileOrder | PhalanxError | None] = []
    for batch, refusal in zip(batches, refusals, strict=True):
        if refusal is not None:
            outcomes.append(refusal)
            continue
        row = rows[batch.allocation_id]
        profile = row.profile_id
        outcomes.append(None if profile is None else schemas.ProfileOrder(id=profile, steps=row.profile_steps))
    return outcomes


class MetricWriter:
    def __init__(self, sessions: sessionmaker[Session], threads: ThreadPoolExecutor, backlog: AgentBacklog) -> None:
        self._sessions = sessions
        self._threads = threads
        self._backlog = backlog
        self._objectives = StudyObjectives()
        self._waiting: list[tuple[IncomingBatch, asyncio.Future[Outcome]]] = []
        self._writers: set[asyncio.Task[None]] = set()

    async def store(self, batch: IncomingBatch) -> schemas.ProfileOrder | None:
        answer: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self._waiting.append((batch, answer))
        self._writers = {writer for writer in self._writers if not writer.done()}
        if len(self._writers) < WRITERS:
            self._writers.add(asyncio.create_task(self._write_while_waiting()))
        self._backlog.calls += 1
        try:
            outcome = await answer
        finally:
            self._backlog.calls -= 1
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def _next_group(self) -> list[tuple[IncomingBatch, asyncio.Future[Outcome]]]:
        values, taken = 0, 0
        for batch, _ in self._waiting:
            if taken and values + batch.values > MAX_GROUP_VALUES:
                break
            values += batch.values
            taken += 1
        group, self._waiting = self._waiting[:taken], self._waiting[taken:]
        return group

    async def _write_while_waiting(self) -> None:
        loop = asyncio.get_running_loop()
        while self._waiting:
            group = self._next_group()
            try:
                outcomes = await loop.run_in_executor(self._threads, self._write, [batch for batch, _ in group])
            except Exception as exc:  # the database is down: every batch fails as its own request would
                outcomes = [exc] * len(group)
            for (_, answer), outcome in zip(group, outcomes, strict=True):
                if not answer.done():  # its request may have been cancelled
                    answer.set_result(outcome)

    def _write(self, batches: list[IncomingBatch]) -> list[Outcome]:
        try:
            return self._write_group(batches)
        except Exception:
            if len(batches) == 1:
                raise
            log.warning("a group of %d metric batches failed; writing each alone", len(batches), exc_info=True)
        outcomes: list[Outcome] = []
        for batch in batches:
            try:
                outcomes += self._write_group([batch])
            except Exception as exc:
                outcomes.append(exc)
        return outcomes

    def _write_group(self, batches: list[IncomingBatch]) -> list[Outcome]:
        with self._sessions() as session, session.begin():
            return list(store_metric_batches(session, batches, self._objectives))
