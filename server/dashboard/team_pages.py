"""Teams: the user's teams and their members; forms to create a team (cluster admins) and to add,
re-role and remove members (the team's admins, cluster admins). The rules are `server.access`'s;
a refused form answers the error page with its status."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Request
from fastapi.responses import RedirectResponse, Response
from pydantic import ValidationError

from phalanx import schemas
from server import access, commands, views
from server.api.deps import SessionDep
from server.dashboard.render import CsrfChecked, SignedIn, render
from server.errors import Unprocessable

router = APIRouter(include_in_schema=False)

FormName = Annotated[str, Form(max_length=64)]


def team_name(value: str, what: str) -> str:
    try:
        return schemas.TeamRequest(name=value).name
    except ValidationError as exc:
        raise Unprocessable(f"{what} {value!r} is not a valid name: letters, digits, '.', '_' and '-'") from exc


@router.get("/teams", response_model=None)
def teams_page(request: Request, session: SessionDep, user: SignedIn) -> Response:
    with session.begin():
        teams = views.teams(session, user, list(session.scalars(access.visible_teams(user))))
    return render(request, "teams.html", teams=teams)


@router.post("/teams", response_model=None)
def create_team(session: SessionDep, user: SignedIn, _: CsrfChecked, name: FormName = "") -> Response:
    commands.create_team(session, user, schemas.TeamRequest(name=team_name(name, "team")))
    return RedirectResponse("/teams", status_code=303)


@router.post("/teams/{team}/members", response_model=None)
def set_member(
    team: str, session: SessionDep, user: SignedIn, _: CsrfChecked, member: FormName = "", role: FormName = "member"
) -> Response:
    """Add a member, or change a member's role."""
    chosen: schemas.TeamRole = "admin" if role == "admin" else "member"
    commands.set_team_member(session, user, team_name(team, "team"), team_name(member, "user"), chosen)
    return RedirectResponse("/teams", status_code=303)


@router.post("/teams/{team}/members/{member}/remove", response_model=None)
def remove_member(team: str, member: str, session: SessionDep, user: SignedIn, _: CsrfChecked) -> Response:
    commands.remove_team_member(session, user, team_name(team, "team"), team_name(member, "user"))
    return RedirectResponse("/teams", status_code=303)
