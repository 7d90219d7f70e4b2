"""The use cases a person starts, written once for the REST API and the dashboard: submit, kill,
pause and resume a job; submit, stop and resume a study; drain an agent; find a checkpoint to
download. Routes and pages only parse the request, call one of these, and render the answer.

Each function owns its transaction: it asks `server.access` whether the principal may do it
(404 for what they cannot see), applies the domain rules (`server.jobs`, `server.studies`,
`server.agents`), and returns a response model built inside the transaction. Wake-ups, scheduling
passes and study drivers that must follow are noted by the rules and carried out after the commit
(`server.wakeups.publish_after_commit`); a refused command changes nothing.
"""

from __future__ import annotations

from typing import BinaryIO

from sqlalchemy import select
from sqlalchemy.orm import Session

from phalanx import schemas
from server import access, agents, jobs, studies, views
from server.auth import Principal
from server.bundles import store_bundle
from server.errors import NotFound
from server.models import Checkpoint
from server.settings import Settings
from server.transitions import COMMITTED


def _owner(principal: Principal) -> int:
    assert principal.user_id is not None, "only users submit (UserDep / SignedIn)"
    return principal.user_id


def submit_job(
    session: Session, settings: Settings, principal: Principal, spec: schemas.JobSpec, bundle: BinaryIO | None
) -> schemas.JobView:
    """Store the code bundle and queue the job (422 when no agents could ever host it; nothing is
    created then)."""
    sha, size = store_bundle(settings, bundle) if bundle is not None else (None, 0)
    with session.begin():
        job = jobs.create_job(session, spec, _owner(principal), sha, size)
        return views.job(session, job, latest=False)


def kill_job(session: Session, principal: Principal, job_id: int) -> schemas.JobView:
    with session.begin():
        job = access.job_for(session, principal, job_id, lock=True)
        jobs.kill_job(session, job)
        return views.job(session, job)


def pause_job(session: Session, principal: Principal, job_id: int) -> schemas.JobView:
    with session.begin():
        job = access.job_for(session, principal, job_id, lock=True)
        jobs.pause_job(session, job)
        return views.job(session, job)


def resume_job(session: Session, principal: Principal, job_id: int) -> schemas.JobView:
    with session.begin():
        job = access.job_for(session, principal, job_id, lock=True)
        jobs.resume_job(session, job)
        return views.job(session, job)


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
    trial; nothing is created then); its driver starts after the commit."""
    sha, size = store_bundle(settings, bundle) if bundle is not None else (None, 0)
    with session.begin():
        row = studies.create_study(session, spec, _owner(principal), sha, size)
        return views.study(session, row)


def stop_study(session: Session, principal: Principal, study_id: int) -> schemas.Study:
    with session.begin():
        row = access.study_for(session, principal, study_id, lock=True)
        studies.stop_study(session, row)
        return views.study(session, row)


def resume_study(session: Session, principal: Principal, study_id: int) -> schemas.Study:
    with session.begin():
        row = access.study_for(session, principal, study_id, lock=True)
        studies.resume_study(session, row)
        return views.study(session, row)


def drain_agent(session: Session, principal: Principal, agent_id: int) -> schemas.AgentView:
    access.may_drain_agents(principal)
    with session.begin():
        agent = agents.get_agent(session, agent_id, lock=True)
        agents.drain_agent(session, agent)
        return views.agents(session, [agent])[0]
