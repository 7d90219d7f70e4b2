"""The studies and a study's trials (sortable, the best marked), with stop and resume, and the
charts optuna-dashboard has (computed in `study_charts`). The page refreshes itself on the study's
`changed` events. Users see their own studies; admins see all."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import RedirectResponse, Response

from phalanx import schemas
from server import access, commands, views
from server.api.deps import RowId, SessionDep, SettingsDep
from server.dashboard.render import CsrfChecked, PageNotFound, SignedIn, render
from server.dashboard.study_charts import (
    IMPORTANCE_METHOD,
    history_data,
    importance_bars,
    intermediate_data,
    parallel_coordinates,
    reported_values,
)
from server.errors import Conflict
from server.models import TuningStudy

if TYPE_CHECKING:
    import optuna

router = APIRouter(include_in_schema=False)


@router.get("/studies", response_model=None)
def studies_page(request: Request, session: SessionDep, user: SignedIn) -> Response:
    with session.begin():
        query = access.visible_studies(user).order_by(TuningStudy.id.desc())
        rows = views.studies(session, list(session.scalars(query)))
    return render(request, "studies.html", studies=rows)


TRIAL_SORTS = ("number", "value", "state")


def sort_trials(trials: list[schemas.TrialView], key: str, descending: bool) -> list[schemas.TrialView]:
    """By number, state, the first objective or a parameter; trials without one last either way."""

    def raw(t: schemas.TrialView) -> Any:
        if key == "value":
            return t.values[0] if t.values else None
        if key == "state":
            return t.state.value
        if key.startswith("param:"):
            return t.params.get(key.removeprefix("param:"))
        return t.number

    def order(t: schemas.TrialView) -> tuple[bool, int, Any]:
        value = raw(t)
        missing = value is None
        numeric = isinstance(value, int | float) and not isinstance(value, bool)
        # numbers before text, compared as such; missing ones sort last whichever the direction
        return missing != descending, 0 if numeric else 1, value if numeric else str(value)

    return sorted(trials, key=order, reverse=descending)


def load_optuna(url: str, study: schemas.StudyDetail) -> optuna.Study | None:
    from server import tuning

    try:
        return tuning.load(url, study.optuna_study_name, study.spec)
    except KeyError:  # Optuna has no such study (it is created with ours, so: deleted behind our back)
        return None


@router.get("/studies/{study_id}", response_model=None)
def study_page(
    study_id: RowId,
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    user: SignedIn,
    sort: Annotated[str, Query(max_length=80)] = "number",
    desc: Annotated[bool, Query()] = False,
    fragment: Annotated[bool, Query(description="Only the part that live updates replace")] = False,
) -> Response:
    with session.begin():
        row = access.study_for(session, user, study_id)
        may_change = access.may_change_study(session, user, row)
        study = views.study_detail(session, row)
    # Optuna reads in its own transactions, after ours; a multi-objective study has neither
    # intermediate values (Optuna prunes on one objective) nor importances
    optuna_study = None if study.spec.multi_objective else load_optuna(settings.database_url, study)
    importances, importance_note = importance_bars(study, optuna_study, settings.max_importance_trials)
    params = list(study.spec.search_space)
    key = sort if sort in TRIAL_SORTS or sort.removeprefix("param:") in params else "number"
    return render(
        request,
        "study.html",
        title=f"Study {study.id} · {study.name}",
        study=study,
        may_change=may_change,
        trials=sort_trials(study.trials, key, desc),
        params=params,
        sort=key,
        desc=desc,
        fragment=fragment,
        history=history_data(study),
        intermediate=intermediate_data(study, reported_values(optuna_study)),
        parallel=parallel_coordinates(study),
        importances=importances,
        importance_note=importance_note,
        importance_method=IMPORTANCE_METHOD,
    )


@router.post("/studies/{study_id}/{action}", response_model=None)
def study_action(
    study_id: RowId, action: str, request: Request, session: SessionDep, user: SignedIn, _: CsrfChecked
) -> Response:
    """The stop and resume buttons."""
    if action not in ("stop", "resume"):
        raise PageNotFound(f"There is no study action {action!r}.")
    try:
        if action == "stop":
            commands.stop_study(session, user, study_id)
        else:
            commands.resume_study(session, user, study_id)
    except Conflict:
        pass  # it changed meanwhile: its page says how
    return RedirectResponse(f"/studies/{study_id}", status_code=303)
