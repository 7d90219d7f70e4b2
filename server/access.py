"""Who may see and change what: the one place every REST route, SSE stream and dashboard page asks.

Jobs and studies (a trial's job is in its study's team):
- read: their owner, every member of their team, cluster admins;
- act (kill, pause, resume, stop): their owner, an admin of their team, cluster admins (a member
  who may read but not act gets 403 naming who may).
Someone else's object that a principal may not read answers 404, as an unknown one does, so ids
reveal nothing.

Teams: members see their team and its members; team admins add and remove members, set roles, and
hold their team's queue and jobs; cluster admins create teams, set their weights, guarantees and
limits, and manage all. Usage: a cluster admin sees everyone's; a user their own and their teams'.
The queue: everyone sees every job's place, team and size, but only the jobs they may read by name.
Agents: every user lists them, with the names of only the jobs they may read; only a cluster
admin drains one. Tokens: a user lists and revokes their
own, a cluster admin all; only a cluster admin mints them.

Profiles of a job: asked for and deleted by who may act on the job, read and downloaded by who
may read it. Scaling runs: as jobs (read: owner, team, admins; cancel: owner, team admin, admins).

Machine principals: an agent's own token acts for that agent only (`agent_acts_as`); the cluster's
bootstrap agent token only registers agents. A job's ranks hold their allocation's own token: it
reports metrics and checkpoints for that allocation and reaches nothing else.

Each `*_for` reads the row (locked when `lock`) or raises `NotFound`; each `visible_*` is the
query of what a principal may list, for callers that add their own filters and paging.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

from sqlalchemy import ColumnElement, Select, or_, select, true
from sqlalchemy.orm import Session, selectinload
from sqlalchemy.orm.interfaces import ORMOption

from server import views
from server.attempts import lock_job
from server.auth import Principal
from server.errors import Forbidden, NotFound
from server.models import Allocation, AllocationNode, ApiToken, Job, ScalingRun, Team, TeamMember, TuningStudy, User
from server.studies import get_study
from server.teams import get_team


def _team_ids(principal: Principal, *, admin: bool = False) -> Select[int]:
    query = select(TeamMember.team_id).where(TeamMember.user_id == principal.user_id)
    return query.where(TeamMember.role == "admin") if admin else query


def _role_in(session: Session, principal: Principal, team_id: int | None) -> str | None:
    if team_id is None or principal.user_id is None:
        return None
    member = session.get(TeamMember, (team_id, principal.user_id))
    return member.role if member else None


def member_teams(session: Session, principal: Principal) -> list[int]:
    """The ids of the teams `principal` is in, for `job_readable(principal, teams)` (none for an admin:
    they read every job)."""
    if principal.is_admin or principal.user_id is None:
        return []
    return list(session.scalars(_team_ids(principal)))


def job_readable(principal: Principal, teams: Collection[int] | None = None) -> ColumnElement[bool]:
    """The SQL condition on `Job` for the jobs `principal` may read. With `teams` (`member_teams`,
    read in the same transaction) it holds their ids as values rather than a subquery: PostgreSQL
    then estimates from its statistics how many jobs match and, for a user with few jobs, reads
    them through the owner and team indexes instead of walking every job newest first (EXPLAIN at
    100,000 jobs, a user with no jobs: 55 ms, under 1 ms so). Lists use it; one-row checks need not."""
    if principal.is_admin:
        return true()
    team_ids = _team_ids(principal) if teams is None else list(teams)
    return or_(Job.owner_id == principal.user_id, Job.team_id.in_(team_ids))


def visible_jobs(principal: Principal, teams: Collection[int] | None = None) -> Select[*tuple[Any, ...]]:
    """What `principal` may list, as the rows `views.jobs` shows (`teams`: as for `job_readable`)."""
    return views.job_rows().where(job_readable(principal, teams))


def readable_queued_jobs(session: Session, principal: Principal) -> set[int]:
    """The QUEUED jobs the queue may name to `principal` (the others show only team and size)."""
    query = select(Job.id).where(Job.state == "QUEUED", job_readable(principal))
    return set(session.scalars(query))


def usage_visibility(session: Session, principal: Principal) -> Callable[[str, str], bool]:
    """Whose usage `principal` may see, as a test on (user name, team name; "" for no team): a
    cluster admin everyone's; a user their own jobs' and their teams' jobs'."""
    if principal.is_admin:
        return lambda user, team: True
    me = session.get(User, principal.user_id) if principal.user_id is not None else None
    teams = set(session.scalars(select(Team.name).where(Team.id.in_(_team_ids(principal)))))
    return lambda user, team: (me is not None and user == me.name) or (team != "" and team in teams)


def visible_studies(principal: Principal) -> Select[TuningStudy]:
    query = select(TuningStudy).options(selectinload(TuningStudy.owner))
    if principal.is_admin:
        return query
    return query.where(or_(TuningStudy.owner_id == principal.user_id, TuningStudy.team_id.in_(_team_ids(principal))))


def _may_read(session: Session, principal: Principal, owner_id: int, team_id: int | None) -> bool:
    return principal.is_admin or owner_id == principal.user_id or _role_in(session, principal, team_id) is not None


def _may_act(session: Session, principal: Principal, owner_id: int, team_id: int | None) -> bool:
    return principal.is_admin or owner_id == principal.user_id or _role_in(session, principal, team_id) == "admin"


def _no_job(job_id: int) -> NotFound:
    return NotFound(
        f"There is no job {job_id} that you can see: it does not exist or is neither yours nor your team's "
        "(`phalanx jobs list` lists those you can see)."
    )


def job_for(
    session: Session, principal: Principal, job_id: int, *, lock: bool = False, loads: Sequence[ORMOption] = ()
) -> Job:
    """The job, if `principal` may read it; locked (re-read) when `lock`; with its relationships
    in `loads` loaded when this session had not loaded it yet."""
    job = session.get(Job, job_id, options=loads)
    if job is None or not _may_read(session, principal, job.owner_id, job.team_id):
        raise _no_job(job_id)
    return lock_job(session, job_id) if lock else job


def job_to_change(session: Session, principal: Principal, job_id: int) -> Job:
    """The job, locked, if `principal` may act on it (404 if they may not even read it, else 403)."""
    job = job_for(session, principal, job_id)
    if not _may_act(session, principal, job.owner_id, job.team_id):
        raise Forbidden(
            f"job {job_id} belongs to {job.owner.name}: only they, an admin of its team or a cluster admin "
            "may change it"
        )
    return lock_job(session, job_id)


def may_change_job(session: Session, principal: Principal, job: Job) -> bool:
    """Whether to offer `principal` the job's kill, pause and resume buttons."""
    return _may_act(session, principal, job.owner_id, job.team_id)


def study_for(session: Session, principal: Principal, study_id: int) -> TuningStudy:
    """The study, if `principal` may read it."""
    study = session.get(TuningStudy, study_id)
    if study is None or not _may_read(session, principal, study.owner_id, study.team_id):
        raise NotFound(
            f"There is no study {study_id} that you can see: it does not exist or is neither yours nor your "
            "team's (`phalanx studies list` lists those you can see)."
        )
    return study


def study_to_change(session: Session, principal: Principal, study_id: int) -> TuningStudy:
    """The study, locked, if `principal` may act on it (404 if they may not read it, else 403)."""
    study = study_for(session, principal, study_id)
    if not _may_act(session, principal, study.owner_id, study.team_id):
        raise Forbidden(
            f"study {study_id} belongs to {study.owner.name}: only they, an admin of its team or a cluster admin "
            "may change it"
        )
    return get_study(session, study_id, lock=True)


def _no_scaling_run(run_id: int) -> NotFound:
    return NotFound(
        f"There is no scaling run {run_id} that you can see: it does not exist or is neither yours nor your team's."
    )


def scaling_run_for(session: Session, principal: Principal, run_id: int) -> ScalingRun:
    run = session.get(ScalingRun, run_id)
    if run is None or not _may_read(session, principal, run.owner_id, run.team_id):
        raise _no_scaling_run(run_id)
    return run


def scaling_run_to_change(session: Session, principal: Principal, run_id: int) -> ScalingRun:
    """The run, locked, if `principal` may act on it (404 if they may not read it, else 403)."""
    run = scaling_run_for(session, principal, run_id)
    if not _may_act(session, principal, run.owner_id, run.team_id):
        raise Forbidden(
            f"scaling run {run_id} belongs to {run.owner.name}: only they, an admin of its team or a cluster admin "
            "may cancel it"
        )
    session.refresh(run, with_for_update=True)
    return run


def may_cancel_scaling_run(session: Session, principal: Principal, run: ScalingRun) -> bool:
    return _may_act(session, principal, run.owner_id, run.team_id)


def visible_scaling_runs(principal: Principal) -> Select[ScalingRun]:
    query = select(ScalingRun).options(selectinload(ScalingRun.owner))
    if principal.is_admin:
        return query
    return query.where(or_(ScalingRun.owner_id == principal.user_id, ScalingRun.team_id.in_(_team_ids(principal))))


def may_change_study(session: Session, principal: Principal, study: TuningStudy) -> bool:
    return _may_act(session, principal, study.owner_id, study.team_id)


def visible_teams(principal: Principal) -> Select[Team]:
    query = select(Team).options(selectinload(Team.members).selectinload(TeamMember.user)).order_by(Team.name)
    return query if principal.is_admin else query.where(Team.id.in_(_team_ids(principal)))


def team_for(session: Session, principal: Principal, name: str, *, lock: bool = False) -> Team:
    """The team, if `principal` is in it or a cluster admin; locked when `lock`."""
    team = get_team(session, name, lock=lock)
    if team is None or not (principal.is_admin or _role_in(session, principal, team.id) is not None):
        raise NotFound(
            f"There is no team {name!r} that you are in (`phalanx teams list` lists yours; a cluster admin "
            "creates teams)."
        )
    return team


def team_role(session: Session, principal: Principal, team: Team) -> str | None:
    return _role_in(session, principal, team.id)


def may_manage_team(session: Session, principal: Principal, team: Team) -> None:
    """Members and roles: the team's admins and cluster admins (403 for its other members)."""
    if not (principal.is_admin or _role_in(session, principal, team.id) == "admin"):
        raise Forbidden(f"only an admin of team {team.name!r} or a cluster admin manages its members")


def may_set_team_policy(principal: Principal) -> None:
    """Weights, guarantees and limits trade one team's slots for another's: cluster admins only."""
    if not principal.is_admin:
        raise Forbidden("a team's weight, guarantees and limits are set by a cluster admin; ask one")


def may_hold_team(session: Session, principal: Principal, team: Team) -> None:
    """Holding a team's queue: its admins and cluster admins (403 for its other members)."""
    if not (principal.is_admin or _role_in(session, principal, team.id) == "admin"):
        raise Forbidden(f"only an admin of team {team.name!r} or a cluster admin holds or releases its queue")


def may_hold_job(session: Session, principal: Principal, job: Job) -> bool:
    """Whether to offer `principal` the job's hold and release buttons."""
    return principal.is_admin or _role_in(session, principal, job.team_id) == "admin"


def job_to_hold(session: Session, principal: Principal, job_id: int) -> Job:
    """The job, locked, if `principal` may hold it: an admin of its team or a cluster admin (404 if
    they may not read it, else 403; its owner pauses it instead)."""
    job = job_for(session, principal, job_id)
    if not may_hold_job(session, principal, job):
        raise Forbidden(
            f"only an admin of job {job_id}'s team or a cluster admin holds or releases it; its owner may pause it"
        )
    return lock_job(session, job_id)


def may_create_teams(principal: Principal) -> None:
    if not principal.is_admin:
        raise Forbidden("creating a team needs a cluster admin's token; ask an admin to create it")


def visible_tokens(principal: Principal) -> Select[ApiToken]:
    """A user's own tokens; an admin's view has them all."""
    query = select(ApiToken)
    return query if principal.is_admin else query.where(ApiToken.user_id == principal.user_id)


def token_for(session: Session, principal: Principal, token_id: int) -> ApiToken:
    token = session.get(ApiToken, token_id)
    if token is None or not (principal.is_admin or (token.user_id is not None and token.user_id == principal.user_id)):
        raise NotFound(f"There is no token {token_id} that you can see (`phalanx tokens list` lists yours).")
    return token


def may_report_for(session: Session, principal: Principal, allocation_id: int) -> None:
    """A rank's token reports for its own allocation only; an agent's for those it hosts a node of
    (the rank's check reads nothing: it runs on every metric batch)."""
    (refusal,) = may_report_for_each(session, [(principal, allocation_id)])
    if refusal is not None:
        raise refusal


def may_report_for_each(session: Session, requests: Sequence[tuple[Principal, int]]) -> list[Forbidden | None]:
    """`may_report_for` for many (principal, allocation id), in one query at most (none for ranks'
    tokens): for each, None or why it may not."""
    agents = {principal.agent_id for principal, _ in requests if principal.kind != "rank" and principal.agent_id}
    hosted: set[tuple[int, int]] = set()
    if agents:
        hosted = {
            (allocation_id, agent_id)
            for allocation_id, agent_id in session.execute(
                select(AllocationNode.allocation_id, AllocationNode.agent_id).where(
                    AllocationNode.allocation_id.in_(sorted({allocation_id for _, allocation_id in requests})),
                    AllocationNode.agent_id.in_(sorted(agents)),
                )
            )
        }
    refusals: list[Forbidden | None] = []
    for principal, allocation_id in requests:
        if principal.kind == "rank":
            refusals.append(
                None
                if principal.allocation_id == allocation_id
                else Forbidden(
                    f"this token belongs to allocation {principal.allocation_id}, not to allocation {allocation_id}"
                )
            )
        elif principal.agent_id is None or (allocation_id, principal.agent_id) not in hosted:
            refusals.append(
                Forbidden(f"allocation {allocation_id} has no node on this agent; an agent reports only for its own")
            )
        else:
            refusals.append(None)
    return refusals


def may_fetch_bundle(session: Session, principal: Principal, job_id: int) -> None:
    """An agent fetches the code of the jobs it hosts a node of, and of no others."""
    hosted = session.execute(
        select(AllocationNode.id)
        .join(Allocation, Allocation.id == AllocationNode.allocation_id)
        .where(Allocation.job_id == job_id, Allocation.active, AllocationNode.agent_id == principal.agent_id)
        .limit(1)
    ).first()
    if principal.agent_id is None or hosted is None:
        raise Forbidden(f"job {job_id} has no current node on this agent; an agent fetches only its own jobs' code")


def agent_acts_as(principal: Principal, agent_id: int) -> None:
    """An agent's token acts for that agent alone; the bootstrap token only registers."""
    if principal.agent_id is None:
        raise Forbidden(
            "the cluster's agent token only registers agents; use the token the registration returned "
            "(the agent keeps it in its data dir)"
        )
    if principal.agent_id != agent_id:
        raise Forbidden(f"this token belongs to agent {principal.agent_id}, not to agent {agent_id}")


def may_drain_agents(principal: Principal) -> None:
    """Draining (and undraining) changes everyone's slots: cluster admins only (403 otherwise)."""
    if not principal.is_admin:
        raise Forbidden("draining or undraining an agent needs a cluster admin's token; ask an admin")
