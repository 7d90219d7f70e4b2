"""Sharing the cluster: the queue in placement order, usage by team and user with a chart, and the
team forms for shares (cluster admins) and queue holds (the team's admins, cluster admins). The
rules are `server.access`'s and `server.commands`'; a refused form answers the error page."""

from __future__ import annotations

from datetime import date, datetime, time, timedelta
from typing import Annotated

from fastapi import APIRouter, Form, Query, Request
from fastapi.responses import RedirectResponse, Response
from pydantic import ValidationError

from phalanx import schemas
from server import access, commands, views
from server.api.deps import SessionDep, SettingsDep
from server.api.usage import MAX_TIME, MIN_TIME
from server.dashboard.render import CsrfChecked, SignedIn, render
from server.dashboard.team_pages import team_name
from server.errors import Unprocessable
from server.queue_status import queue_snapshot
from server.transitions import db_now
from server.usage import usage_report

router = APIRouter(include_in_schema=False)

SlotsField = Annotated[str, Form(max_length=200)]
CHART_WIDTH = 480  # px of the longest bar


def _slots(field: str, text: str) -> dict[schemas.SlotType, int | None] | None:
    """A form field's slot counts; empty leaves that part of the share as it is."""
    if not text.strip():
        return None
    try:
        return schemas.parse_slot_counts(text)
    except ValueError as exc:
        raise Unprocessable(f"{field} {text!r}: {exc}") from exc


def _weight(text: str) -> float | None:
    if not text.strip():
        return None
    try:
        return float(text)
    except ValueError as exc:
        raise Unprocessable(f"weight {text!r}: give a number from 0.001 to 1000") from exc


@router.post("/teams/{team}/policy", response_model=None)
def set_policy(
    team: str,
    session: SessionDep,
    user: SignedIn,
    _: CsrfChecked,
    weight: Annotated[str, Form(max_length=32)] = "",
    guarantee: SlotsField = "",
    limit: SlotsField = "",
    user_limit: SlotsField = "",
) -> Response:
    """Weight, guarantees and limits (cluster admins)."""
    try:
        change = schemas.TeamPolicyRequest(
            weight=_weight(weight),
            guarantee=_slots("guarantee", guarantee),
            limit=_slots("limit", limit),
            user_limit=_slots("user limit", user_limit),
        )
    except ValidationError as exc:  # out of bounds: a weight outside 0.001-1000, a count over 1,000,000
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise Unprocessable(f"the team's share is out of bounds ({problems})") from exc
    commands.set_team_policy(session, user, team_name(team, "team"), change)
    return RedirectResponse("/teams", status_code=303)


@router.post("/teams/{team}/hold", response_model=None)
def hold_team(team: str, session: SessionDep, user: SignedIn, _: CsrfChecked) -> Response:
    """Hold the team's queue (its admins, cluster admins): its queued jobs wait until released."""
    commands.hold_team(session, user, team_name(team, "team"), True)
    return RedirectResponse("/teams", status_code=303)


@router.post("/teams/{team}/release", response_model=None)
def release_team(team: str, session: SessionDep, user: SignedIn, _: CsrfChecked) -> Response:
    commands.hold_team(session, user, team_name(team, "team"), False)
    return RedirectResponse("/teams", status_code=303)


@router.get("/queue", response_model=None)
def queue_page(request: Request, session: SessionDep, settings: SettingsDep, user: SignedIn) -> Response:
    with session.begin():
        snapshot = queue_snapshot(session, settings, showing=views.newest_queued(session))
        queue = views.queue_view(session, access.readable_queued_jobs(session, user), snapshot, limit=1000)
    return render(request, "queue.html", queue=queue)


def _day(value: str, what: str) -> datetime | None:
    """A date as midnight UTC, clamped as the REST route clamps (9999-12-31 plus a day overflows)."""
    if not value:
        return None
    try:
        day = datetime.combine(date.fromisoformat(value), time())
    except ValueError as exc:
        raise Unprocessable(f"{what} {value!r} is not a date; write it as 2026-12-01") from exc
    return min(max(day, MIN_TIME), MAX_TIME)


@router.get("/usage", response_model=None)
def usage_page(
    request: Request,
    session: SessionDep,
    user: SignedIn,
    since: Annotated[str, Query(max_length=32)] = "",
    until: Annotated[str, Query(max_length=32)] = "",
) -> Response:
    """Slot-hours by team, user and slot type over whole days (default: the last 7 days)."""
    start, end = _day(since, "since"), _day(until, "until")
    with session.begin():
        now = db_now(session)
        end = end + timedelta(days=1) if end is not None else now
        visible = access.usage_visibility(session, user)
        report = usage_report(session, visible, start or end - timedelta(days=7), end)
    top = max(report.by_team.values(), default=0.0) or 1.0
    bars = [
        (team or "(no team)", hours, round(CHART_WIDTH * hours / top))
        for team, hours in sorted(report.by_team.items(), key=lambda item: -item[1])
    ]
    return render(
        request,
        "usage.html",
        report=report,
        bars=bars,
        chart_width=CHART_WIDTH,
        since=(start or report.since).date().isoformat(),
        until=(end - timedelta(days=1)).date().isoformat() if until else "",
    )
