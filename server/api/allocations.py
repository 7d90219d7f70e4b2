"""What workers send while they train: metric batches, fenced by allocation."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from phalanx import schemas
from server import access, attempts, checkpoints, profiles, views
from server.api.deps import (
    RankNumber,
    ReporterDep,
    RowId,
    ServicesDep,
    SessionDep,
    SettingsDep,
)
from server.api.uploads import invalid_batch
from server.errors import NotFound, Unprocessable
from server.ingest import batch_identity
from server.metric_batches import IncomingBatch
from server.models import Allocation, ProfileTrace
from server.wakeups import note_job_data

router = APIRouter(prefix="/allocations", tags=["allocations"])


@router.post(
    "/{allocation_id}/metrics",
    status_code=204,
    responses={200: {"model": schemas.MetricBatchAnswer, "description": "Stored; the ranks are asked for a profile"}},
)
async def post_metrics(
    allocation_id: RowId, request: Request, services: ServicesDep, reporter: ReporterDep
) -> Response:
    """Store a batch of `report()` records, once however often it is sent (in one transaction with
    the batches that arrive meanwhile: `server/metric_batches.py`). 409 once the allocation is
    superseded or ended. While the attempt's ranks are asked to record a profile, the answer (200)
    says which and how many steps (`MetricBatchAnswer`); otherwise it is empty (204)."""
    raw = await request.body()  # capped while it streamed (server/body_caps.py)
    try:
        batch = schemas.MetricBatchIn.model_validate_json(raw)
    except ValidationError as exc:
        raise invalid_batch("metric batch", exc) from exc

    order = await services.metric_writer.store(
        IncomingBatch(reporter, allocation_id, batch_identity(batch.batch_id, raw), batch.records)
    )
    if order is None:
        return Response(status_code=204)
    answer = schemas.MetricBatchAnswer(profile=order)
    return Response(answer.model_dump_json(), status_code=200, media_type="application/json")


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


@router.put(
    "/{allocation_id}/profiles/{profile_id}/ranks/{rank}",
    status_code=204,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/gzip": {"schema": {"type": "string", "format": "binary"}},
                "application/json": {"schema": schemas.ProfileFailure.model_json_schema()},
            },
        }
    },
)
async def put_profile_trace(
    allocation_id: RowId,
    profile_id: RowId,
    rank: RankNumber,
    request: Request,
    services: ServicesDep,
    settings: SettingsDep,
    reporter: ReporterDep,
) -> Response:
    """A rank's answer to a profile request: its gzipped Chrome trace (`application/gzip`), or a
    `ProfileFailure` (`application/json`) saying why it has none. The first answer per rank
    stands; a resend is a no-op. A trace that is not one is refused (422) and changes nothing."""
    raw = await request.body()  # capped while it streamed (server/body_caps.py)
    kind = request.headers.get("content-type", "").split(";")[0].strip()
    failure: schemas.ProfileFailure | None = None
    if kind == "application/json":
        try:
            failure = schemas.ProfileFailure.model_validate_json(raw)
        except ValidationError as exc:
            raise invalid_batch("profile failure", exc) from exc
    elif kind != "application/gzip":
        raise Unprocessable(
            f"content type {kind or 'none'!r}: send the trace as application/gzip, or why there is none "
            'as application/json ({"message": ...})'
        )

    def answered() -> int | None:
        """The job's id if this rank has yet to answer (404/422/403 for what is not its to answer)."""
        with services.sessions() as session, session.begin():
            access.may_report_for(session, reporter, allocation_id)
            profile = profiles.profile_for_rank(session, allocation_id, profile_id, rank)
            return None if session.get(ProfileTrace, (profile_id, rank)) is not None else profile.job_id

    def store(job_id: int) -> None:
        summary = path = None
        if failure is None:
            summary = profiles.summarise_upload(raw)
            path = profiles.write_trace(settings, job_id, profile_id, rank, raw)
        try:
            with services.sessions() as session, session.begin():
                profile = profiles.profile_for_rank(session, allocation_id, profile_id, rank)
                kept = profiles.record_answer(
                    session,
                    profile,
                    rank,
                    path=path,
                    size_bytes=len(raw) if path else 0,
                    summary=summary,
                    error=failure.message if failure else None,
                )
                note_job_data(session, job_id)
        except BaseException:
            kept = False
            raise
        finally:
            if path is not None and not kept:
                (settings.data_dir / path).unlink(missing_ok=True)

    job_id = await run_in_threadpool(answered)
    if job_id is not None:
        await run_in_threadpool(store, job_id)
    return Response(status_code=204)
