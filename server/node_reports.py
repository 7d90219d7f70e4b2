"""What an agent reports of its nodes: their rendezvous, start and exit, and their output lines.

Each report has one definition here, used by its own route and by the routes that take many in
one call (`POST /agents/{id}/reports`, `POST /agents/{id}/logs`). An agent starts or ends its
nodes together (at a cluster's fill, eight within a second), and its log shipper has lines of
all of them each second: one call per node and per allocation was most of the server's work at
1,000 agents (`bench/bench_scale.py`), most of it the framework's cost per request.

Many in one call: one transaction, each report applied or refused (404, 409) on its own, its
outcome saying why as its own call would have: a run of started reports, or of exits with code
0, set-based (checked before anything is written), any other report in a savepoint. The jobs the
reports touch are locked first, in id order: two calls holding several job locks each can then
never wait for each other in a cycle.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import groupby
from typing import Any, TypeVar

from sqlalchemy import exists, insert, select
from sqlalchemy.orm import Session

from phalanx.schemas import (
    AllocationLogBatch,
    ExitReport,
    LogLineIn,
    NodeReport,
    RendezvousReport,
    ReportOutcome,
    StartedReport,
)
from server import attempts
from server.errors import Conflict, NotFound, PhalanxError
from server.ingest import batch_identity, first_deliveries, from_unix
from server.models import Allocation, AllocationNode, Job, LogBatch, LogLine
from server.wakeups import note_job_data

APPLIED = ReportOutcome(status=204)
T = TypeVar("T")


def apply_report(
    session: Session, agent_id: int, report: NodeReport, locked_jobs: Mapping[int, Job] | None = None
) -> None:
    """One node report, in the caller's transaction; NotFound or Conflict when it is refused.
    `locked_jobs`: the jobs the caller locked before this transaction read any of their attempts."""
    if isinstance(report, StartedReport):
        attempts.report_node_started(session, agent_id, report.allocation_id, report.node_rank)
    elif isinstance(report, ExitReport):
        allocation, node = attempts.find_node(session, agent_id, report.allocation_id, report.node_rank)
        job = (locked_jobs or {}).get(allocation.job_id)
        attempts.record_node_exit(session, allocation, node, report.exit_code, report.reason, report.cause, job=job)
    elif isinstance(report, RendezvousReport):
        attempts.set_rendezvous(session, agent_id, report.allocation_id, report.master_port)


def apply_reports(session: Session, agent_id: int, reports: Sequence[NodeReport]) -> list[ReportOutcome]:
    """Each report in order, in the caller's transaction; one outcome per report. A run of started
    reports is applied together, set-based (`attempts.report_nodes_started`: it checks every node
    before it writes, so a refused one changes nothing), and so is a run of exits with code 0
    (`attempts.report_nodes_exited`), but for those of attempts already ending; any other report
    in a savepoint of its own."""
    locked = _lock_jobs_of(session, {r.allocation_id for r in reports})

    def one_by_one(run: Sequence[NodeReport]) -> list[ReportOutcome]:
        return _each(session, run, lambda report: apply_report(session, agent_id, report, locked))

    outcomes: list[ReportOutcome] = []
    for kind, grouped in groupby(reports, key=_kind):
        run = list(grouped)
        if kind == "other":
            outcomes += one_by_one(run)
            continue
        keys = [(r.allocation_id, r.node_rank) for r in run if not isinstance(r, RendezvousReport)]
        if kind == "started":
            refused = attempts.report_nodes_started(session, agent_id, keys)
            outcomes += [_refusal(refused[key]) for key in keys]
        elif kind == "clean exit":
            reasons: dict[attempts.NodeKey, str] = {}
            for r in run:
                if isinstance(r, ExitReport):
                    reasons.setdefault((r.allocation_id, r.node_rank), r.reason)  # a resent one changes nothing
            handled, left = attempts.report_nodes_exited(session, agent_id, reasons)
            rest = iter(one_by_one([r for r, key in zip(run, keys, strict=True) if key in left]))
            outcomes += [_refusal(handled[key]) if key in handled else next(rest) for key in keys]
        for job in locked.values():  # moved by statement: read again at next use
            session.expire(job)
    return outcomes


def _kind(report: NodeReport) -> str:
    """Which reports are applied together, set-based: a run of started reports, or of exits with
    code 0 (every attempt's common end); any other report on its own."""
    if isinstance(report, StartedReport):
        return "started"
    if isinstance(report, ExitReport) and report.exit_code == 0:
        return "clean exit"
    return "other"


@dataclass(frozen=True, slots=True)
class LinesOf:
    """One allocation's batch of lines, known by `identity` (`ingest.batch_identity`)."""

    allocation_id: int
    identity: str
    lines: Sequence[LogLineIn]


def store_logs(session: Session, agent_id: int, batches: Sequence[LinesOf]) -> list[PhalanxError | None]:
    """Batches of lines, each stored once under its identity (a resent batch changes nothing), in
    a constant number of statements; for each, None or why it was refused (NotFound: an unknown
    allocation; Conflict: one ended or not on this agent). Every check comes before any write."""
    hosted = (
        exists()
        .where(AllocationNode.allocation_id == Allocation.id, AllocationNode.agent_id == agent_id)
        .correlate(Allocation)
    )
    ids = sorted({batch.allocation_id for batch in batches})
    found = {
        allocation_id: (job_id, active, on_this_agent)
        for allocation_id, job_id, active, on_this_agent in session.execute(
            select(Allocation.id, Allocation.job_id, Allocation.active, hosted).where(Allocation.id.in_(ids))
        )
    }
    refusals: list[PhalanxError | None] = []
    accepted: list[tuple[int, LinesOf]] = []
    for batch in batches:
        allocation_id = batch.allocation_id
        if allocation_id not in found:
            refusals.append(NotFound(f"allocation {allocation_id} does not exist"))
            continue
        job_id, active, on_this_agent = found[allocation_id]
        if not on_this_agent:
            refusals.append(Conflict(f"allocation {allocation_id} has no node on agent {agent_id}"))
        elif not active:
            refusals.append(Conflict(f"allocation {allocation_id} has ended; its logs are closed"))
        else:
            refusals.append(None)
            accepted.append((job_id, batch))
    # a batch sent again after its answer was lost is stored already
    first = first_deliveries(session, LogBatch, {(b.allocation_id, b.identity) for _, b in accepted})
    rows: list[dict[str, Any]] = []
    noted: set[int] = set()
    for job_id, batch in accepted:
        if (batch.allocation_id, batch.identity) not in first:
            continue
        first.discard((batch.allocation_id, batch.identity))  # the same batch twice in one call
        noted.add(job_id)
        rows += [
            {
                "job_id": job_id,
                "allocation_id": batch.allocation_id,
                "rank": line.rank,
                "stream": line.stream,
                "time": from_unix(line.time),
                "line": line.line,
            }
            for line in batch.lines
        ]
    if rows:
        # Core executemany: logs arrive while training runs, and the ORM's unit of work costs
        # several times more CPU per row.
        session.execute(insert(LogLine.metadata.tables["log_lines"]), rows)
    for job_id in sorted(noted):
        note_job_data(session, job_id)  # live log views
    return refusals


def store_log_batches(session: Session, agent_id: int, batches: Sequence[AllocationLogBatch]) -> list[ReportOutcome]:
    """`store_logs` for the batches of an agent's call; a batch without a `batch_id` is known by
    the digest of its own JSON. One outcome per batch."""
    refusals = store_logs(
        session,
        agent_id,
        [LinesOf(b.allocation_id, batch_identity(b.batch_id, b.model_dump_json().encode()), b.lines) for b in batches],
    )
    return [_refusal(refusal) for refusal in refusals]


def _lock_jobs_of(session: Session, allocation_ids: set[int]) -> dict[int, Job]:
    """The jobs of these allocations, read under their row locks (in id order), by id."""
    jobs = select(Allocation.job_id).where(Allocation.id.in_(allocation_ids)).scalar_subquery()
    locked = session.scalars(
        select(Job).where(Job.id.in_(jobs)).order_by(Job.id).with_for_update().execution_options(populate_existing=True)
    )
    return {job.id: job for job in locked}


def _each(session: Session, items: Sequence[T], apply: Callable[[T], None]) -> list[ReportOutcome]:
    outcomes = []
    for item in items:
        savepoint = session.begin_nested()
        outcome = _outcome(apply, item)
        if outcome.status == APPLIED.status:
            savepoint.commit()
        else:
            savepoint.rollback()
        outcomes.append(outcome)
    return outcomes


def _refusal(error: PhalanxError | None) -> ReportOutcome:
    return APPLIED if error is None else ReportOutcome(status=error.status_code, error=error.message)


def _outcome(apply: Callable[[T], None], item: T) -> ReportOutcome:
    try:
        apply(item)
    except PhalanxError as exc:
        return _refusal(exc)
    return APPLIED
