"""Who may see and change what: the one place every REST route and dashboard page asks.

Rules today: a user sees and acts on the jobs and studies they own; an admin on all of them.
Someone else's object answers 404, as an unknown one does, so ids reveal nothing. Every user may
list agents; only a cluster admin drains one (403 for others). Tokens: a user lists and
revokes their own, an admin all; only an admin mints them. A job's ranks hold their allocation's
own token: it reports metrics and checkpoints for that allocation and reaches nothing else. Agents reach only the
agent protocol (`server/api/deps.py`'s `AgentDep`).

Each `*_for` reads the row (locked when `lock`) or raises `NotFound`; each `visible_*` is the
query of what a principal may list, for callers that add their own filters and paging.
"""

from __future__ import annotations

from sqlalchemy import Select, select
from sqlalchemy.orm import Session, selectinload

from server.attempts import lock_job
from server.auth import Principal
from server.errors import Forbidden, NotFound
from server.models import ApiToken, Job, TuningStudy
from server.studies import get_study


def visible_jobs(principal: Principal) -> Select[Job]:
    query = select(Job).options(selectinload(Job.owner))
    return query if principal.is_admin else query.where(Job.owner_id == principal.user_id)


def visible_studies(principal: Principal) -> Select[TuningStudy]:
    query = select(TuningStudy).options(selectinload(TuningStudy.owner))
    return query if principal.is_admin else query.where(TuningStudy.owner_id == principal.user_id)


def _no_job(job_id: int) -> NotFound:
    return NotFound(
        f"There is no job {job_id} that you can see: it does not exist or is not yours "
        "(`phalanx jobs list` lists yours)."
    )


def job_for(session: Session, principal: Principal, job_id: int, *, lock: bool = False) -> Job:
    """The job, if `principal` may see it; locked (re-read) when `lock`."""
    job = session.get(Job, job_id)
    if job is None or not (principal.is_admin or job.owner_id == principal.user_id):
        raise _no_job(job_id)
    return lock_job(session, job_id) if lock else job


def study_for(session: Session, principal: Principal, study_id: int, *, lock: bool = False) -> TuningStudy:
    """The study, if `principal` may see it; locked (re-read) when `lock`."""
    study = session.get(TuningStudy, study_id)
    if study is None or not (principal.is_admin or study.owner_id == principal.user_id):
        raise NotFound(
            f"There is no study {study_id} that you can see: it does not exist or is not yours "
            "(`phalanx studies list` lists yours)."
        )
    return get_study(session, study_id, lock=True) if lock else study


def visible_tokens(principal: Principal) -> Select[ApiToken]:
    """A user's own tokens; an admin's view has them all."""
    query = select(ApiToken)
    return query if principal.is_admin else query.where(ApiToken.user_id == principal.user_id)


def token_for(session: Session, principal: Principal, token_id: int) -> ApiToken:
    token = session.get(ApiToken, token_id)
    if token is None or not (principal.is_admin or (token.user_id is not None and token.user_id == principal.user_id)):
        raise NotFound(f"There is no token {token_id} that you can see (`phalanx tokens list` lists yours).")
    return token


def may_report_for(principal: Principal, allocation_id: int) -> None:
    """A rank's token reports for its own allocation only; an agent's for any it hosts."""
    if principal.kind == "rank" and principal.allocation_id != allocation_id:
        raise Forbidden(
            f"this token belongs to allocation {principal.allocation_id}, not to allocation {allocation_id}"
        )


def may_drain_agents(principal: Principal) -> None:
    """Draining takes slots from everyone's jobs: cluster admins only (403 otherwise)."""
    if not principal.is_admin:
        raise Forbidden("draining an agent needs a cluster admin's token; ask an admin to drain it")
