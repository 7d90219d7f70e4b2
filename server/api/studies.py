"""Hyperparameter studies: create, list, show (long-poll), stop, resume, best trials, importance."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File, Form, Query, UploadFile
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from phalanx import schemas
from server import access, commands, views
from server.api.deps import (
    MAX_ROW_ID,
    HoldsDep,
    RowId,
    SessionDep,
    SessionsDep,
    SettingsDep,
    UserDep,
    WaiterDep,
    holder,
)
from server.api.uploads import parse_spec
from server.auth import Principal
from server.errors import Conflict, Unprocessable
from server.models import TuningStudy
from server.wakeups import study_channel

router = APIRouter(prefix="/studies", tags=["studies"])


@router.post("", status_code=201, response_model=schemas.Study)
def create_study(
    session: SessionDep,
    settings: SettingsDep,
    user: UserDep,
    spec: Annotated[str, Form(description="The StudySpec as JSON")],
    bundle: Annotated[UploadFile | None, File(description="The trials' workdir as .tar.gz")] = None,
) -> schemas.Study:
    """Validate the study (422 naming the field, nothing created) and start its driver."""
    study_spec = parse_spec(schemas.StudySpec, spec, "study spec")
    return commands.submit_study(session, settings, user, study_spec, bundle.file if bundle is not None else None)


@router.get("", response_model=list[schemas.Study])
def list_studies(
    session: SessionDep,
    user: UserDep,
    state: schemas.StudyState | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=MAX_ROW_ID)] = 0,
) -> list[schemas.Study]:
    query = access.visible_studies(user).order_by(TuningStudy.id.desc()).limit(limit).offset(offset)
    if state is not None:
        query = query.where(TuningStudy.state == state.value)
    with session.begin():
        return views.studies(session, list(session.scalars(query)))


def _detail(session: Session, user: Principal, study_id: int) -> schemas.StudyDetail:
    with session.begin():
        return views.study_detail(session, access.study_for(session, user, study_id))


@router.get("/{study_id}", response_model=schemas.StudyDetail)
async def show_study(
    study_id: RowId,
    sessions: SessionsDep,
    settings: SettingsDep,
    waiter: WaiterDep,
    holds: HoldsDep,
    user: UserDep,
    version: Annotated[
        str | None, Query(max_length=64, description="With `wait`: answer once the study differs from it")
    ] = None,
    wait: Annotated[float, Query(ge=0, le=300, description="Seconds to hold the request (long-poll)")] = 0.0,
) -> schemas.StudyDetail:
    """The study with every trial; with `version` and `wait`, hangs until a trial or the study
    changes (or `wait` passes), so a watcher need not poll."""

    def load() -> schemas.StudyDetail:
        with sessions() as session:
            return _detail(session, user, study_id)

    if version is None or wait <= 0:
        return await run_in_threadpool(load)
    with holds.hold(holder(user), f"the long-poll on study {study_id}"):
        return await waiter.until_changed(
            study_channel(study_id),
            load,
            lambda detail: detail.version != version,
            min(wait, settings.work_poll_seconds),
        )


@router.post("/{study_id}/stop", response_model=schemas.Study)
def stop_study(study_id: RowId, session: SessionDep, user: UserDep) -> schemas.Study:
    """No new trials; running trials checkpoint and pause until `resume`."""
    return commands.stop_study(session, user, study_id)


@router.post("/{study_id}/resume", response_model=schemas.Study)
def resume_study(study_id: RowId, session: SessionDep, user: UserDep) -> schemas.Study:
    """Resume the paused trials (from their checkpoints) and start new ones up to n_trials."""
    return commands.resume_study(session, user, study_id)


@router.get("/{study_id}/best", response_model=schemas.StudyBest)
def best_trials(study_id: RowId, session: SessionDep, settings: SettingsDep, user: UserDep) -> schemas.StudyBest:
    """The best trial as Optuna reckons it (among equal values, the first), or the Pareto front
    of a multi-objective study."""
    import optuna

    from server import tuning

    detail = _detail(session, user, study_id)
    if not any(t.state is schemas.TrialState.COMPLETE for t in detail.trials):
        raise Conflict(f"study {study_id} has no COMPLETE trial yet; `phalanx studies show {study_id}` lists them")
    study = tuning.load(settings.database_url, detail.optuna_study_name, detail.spec)
    if detail.spec.multi_objective:
        numbers = {t.number for t in study.best_trials}
        best = [t for t in detail.trials if t.number in numbers]
    else:  # Optuna's best value; among the trials that reached it, the first (as in our views)
        complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        first = min(t.number for t in complete if t.value == study.best_value)
        best = [t for t in detail.trials if t.number == first]
    return schemas.StudyBest(study_id=study_id, directions=[o.direction for o in detail.spec.objectives], trials=best)


@router.get("/{study_id}/importance", response_model=schemas.ParamImportances)
def param_importances(
    study_id: RowId,
    session: SessionDep,
    settings: SettingsDep,
    user: UserDep,
    method: Annotated[str, Query(description="ped_anova (default) or fanova")] = "ped_anova",
) -> schemas.ParamImportances:
    """Each parameter's share of the objective's variation (Optuna's importance evaluators), from
    the newest PHALANX_MAX_IMPORTANCE_TRIALS COMPLETE trials (the note says when there were more)."""
    from server import tuning

    if method not in tuning.IMPORTANCE_METHODS:
        raise Unprocessable(f"method {method!r} is not one of {', '.join(tuning.IMPORTANCE_METHODS)}")
    detail = _detail(session, user, study_id)
    if detail.spec.multi_objective:
        raise Unprocessable("parameter importance is computed for single-objective studies only")
    complete = sum(t.state is schemas.TrialState.COMPLETE for t in detail.trials)
    if complete < 2:
        return schemas.ParamImportances(
            study_id=study_id, method=method, importances={}, note=f"needs 2 COMPLETE trials; {complete} so far"
        )
    study = tuning.load(settings.database_url, detail.optuna_study_name, detail.spec)
    limit = settings.max_importance_trials
    try:
        values = tuning.importances(study, method, limit)
    except (ValueError, RuntimeError) as exc:
        return schemas.ParamImportances(study_id=study_id, method=method, importances={}, note=str(exc))
    note = f"from the newest {limit:,} of {complete:,} COMPLETE trials" if complete > limit else None
    return schemas.ParamImportances(study_id=study_id, method=method, importances=values, note=note)
