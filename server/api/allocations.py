"""What workers send while they train: metric batches, fenced by allocation."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from phalanx import schemas
from server import access, attempts, checkpoints, views
from server.api.deps import ReporterDep, RowId, Services, ServicesDep, SessionDep, SettingsDep
from server.api.uploads import invalid_batch
from server.errors import Conflict, NotFound
from server.ingest import batch_identity, first_delivery, insert_metrics, record_progress
from server.models import Allocation, MetricBatch, TuningStudy, TuningTrial
from server.task_names import ADVANCE_STUDY_TASK
from server.wakeups import note_job_data, note_task

router = APIRouter(prefix="/allocations", tags=["allocations"])


@router.post("/{allocation_id}/metrics", status_code=204)
async def post_metrics(
    allocation_id: RowId, request: Request, services: ServicesDep, reporter: ReporterDep
) -> Response:
    """Store a batch of `report()` records. 409 once the allocation is superseded or ended."""
    raw = await request.body()  # capped while it streamed (server/body_caps.py)
    try:
        batch = schemas.MetricBatchIn.model_validate_json(raw)
    except ValidationError as exc:
        raise invalid_batch("metric batch", exc) from exc

    def store() -> None:
        """Store the batch (a retried one was stored already); the live charts are woken, and a
        trial's study is driven when the batch carries its objective (intermediate values for
        Optuna, and its pruner's verdict)."""
        with services.sessions() as session, session.begin():
            access.may_report_for(session, reporter, allocation_id)
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
            if not first_delivery(session, MetricBatch, allocation_id, batch_identity(batch.batch_id, raw)):
                return  # a retry of a batch whose answer was lost: stored already
            insert_metrics(session, job_id, allocation_id, batch.records)
            # last (a row lock until commit): progress for hang detection, and the latest values
            record_progress(session, allocation_id, batch.records)
            note_job_data(session, job_id)
            if study_id is not None:
                objectives = objective_metrics(services, session, study_id)
                if any(objectives.intersection(r.values) for r in batch.records):
                    note_task(session, ADVANCE_STUDY_TASK, study_id)

    await run_in_threadpool(store)
    return Response(status_code=204)


def objective_metrics(services: Services, session: Session, study_id: int) -> frozenset[str]:
    """The metrics a study optimises (specs never change: cached per process)."""
    cache = services.study_objectives
    if study_id not in cache:
        spec = session.execute(select(TuningStudy.spec).where(TuningStudy.id == study_id)).scalar_one()
        cache[study_id] = frozenset(o.metric for o in schemas.StudySpec.model_validate(spec).objectives)
    return cache[study_id]


@router.post("/{allocation_id}/checkpoints", status_code=201, response_model=schemas.CheckpointView)
def commit_checkpoint(
    allocation_id: RowId,
    body: schemas.CheckpointCommit,
    session: SessionDep,
    settings: SettingsDep,
    reporter: ReporterDep,
) -> schemas.CheckpointView:
    """Rank 0 reports a checkpoint whose files were renamed into place. 409 once superseded."""
    with session.begin():
        access.may_report_for(session, reporter, allocation_id)
        allocation = session.get(Allocation, allocation_id)
        if allocation is None:
            raise NotFound(f"allocation {allocation_id} does not exist")
        job = attempts.lock_job(session, allocation.job_id)
        row = checkpoints.commit(session, allocation, job, body, settings.checkpoint_uri)
        return views.checkpoint(row)
