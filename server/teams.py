"""Teams: creating them, their members and roles, and which team a new job or study joins.

Who may do these is `server.access`'s to decide; these functions only apply the rules. Membership
changes of one team run under that team's row lock, so two admins changing the same team never
lose each other's change. Functions flush, never commit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from phalanx.schemas import SlotType, TeamPolicyRequest
from server.auth import Principal
from server.errors import Conflict, NotFound, Unprocessable
from server.models import Team, TeamMember, User
from server.wakeups import note_schedule

ROLES = ("member", "admin")


def get_team(session: Session, name: str, *, lock: bool = False) -> Team | None:
    query = select(Team).where(Team.name == name).options(selectinload(Team.members).selectinload(TeamMember.user))
    if lock:
        query = query.with_for_update(of=Team).execution_options(populate_existing=True)
    return session.scalars(query).one_or_none()


def create_team(session: Session, name: str) -> Team:
    if session.scalars(select(Team.id).where(Team.name == name)).first() is not None:
        raise Conflict(f"team {name!r} exists already; pick another name (`phalanx teams list` shows yours)")
    team = Team(name=name)
    session.add(team)
    session.flush()
    return team


def _user(session: Session, name: str) -> User:
    user = session.scalars(select(User).where(User.name == name)).one_or_none()
    if user is None:
        raise NotFound(f"there is no user {name!r}; a cluster admin creates users with `phalanx tokens create {name}`")
    return user


def set_member(session: Session, team: Team, user_name: str, role: str) -> None:
    """Add the user to the (locked) team with `role`, or change their role."""
    user = _user(session, user_name)
    member = session.get(TeamMember, (team.id, user.id))
    if member is None:
        session.add(TeamMember(team_id=team.id, user_id=user.id, role=role))
    else:
        member.role = role
    session.flush()
    session.expire(team, ["members"])


def remove_member(session: Session, team: Team, user_name: str) -> None:
    """Take the user out of the (locked) team; their jobs in it stay, and stay theirs."""
    user = _user(session, user_name)
    member = session.get(TeamMember, (team.id, user.id))
    if member is None:
        raise NotFound(f"{user_name!r} is not a member of team {team.name!r}")
    session.delete(member)
    session.flush()
    session.expire(team, ["members"])


def _merged(current: dict[str, int], change: Mapping[SlotType, int | None] | None) -> dict[str, int]:
    merged = dict(current)
    for slot_type, count in (change or {}).items():
        if count is None:
            merged.pop(str(slot_type), None)
        else:
            merged[str(slot_type)] = count
    return merged


def set_policy(session: Session, team: Team, change: TeamPolicyRequest) -> None:
    """Apply `change` to the (locked) team's weight, guarantees and limits; fields left out stay.
    422 when a guarantee would exceed the team's limit (it could never be met)."""
    guarantee = _merged(team.guarantee or {}, change.guarantee)
    limit = _merged(team.slot_limit or {}, change.limit)
    user_limit = _merged(team.user_limit or {}, change.user_limit)
    for slot_type, slots in guarantee.items():
        if slot_type in limit and slots > limit[slot_type]:
            raise Unprocessable(
                f"guarantee: team {team.name!r} would be guaranteed {slots} {slot_type} slots but limited to "
                f"{limit[slot_type]}; raise the limit or lower the guarantee"
            )
    if change.weight is not None:
        team.weight = change.weight
    team.guarantee, team.slot_limit, team.user_limit = guarantee, limit, user_limit
    session.flush()
    note_schedule(session)  # the next pass orders the queue by the new shares


def set_queue_held(session: Session, team: Team, held: bool) -> None:
    """Hold (or release) the (locked) team's queue: its queued jobs wait; running ones go on."""
    team.queue_held = held
    session.flush()
    note_schedule(session)


def teams_of(session: Session, user_id: int | None) -> Sequence[tuple[Team, str]]:
    """The user's teams with their role in each, by name."""
    if user_id is None:
        return []
    rows = session.execute(
        select(Team, TeamMember.role)
        .join(TeamMember, TeamMember.team_id == Team.id)
        .where(TeamMember.user_id == user_id)
        .order_by(Team.name)
    )
    return [(team, role) for team, role in rows]


def team_for_new_work(
    session: Session, principal: Principal, requested: str | None, field: str = "team"
) -> Team | None:
    """The team a job or study `principal` submits joins: the one it names (a member's, or any for
    a cluster admin), else the submitter's only team, else none. 422 names the field and the
    submitter's teams when the choice is missing or not theirs."""
    mine = teams_of(session, principal.user_id)
    names = ", ".join(team.name for team, _ in mine) or "none"
    if requested is None:
        if len(mine) > 1:
            raise Unprocessable(f"{field}: you are in several teams ({names}); say which one with `{field}: NAME`")
        return mine[0][0] if mine else None
    for team, _ in mine:
        if team.name == requested:
            return team
    # the team alone: its members (what get_team loads besides) were two more queries a submit
    named = session.scalars(select(Team).where(Team.name == requested)).one_or_none() if principal.is_admin else None
    if named is None:
        raise Unprocessable(f"{field}: you are not a member of team {requested!r}; your teams: {names}")
    return named
