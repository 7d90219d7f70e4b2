"""What workers send while they train: metric batches, fenced by allocation."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import State

from phalanx import schemas
from server import checkpoints, lifecycle, views
from server.api.deps import AgentDep, SessionDep, SettingsDep, read_capped_body
from server.errors import Conflict, NotFound, Unprocessable
from server.ingest import first_delivery, insert_metrics, record_progress
from server.models import Allocation, TuningStudy, TuningTrial
from server.wakeups import job_data_channel

router = APIRouter(prefix="/allocations", tags=["allocations"])


@router.post("/{allocation_id}/metrics", status_code=204)
async def post_metrics(allocation_id: int, request: Request, settings: SettingsDep, _: AgentDep) -> Response:
    """Store a batch of `report()` records. 409 once the allocation is superseded or ended."""
    raw = await read_capped_body(request, settings.max_metric_batch_bytes, "the metric batch")
    try:
        batch = schemas.MetricBatchIn.model_validate_json(raw)
    except ValidationError as exc:
        raise Unprocessable(f"invalid metric batch: {exc.errors()[0]['msg']}", exc.errors()[:10]) from exc

    def store() -> tuple[int, int | None] | None:
        """Store the batch; returns its job and the study to drive when it carries a trial's
        objective (None for a retried batch, stored already)."""
        with request.app.state.sessions() as session, session.begin():
            row = session.execute(
                select(Allocation.job_id, Allocation.active, Allocation.fenced, TuningTrial.study_id)
                .outerjoin(TuningTrial, TuningTrial.job_id == Allocation.job_id)
                .where(Allocation.id == allocation_id)
            ).one_or_none()
            if row is None:
                raise NotFound(f"allocation {allocation_id} does not exist")
            job_id, active, fenced, study_id = row
            if fenced or not active:
                raise Conflict(f"allocation {allocation_id} is no longer current; its workers must stop")
            if batch.batch_id is not None and not first_delivery(session, allocation_id, batch.batch_id):
                return None  # a retry of a batch whose answer was lost: stored already
            insert_metrics(session, job_id, allocation_id, batch.records)
            # last (a row lock until commit): progress for hang detection, and the latest values
            record_progress(session, allocation_id, batch.records)
            if study_id is None:
                return job_id, None
            objectives = objective_metrics(request.app.state, session, study_id)
        return job_id, study_id if any(objectives.intersection(r.values) for r in batch.records) else None

    stored = await run_in_threadpool(store)
    if stored is None:
        return Response(status_code=204)
    job_id, study_id = stored
    request.app.state.publisher.publish([job_data_channel(job_id)])  # live charts
    if study_id is not None:  # intermediate values for Optuna, and its pruner's verdict
        request.app.state.drive_study(study_id)
    return Response(status_code=204)


def objective_metrics(state: State, session: Session, study_id: int) -> frozenset[str]:
    """The metrics a study optimises (specs never change: cached per process)."""
    cache: dict[int, frozenset[str]] = state.study_objectives
    if study_id not in cache:
        spec = session.execute(select(TuningStudy.spec).where(TuningStudy.id == study_id)).scalar_one()
        cache[study_id] = frozenset(o.metric for o in schemas.StudySpec.model_validate(spec).objectives)
    return cache[study_id]


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
    request.app.state.publisher.publish([job_data_channel(job.id)])
    request.app.state.enqueue("phalanx.delete_checkpoints", job.id)
    return result
