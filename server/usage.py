"""Usage accounting: slot-hours by user, team and slot type over a period.

Computed from allocation rows (`server.sharing.slot_intervals`: placement time to node exit), so
it needs no counter, survives restarts of every component, and a period in the past always gives
the same answer. Who sees what is `server.access`'s rule: a cluster admin everyone's, a user their
own jobs' and their teams' jobs'.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from phalanx import schemas
from server.auth import Principal
from server.errors import Unprocessable
from server.models import Team, TeamMember, User
from server.sharing import slot_hours, slot_intervals

MAX_PERIOD_DAYS = 3660


def usage_report(session: Session, principal: Principal, since: datetime, until: datetime) -> schemas.UsageReport:
    if until <= since:
        raise Unprocessable(f"until ({until.isoformat()}) must come after since ({since.isoformat()})")
    if (until - since).days > MAX_PERIOD_DAYS:
        raise Unprocessable(f"a usage period may span at most {MAX_PERIOD_DAYS} days; narrow since or until")
    me = session.get(User, principal.user_id) if principal.user_id is not None else None
    my_teams = set(session.scalars(select(Team.name).join(TeamMember).where(TeamMember.user_id == principal.user_id)))
    totals: dict[tuple[str, str, str], float] = {}
    jobs: dict[tuple[str, str, str], set[int]] = {}
    for interval in slot_intervals(session, since, until):
        visible = principal.is_admin or (me is not None and interval.user == me.name) or interval.team in my_teams
        hours = slot_hours(interval, since, until)
        if not visible or hours <= 0:
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
