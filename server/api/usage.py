"""Usage accounting: slot-hours by user, team and slot type over a period."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Query

from phalanx import schemas
from server import access
from server.api.deps import SessionDep, UserDep
from server.transitions import db_now
from server.usage import usage_report

router = APIRouter(prefix="/usage", tags=["usage"])
MIN_TIME = datetime(2000, 1, 1)
MAX_TIME = datetime(2200, 1, 1)


@router.get("", response_model=schemas.UsageReport)
def show_usage(
    session: SessionDep,
    user: UserDep,
    since: Annotated[datetime | None, Query(description="Start of the period (UTC); default: 7 days ago")] = None,
    until: Annotated[datetime | None, Query(description="End of the period (UTC); default: now")] = None,
) -> schemas.UsageReport:
    """Slot-hours your jobs and your teams' jobs held in the period (a cluster admin's: everyone's)."""
    with session.begin():
        now = db_now(session)
        end = _naive_utc(until) if until is not None else now
        start = _naive_utc(since) if since is not None else end - timedelta(days=7)
        return usage_report(session, access.usage_visibility(session, user), start, end)


def _naive_utc(moment: datetime) -> datetime:
    """The database keeps naive UTC: an aware time is shifted to UTC, a naive one is taken as UTC.
    Clamped first, so that year 1 or 9999 with an offset cannot overflow."""
    offset = moment.utcoffset() or timedelta(0)
    moment = min(max(moment.replace(tzinfo=None), MIN_TIME), MAX_TIME) - offset
    return min(max(moment, MIN_TIME), MAX_TIME)
