"""Hyperparameter studies on Phalanx's side: create, stop, resume, end, and each trial's job.

Every function takes the caller's session, flushes, never commits, never calls Optuna (the driver,
`scheduler/study_driver.py`, does that outside Phalanx's transactions), and returns the agents to
wake after the commit. State changes go through `server.transitions`. Lock order: the study row,
then its trials' job rows, never the other way (a trial job's own transitions lock only the job).
"""

from __future__ import annotations

import uuid

from sqlalchemy import select
from sqlalchemy.orm import Session

from phalanx.schemas import TERMINAL_JOB_STATES, JobSpec, JobState, StudySpec, StudyState, TrialState
from phalanx.schemas.specs import DDP_PARAM_PREFIX
from server import jobs
from server.errors import Conflict, NotFound, Unprocessable
from server.models import Job, TuningStudy, TuningTrial
from server.task_names import ADVANCE_STUDY_TASK
from server.transitions import transition_study
from server.wakeups import note_study_change, note_task

ACTIVE_JOB_STATES = tuple(s.value for s in JobState if s not in TERMINAL_JOB_STATES)


def optuna_study_name(study_id: int, name: str) -> str:
    """The study's name in Optuna's tables (and so in optuna-dashboard)."""
    return f"phalanx-{study_id}-{name}"


def check_grid(spec: StudySpec, maximum: int) -> None:
    """422 when a grid study walks more combinations than this server allows (counted, never
    enumerated; the schema's own ceiling is higher, for the servers that raise it)."""
    if spec.sampler.type != "grid":
        return
    size = spec.grid_size()
    if size > maximum:
        raise Unprocessable(
            f"invalid study spec: sampler: grid: the search space has {size:,} combinations, above this "
            f"server's limit of {maximum:,} (PHALANX_MAX_GRID_COMBINATIONS); give fewer values or another sampler",
            [{"field": "sampler", "problem": f"{size:,} grid combinations, above the limit of {maximum:,}"}],
        )


def trial_job_spec(spec: StudySpec, number: int, params: dict[str, object]) -> JobSpec:
    """The job of trial `number`: the template, named after the study, the sampled parameters
    merged over the template's hyperparameters (those named `ddp.<option>` over its ddp options)."""
    template = spec.trial.model_dump(mode="json", exclude={"name"})
    ddp = {n[len(DDP_PARAM_PREFIX) :]: v for n, v in params.items() if n.startswith(DDP_PARAM_PREFIX)}
    hyperparameters = {n: v for n, v in params.items() if not n.startswith(DDP_PARAM_PREFIX)}
    template["hyperparameters"] = {**spec.trial.hyperparameters, **hyperparameters}
    template["ddp"] = {**template["ddp"], **ddp}
    return JobSpec.model_validate({**template, "name": f"{spec.name}-t{number}", "team": spec.team})


def create_study(
    session: Session,
    spec: StudySpec,
    owner_id: int,
    bundle_sha256: str | None,
    bundle_size: int,
    *,
    team_id: int | None = None,
) -> TuningStudy:
    """A RUNNING study; its driver creates the Optuna study and the first trials. Raises
    `Unprocessable` when no registered agents could ever host a trial."""
    jobs.check_fits(session, trial_job_spec(spec, 0, {}), f"the trials of study {spec.name!r}")
    study = TuningStudy(
        name=spec.name,
        owner_id=owner_id,
        team_id=team_id,
        optuna_name=f"pending-{uuid.uuid4().hex}",  # unique until the id is known
        state=StudyState.RUNNING.value,
        spec=spec.model_dump(mode="json"),
        bundle_sha256=bundle_sha256,
        bundle_size=bundle_size,
        running_seconds=0.0,
    )
    session.add(study)
    session.flush()
    study.optuna_name = optuna_study_name(study.id, spec.name)
    study.running_since = study.created_at
    session.flush()
    note_task(session, ADVANCE_STUDY_TASK, study.id)  # its driver asks for the first trials
    return study


def get_study(session: Session, study_id: int, *, lock: bool = False) -> TuningStudy:
    query = select(TuningStudy).where(TuningStudy.id == study_id)
    if lock:
        query = query.with_for_update().execution_options(populate_existing=True)
    study = session.scalars(query).one_or_none()
    if study is None:
        raise NotFound(f"study {study_id} does not exist; `phalanx studies list` shows the studies you can see")
    return study


def create_trial(
    session: Session, study: TuningStudy, number: int, optuna_trial_id: int, params: dict[str, object]
) -> TuningTrial:
    """Record an Optuna trial and queue its job."""
    spec = StudySpec.model_validate(study.spec)
    job = jobs.create_job(
        session,
        trial_job_spec(spec, number, params),
        study.owner_id,
        study.bundle_sha256,
        study.bundle_size,
        team_id=study.team_id,
        refuse_misfit=False,
    )
    job.env_lock = study.env_lock  # every trial installs the packages the first one resolved
    trial = TuningTrial(
        study_id=study.id,
        number=number,
        optuna_trial_id=optuna_trial_id,
        job_id=job.id,
        params=dict(params),
        state=TrialState.RUNNING.value,
    )
    session.add(trial)
    session.flush()
    note_study_change(session, study.id)
    return trial


def active_trial_jobs(session: Session, study_id: int) -> list[Job]:
    """The study's trial jobs that have not ended, locked, oldest first."""
    return list(
        session.scalars(
            select(Job)
            .join(TuningTrial, TuningTrial.job_id == Job.id)
            .where(TuningTrial.study_id == study_id, Job.state.in_(ACTIVE_JOB_STATES))
            .order_by(Job.id)
            .with_for_update(of=Job)
        )
    )


def stop_study(session: Session, study: TuningStudy) -> None:
    """No new trials; the running ones are paused (they checkpoint and leave) until `resume`."""
    if study.state != StudyState.RUNNING.value:
        raise Conflict(f"study {study.id} is {study.state}; only a RUNNING study can be stopped")
    transition_study(session, study, StudyState.STOPPED, "stopped by user")
    for job in active_trial_jobs(session, study.id):
        if job.state != JobState.PAUSED.value:
            jobs.pause_job(session, job)


def resume_study(session: Session, study: TuningStudy) -> None:
    """Queue the paused trials again (each from its newest checkpoint) and let the driver go on."""
    if study.state != StudyState.STOPPED.value:
        raise Conflict(f"study {study.id} is {study.state}, not STOPPED; there is nothing to resume")
    transition_study(session, study, StudyState.RUNNING, "resumed by user")
    for job in active_trial_jobs(session, study.id):
        if job.state == JobState.PAUSED.value:
            jobs.resume_job(session, job)
    note_task(session, ADVANCE_STUDY_TASK, study.id)  # the driver goes on where it stopped


def cancel_trials(session: Session, study: TuningStudy, reason: str) -> None:
    """Cancel the study's trial jobs still in flight (the study is ending: `reason`)."""
    for job in active_trial_jobs(session, study.id):
        jobs.kill_job(session, job, f"cancelled: study {study.id} is ending ({reason})")
