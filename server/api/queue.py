"""The queue in placement order, with each job's place, reason and estimated start."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from phalanx import schemas
from server import access, views
from server.api.deps import SessionDep, SettingsDep, UserDep
from server.queue_status import queue_snapshot

router = APIRouter(prefix="/queue", tags=["queue"])


@router.get("", response_model=schemas.QueueView)
def show_queue(
    session: SessionDep,
    settings: SettingsDep,
    user: UserDep,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> schemas.QueueView:
    """Every queued job in the order the next scheduling pass considers them, held jobs last. Jobs
    you may not read show only their team, size and place."""
    with session.begin():
        snapshot = queue_snapshot(session, settings, showing=views.newest_queued(session))
        return views.queue_view(session, access.readable_queued_jobs(session, user), snapshot, limit)
