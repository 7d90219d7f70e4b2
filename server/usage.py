"""Usage accounting: slot-hours by user, team and slot type over a period.

Computed from allocation rows (`server.sharing.slot_intervals`: placement time to node exit), so
it needs no counter, survives restarts of every component, and a period in the past always gives
the same answer. Who sees what is `server.access`'s rule (`usage_visibility`), passed in.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from sqlalchemy.orm import Session

from phalanx import schemas
from server.errors import Unprocessable
from server.sharing import slot_hours, slot_intervals

MAX_PERIOD_DAYS = 3660


def usage_report(
    session: Session, visible: Callable[[str, str], bool], since: datetime, until: datetime
) -> schemas.UsageReport:
    """`visible(user, team)`: whose usage to count (`access.usage_visibility`)."""
    if until <= since:
        raise Unprocessable(f"until ({until.isoformat()}) must come after since ({since.isoformat()})")
    if (until - since).days > MAX_PERIOD_DAYS:
        raise Unprocessable(f"a usage period may span at most {MAX_PERIOD_DAYS} days; narrow since or until")
    totals: dict[tuple[str, str, str], float] = {}
    jobs: dict[tuple[str, str, str], set[int]] = {}
    for interval in slot_intervals(session, since, until):
        hours = slot_hours(interval, since, until)
        if hours <= 0 or not visible(interval.user, interval.team):
            continue
        key = (interval.team, interval.user, interval.slot_type)
        totals[key] = totals.get(key, 0.0) + hours
        jobs.setdefault(key, set()).add(interval.job_id)
    rows = [
        schemas.UsageRow(
            user=user,
            team=team or None,
            slot_type=schemas.SlotType(slot_type),
            slot_hours=round(hours, 6),
            jobs=len(jobs[(team, user, slot_type)]),
        )
        for (team, user, slot_type), hours in sorted(totals.items())
    ]
    by_team: dict[str, float] = {}
    by_slot_type: dict[str, float] = {}
    for (team, _, slot_type), hours in totals.items():
        by_team[team] = round(by_team.get(team, 0.0) + hours, 6)
        by_slot_type[slot_type] = round(by_slot_type.get(slot_type, 0.0) + hours, 6)
    return schemas.UsageReport(since=since, until=until, rows=rows, by_team=by_team, by_slot_type=by_slot_type)
