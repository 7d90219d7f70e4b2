"""Teams: cluster admins create them; their admins (and cluster admins) add and remove members and
set roles; members see their teams. Jobs and studies name their team (`team:` in their file)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from phalanx import schemas
from server import access, commands, views
from server.api.deps import SessionDep, UserDep

router = APIRouter(prefix="/teams", tags=["teams"])

Name = Annotated[str, Path(pattern=schemas.NAME_PATTERN)]


@router.post("", status_code=201, response_model=schemas.TeamView)
def create_team(body: schemas.TeamRequest, session: SessionDep, user: UserDep) -> schemas.TeamView:
    """A new, empty team (cluster admins); add its members next."""
    return commands.create_team(session, user, body)


@router.get("", response_model=list[schemas.TeamView])
def list_teams(session: SessionDep, user: UserDep) -> list[schemas.TeamView]:
    """Your teams with their members; a cluster admin's list has every team."""
    with session.begin():
        return views.teams(session, user, list(session.scalars(access.visible_teams(user))))


@router.get("/{team}", response_model=schemas.TeamView)
def show_team(team: Name, session: SessionDep, user: UserDep) -> schemas.TeamView:
    with session.begin():
        return views.team(session, user, access.team_for(session, user, team))


@router.patch("/{team}", response_model=schemas.TeamView)
def set_policy(team: Name, body: schemas.TeamPolicyRequest, session: SessionDep, user: UserDep) -> schemas.TeamView:
    """Set the team's weight, guarantees and limits (cluster admins); fields left out stay as they are."""
    return commands.set_team_policy(session, user, team, body)


@router.post("/{team}/hold", response_model=schemas.TeamView)
def hold_team(team: Name, session: SessionDep, user: UserDep) -> schemas.TeamView:
    """Hold the team's queue: its queued jobs wait until released (the team's admins, cluster admins)."""
    return commands.hold_team(session, user, team, True)


@router.post("/{team}/release", response_model=schemas.TeamView)
def release_team(team: Name, session: SessionDep, user: UserDep) -> schemas.TeamView:
    return commands.hold_team(session, user, team, False)


@router.put("/{team}/members/{member}", response_model=schemas.TeamView)
def set_member(
    team: Name, member: Name, body: schemas.MembershipRequest, session: SessionDep, user: UserDep
) -> schemas.TeamView:
    """Add `member` to the team with `role`, or change their role (the team's admins, cluster admins)."""
    return commands.set_team_member(session, user, team, member, body.role)


@router.delete("/{team}/members/{member}", response_model=schemas.TeamView)
def remove_member(team: Name, member: Name, session: SessionDep, user: UserDep) -> schemas.TeamView:
    """Take `member` out of the team; the jobs they ran in it stay in it, and stay theirs."""
    return commands.remove_team_member(session, user, team, member)
