"""What workers send while they train: metric batches, fenced by allocation."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from pydantic import ValidationError
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from phalanx import schemas
from server.api.deps import AgentDep, SettingsDep, read_capped_body
from server.errors import Conflict, NotFound, Unprocessable
from server.ingest import insert_metrics, metric_rows
from server.models import Allocation

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
            row = session.execute(
                select(Allocation.job_id, Allocation.active).where(Allocation.id == allocation_id)
            ).one_or_none()
            if row is None:
                raise NotFound(f"allocation {allocation_id} does not exist")
            job_id, active = row
            if not active:
                raise Conflict(f"allocation {allocation_id} is no longer current; its workers must stop")
            insert_metrics(session, metric_rows(job_id, allocation_id, batch.records))

    await run_in_threadpool(store)
    return Response(status_code=204)
