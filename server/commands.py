"""The use cases a person starts, written once for the REST API and the dashboard: submit, kill,
pause and resume a job; ask a running job for a profile, or delete one; start or cancel a scaling
run; submit, stop and resume a study; drain an agent; find a checkpoint to download; mint and
revoke API tokens; create teams, manage their members, set their shares; hold and release a job or
a team's queue. Routes and pages only parse the request, call one of these, and render the answer.

Each function owns its transaction: it asks `server.access` whether the principal may do it
(404 for what they cannot see), applies the domain rules (`server.jobs`, `server.studies`,
`server.agents`), and returns a response model built inside the transaction. Wake-ups, scheduling
passes and study drivers that must follow are noted by the rules and carried out after the commit
(`server.wakeups.publish_after_commit`); a refused command changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from sqlalchemy import select
from sqlalchemy.orm import Session

from phalanx import schemas
from server import access, agents, auth, checkpoints, jobs, profiles, scaling, studies, teams, views
from server.auth import Principal
from server.bundles import store_bundle
from server.errors import Conflict, NotFound
from server.models import ApiToken, Checkpoint, Job, TuningStudy, User
from server.settings import Settings
from server.transitions import COMMITTED


def _owner(principal: Principal) -> int:
    assert principal.user_id is not None, "only users submit (UserDep / SignedIn)"
    return principal.user_id


def _store_bundle_for(
    session: Session, settings: Settings, principal: Principal, team_name: str | None, bundle: BinaryIO | None
) -> tuple[str | None, int]:
    """Store the upload once the principal may start work in `team_name` (a refusal stores nothing);
    the transaction that creates the work checks the team again."""
    with session.begin():
        teams.team_for_new_work(session, principal, team_name)
    return store_bundle(settings, bundle) if bundle is not None else (None, 0)


def submit_job(
    session: Session, settings: Settings, principal: Principal, spec: schemas.JobSpec, bundle: BinaryIO | None
) -> schemas.JobView:
    """Store the code bundle and queue the job (422 when no agents could ever host it; nothing is
    created then)."""
    checkpoints.check_storage(spec.checkpoint.storage, settings)
    sha, size = _store_bundle_for(session, settings, principal, spec.team, bundle)
    with session.begin():
        # the team again, in the transaction that creates the job (membership may have changed)
        team = teams.team_for_new_work(session, principal, spec.team)
        spec = spec.model_copy(update={"team": team.name if team else None})
        job = jobs.create_job(session, spec, _owner(principal), sha, size, team_id=team.id if team else None)
        return views.job(session, job.id, latest=False)


def _change_job(
    session: Session, principal: Principal, job_id: int, change: Callable[[Session, Job], object]
) -> schemas.JobView:
    """`change` the job if the principal may act on it, under its row lock."""
    with session.begin():
        job = access.job_to_change(session, principal, job_id)
        change(session, job)
        return views.job(session, job.id)


def kill_job(session: Session, principal: Principal, job_id: int) -> schemas.JobView:
    """CANCELLED at once; its workers are stopped (409 for a job that already ended)."""
    return _change_job(session, principal, job_id, jobs.kill_job)


def pause_job(session: Session, principal: Principal, job_id: int) -> schemas.JobView:
    """PAUSED; its workers checkpoint and leave (409 unless it is queued or running)."""
    return _change_job(session, principal, job_id, jobs.pause_job)


def resume_job(session: Session, principal: Principal, job_id: int) -> schemas.JobView:
    """QUEUED again, to resume from its newest checkpoint (409 unless it is PAUSED)."""
    return _change_job(session, principal, job_id, jobs.resume_job)


def request_profile(
    session: Session, settings: Settings, principal: Principal, job_id: int, body: schemas.ProfileRequest
) -> schemas.ProfileView:
    """Ask the job's running attempt to record `body.steps` steps on every rank (409 unless it
    runs, or while another profile of it records); the oldest profiles beyond a job's few go."""
    with session.begin():
        job = access.job_to_change(session, principal, job_id)
        profile, dropped = profiles.request_profile(session, job, body.steps, principal.user_id)
        view = profiles.view(session, profile)
    profiles.remove_files(settings, job_id, dropped)
    return view


def delete_profile(session: Session, settings: Settings, principal: Principal, job_id: int, profile_id: int) -> None:
    """Drop the profile and its traces (a pending request is withdrawn)."""
    with session.begin():
        access.job_to_change(session, principal, job_id)
        profiles.delete_profile(session, profiles.get_profile(session, job_id, profile_id))
    profiles.remove_files(settings, job_id, [profile_id])


def start_scaling(
    session: Session,
    settings: Settings,
    principal: Principal,
    spec: schemas.JobSpec,
    request: schemas.ScalingRequest,
    bundle: BinaryIO | None,
) -> schemas.ScalingRunView:
    """Store the code bundle and start the run: its smallest size's job is queued (422 when some
    size could never fit; nothing is created then)."""
    checkpoints.check_storage(spec.checkpoint.storage, settings)
    sha, size = _store_bundle_for(session, settings, principal, spec.team, bundle)
    with session.begin():
        team = teams.team_for_new_work(session, principal, spec.team)
        spec = spec.model_copy(update={"team": team.name if team else None})
        run = scaling.create_run(session, spec, request, _owner(principal), team.id if team else None, sha, size)
        return scaling.view(session, run)


def cancel_scaling(session: Session, principal: Principal, run_id: int) -> schemas.ScalingRunView:
    """CANCELLED; the size being measured is killed (409 once the run ended)."""
    with session.begin():
        run = access.scaling_run_to_change(session, principal, run_id)
        scaling.cancel_run(session, run)
        return scaling.view(session, run)


def profile_trace_path(
    session: Session, settings: Settings, principal: Principal, job_id: int, profile_id: int, rank: int
) -> Path:
    """Where rank `rank`'s trace of the job's profile lies (for a download), or 404."""
    with session.begin():
        access.job_for(session, principal, job_id)
        return profiles.trace_path(settings, profiles.get_profile(session, job_id, profile_id), rank, session)


def committed_checkpoint_path(session: Session, principal: Principal, job_id: int, step: int) -> str:
    """Where the job's committed checkpoint of `step` lies (for a download), or 404."""
    with session.begin():
        access.job_for(session, principal, job_id)
        path = session.scalars(
            select(Checkpoint.path).where(
                Checkpoint.job_id == job_id, Checkpoint.step == step, Checkpoint.state == COMMITTED
            )
        ).first()
    if path is None:
        raise NotFound(f"job {job_id} has no checkpoint of step {step}; `phalanx checkpoints list {job_id}` lists them")
    return path


def submit_study(
    session: Session, settings: Settings, principal: Principal, spec: schemas.StudySpec, bundle: BinaryIO | None
) -> schemas.Study:
    """Store the trials' code bundle and create the study (422 when no agents could ever host a
    trial, or its grid is too large; nothing is created then); its driver starts after the commit."""
    checkpoints.check_storage(spec.trial.checkpoint.storage, settings, "trial.checkpoint.storage")
    studies.check_grid(spec, settings.max_grid_combinations)
    sha, size = _store_bundle_for(session, settings, principal, spec.team, bundle)
    with session.begin():
        team = teams.team_for_new_work(session, principal, spec.team)
        spec = spec.model_copy(update={"team": team.name if team else None})
        row = studies.create_study(session, spec, _owner(principal), sha, size, team_id=team.id if team else None)
        return views.study(session, row)


def _change_study(
    session: Session, principal: Principal, study_id: int, change: Callable[[Session, TuningStudy], object]
) -> schemas.Study:
    """`change` the study if the principal may act on it, under its row lock."""
    with session.begin():
        row = access.study_to_change(session, principal, study_id)
        change(session, row)
        return views.study(session, row)


def stop_study(session: Session, principal: Principal, study_id: int) -> schemas.Study:
    """No new trials; the running ones pause (409 unless it is RUNNING)."""
    return _change_study(session, principal, study_id, studies.stop_study)


def resume_study(session: Session, principal: Principal, study_id: int) -> schemas.Study:
    """The paused trials queue again and the driver goes on (409 unless it is STOPPED)."""
    return _change_study(session, principal, study_id, studies.resume_study)


def drain_agent(session: Session, principal: Principal, agent_id: int) -> schemas.AgentView:
    access.may_drain_agents(principal)
    with session.begin():
        agent = agents.get_agent(session, agent_id, lock=True)
        agents.drain_agent(session, agent)
        return views.agents(session, [agent])[0]


def undrain_agent(session: Session, principal: Principal, agent_id: int) -> schemas.AgentView:
    access.may_drain_agents(principal)
    with session.begin():
        agent = agents.get_agent(session, agent_id, lock=True)
        agents.undrain_agent(session, agent)
        return views.agents(session, [agent])[0]


def create_token(session: Session, body: schemas.TokenRequest) -> schemas.TokenCreated:
    """A new user token makes a new user of that name (409 if it exists); an agent token names
    agents. The value is returned once and only its hash is stored. Only admins mint (the route's
    `AdminDep`)."""
    with session.begin():
        user_id = None
        if body.kind == "user":
            if session.scalars(select(User).where(User.name == body.name)).first() is not None:
                raise Conflict(f"user {body.name!r} exists already; pick another name")
            user = User(name=body.name, is_admin=False)
            session.add(user)
            session.flush()
            user_id = user.id
        token_id, token = auth.mint(session, body.kind, body.name, user_id, expires_in_s=body.expires_in_s)
        expires_at = session.get_one(ApiToken, token_id).expires_at
    return schemas.TokenCreated(id=token_id, kind=body.kind, name=body.name, token=token, expires_at=expires_at)


def revoke_token(session: Session, principal: Principal, token_id: int) -> None:
    """Delete the token (404 for one the principal cannot see)."""
    with session.begin():
        session.delete(access.token_for(session, principal, token_id))


def create_team(session: Session, principal: Principal, body: schemas.TeamRequest) -> schemas.TeamView:
    access.may_create_teams(principal)
    with session.begin():
        team = teams.create_team(session, body.name)
        return views.team(session, principal, team)


def set_team_member(
    session: Session, principal: Principal, team_name: str, user_name: str, role: str
) -> schemas.TeamView:
    """Add `user_name` to the team with `role`, or change their role (team admins, cluster admins)."""
    with session.begin():
        team = access.team_for(session, principal, team_name, lock=True)
        access.may_manage_team(session, principal, team)
        teams.set_member(session, team, user_name, role)
        return views.team(session, principal, team)


def remove_team_member(session: Session, principal: Principal, team_name: str, user_name: str) -> schemas.TeamView:
    with session.begin():
        team = access.team_for(session, principal, team_name, lock=True)
        access.may_manage_team(session, principal, team)
        teams.remove_member(session, team, user_name)
        return views.team(session, principal, team)


def set_team_policy(
    session: Session, principal: Principal, team_name: str, change: schemas.TeamPolicyRequest
) -> schemas.TeamView:
    """Weight, guarantees and limits (cluster admins); the next pass orders the queue by them."""
    access.may_set_team_policy(principal)
    with session.begin():
        team = access.team_for(session, principal, team_name, lock=True)
        teams.set_policy(session, team, change)
        return views.team(session, principal, team)


def hold_team(session: Session, principal: Principal, team_name: str, held: bool) -> schemas.TeamView:
    with session.begin():
        team = access.team_for(session, principal, team_name, lock=True)
        access.may_hold_team(session, principal, team)
        teams.set_queue_held(session, team, held)
        return views.team(session, principal, team)


def hold_job(session: Session, principal: Principal, job_id: int, held: bool) -> schemas.JobView:
    with session.begin():
        job = access.job_to_hold(session, principal, job_id)
        jobs.set_held(session, job, held)
        return views.job(session, job.id)
