"""ORM rows → response schemas. The only place that knows both shapes."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from phalanx import schemas
from server.models import Agent, Allocation, Checkpoint, Job, LogLine, SlotLease


def job(session: Session, row: Job, *, latest: bool = True) -> schemas.Job:
    metrics, step = latest_metrics(session, row.id) if latest else ({}, None)
    return schemas.Job(
        id=row.id,
        name=row.name,
        state=schemas.JobState(row.state),
        spec=schemas.JobSpec.model_validate(row.spec),
        owner=row.owner.name,
        priority=row.priority,
        wait_reason=row.wait_reason,
        failure_reason=row.failure_reason,
        submitted_at=row.submitted_at,
        started_at=row.started_at,
        ended_at=row.ended_at,
        attempts=row.attempts,
        restarts_used=row.restarts_used,
        infra_restarts_used=row.infra_restarts_used,
        latest_metrics=metrics,
        latest_step=step,
    )


def job_detail(session: Session, row: Job) -> schemas.JobDetail:
    return schemas.JobDetail(
        **job(session, row).model_dump(),
        events=[
            schemas.JobEvent(
                time=e.time,
                from_state=schemas.JobState(e.from_state) if e.from_state else None,
                to_state=schemas.JobState(e.to_state),
                reason=e.reason,
            )
            for e in row.events
        ],
        allocations=[allocation(a) for a in row.allocations],
    )


def allocation(row: Allocation) -> schemas.AllocationView:
    return schemas.AllocationView(
        id=row.id,
        attempt=row.attempt,
        master_addr=row.master_addr,
        master_port=row.master_port,
        active=row.active,
        fenced=row.fenced,
        end_reason=row.end_reason,
        resume_step=row.resume_step,
        created_at=row.created_at,
        ended_at=row.ended_at,
        nodes=[
            schemas.NodeView(
                node_rank=n.node_rank,
                agent_id=n.agent_id,
                agent_name=n.agent.name,
                slot_indices=list(n.slot_indices),
                state=schemas.NodeState(n.state),
                exit_code=n.exit_code,
            )
            for n in row.nodes
        ],
    )


def latest_metrics(session: Session, job_id: int) -> tuple[dict[str, float], int | None]:
    """The newest value of each metric name (any rank, newest attempt first), and the newest step."""
    values: dict[str, float] = {}
    step = None
    rows = session.execute(
        select(Allocation.latest_metrics, Allocation.latest_step)
        .where(Allocation.job_id == job_id, Allocation.latest_metrics.is_not(None))
        .order_by(Allocation.attempt)
    )
    for metrics, newest_step in rows:  # later attempts overwrite earlier ones (None: filtered out)
        values.update(metrics or {})
        step = newest_step
    return values, step


def agents(session: Session, rows: list[Agent]) -> list[schemas.Agent]:
    used: dict[tuple[int, str], int] = {
        (agent_id, slot_type): count
        for agent_id, slot_type, count in session.execute(
            select(SlotLease.agent_id, SlotLease.slot_type, func.count()).group_by(
                SlotLease.agent_id, SlotLease.slot_type
            )
        )
    }
    return [
        schemas.Agent(
            id=a.id,
            name=a.name,
            address=a.address,
            state=schemas.AgentState(a.state),
            cpu_slots=a.cpu_slots,
            gpu_slots=a.gpu_slots,
            used_cpu_slots=used.get((a.id, "cpu"), 0),
            used_gpu_slots=used.get((a.id, "gpu"), 0),
            registered_at=a.registered_at,
            last_heartbeat=a.last_heartbeat,
        )
        for a in rows
    ]


def log_record(row: LogLine) -> schemas.LogRecord:
    return schemas.LogRecord(
        id=row.id,
        allocation_id=row.allocation_id,
        rank=row.rank,
        stream=row.stream,
        time=row.time,
        line=row.line,
    )


def checkpoint(row: Checkpoint) -> schemas.CheckpointView:
    return schemas.CheckpointView(
        id=row.id,
        job_id=row.job_id,
        attempt=row.attempt,
        step=row.step,
        metrics=row.metrics,
        size_bytes=row.size_bytes,
        path=row.path,
        state=row.state,
        created_at=row.created_at,
    )
