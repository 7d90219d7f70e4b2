"""What workers send while they train: metric batches, fenced by allocation."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from pydantic import ValidationError
from sqlalchemy import select, update
from starlette.concurrency import run_in_threadpool

from phalanx import schemas
from server import checkpoints, lifecycle, views
from server.api.deps import AgentDep, SessionDep, SettingsDep, read_capped_body
from server.errors import Conflict, NotFound, Unprocessable
from server.ingest import first_delivery, insert_metrics, metric_rows
from server.models import Allocation, utcnow

router = APIRouter(prefix="/allocations", tags=["allocations"])


@router.post("/{allocation_id}/metrics", status_code=204)
async def post_metrics(allocation_id: int, request: Request, settings: SettingsDep, _: AgentDep) -> Response:
    """Store a batch of `report()` records. 409 once the allocation is superseded or ended."""
    raw = await read_capped_body(request, settings.max_metric_batch_bytes, "the metric batch")
    try:
        batch = schemas.MetricBatch.model_validate_json(raw)
    except ValidationError as exc:
        raise Unprocessable(f"invalid metric batch: {exc.errors()[0]['msg']}", exc.errors()[:10]) from exc

    def store() -> None:
        with request.app.state.sessions() as session, session.begin():
            # The row lock orders concurrent batches of one allocation (its latest metrics merge).
            row = session.execute(
                select(
                    Allocation.job_id,
                    Allocation.active,
                    Allocation.fenced,
                    Allocation.latest_metrics,
                    Allocation.latest_step,
                )
                .where(Allocation.id == allocation_id)
                .with_for_update()
            ).one_or_none()
            if row is None:
                raise NotFound(f"allocation {allocation_id} does not exist")
            job_id, active, fenced, latest, latest_step = row
            if fenced or not active:
                raise Conflict(f"allocation {allocation_id} is no longer current; its workers must stop")
            if batch.batch_id is not None and not first_delivery(session, allocation_id, batch.batch_id):
                return  # a retry of a batch whose answer was lost: stored already
            insert_metrics(session, metric_rows(job_id, allocation_id, batch.records))
            latest = dict(latest or {})
            for record in batch.records:
                latest.update(record.values)
            steps = [record.step for record in batch.records]
            if latest_step is not None:
                steps.append(latest_step)
            # last_progress_at: progress for hang detection, on the database clock
            session.execute(
                update(Allocation)
                .where(Allocation.id == allocation_id)
                .values(
                    last_progress_at=utcnow(),
                    latest_metrics=latest,
                    latest_step=max(steps, default=None),
                )
            )

    await run_in_threadpool(store)
    return Response(status_code=204)


@router.post("/{allocation_id}/checkpoints", status_code=201, response_model=schemas.CheckpointView)
def commit_checkpoint(
    allocation_id: int,
    body: schemas.CheckpointCommit,
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    _: AgentDep,
) -> schemas.CheckpointView:
    """Rank 0 reports a checkpoint whose files were renamed into place. 409 once superseded."""
    with session.begin():
        allocation = session.get(Allocation, allocation_id)
        if allocation is None:
            raise NotFound(f"allocation {allocation_id} does not exist")
        job = lifecycle.get_job(session, allocation.job_id, lock=True)
        row = checkpoints.commit(session, allocation, job, body, settings.checkpoint_uri)
        result = views.checkpoint(row)
    request.app.state.enqueue("phalanx.delete_checkpoints", job.id)
    return result
