"""Scaling runs: the list and a run's page (each size's throughput and efficiency as a table and
bars against linear scaling, the job of each size, a Cancel button while it runs)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response
from sqlalchemy.orm import Session

from server import access, commands, scaling
from server.api.deps import RowId, SessionDep
from server.auth import Principal
from server.dashboard.render import CsrfChecked, SignedIn, render
from server.errors import Conflict
from server.models import ScalingRun

router = APIRouter()
PAGE_SIZE = 100


@router.get("/scaling", response_model=None)
def scaling_list(request: Request, session: SessionDep, user: SignedIn) -> Response:
    with session.begin():
        query = access.visible_scaling_runs(user).order_by(ScalingRun.id.desc()).limit(PAGE_SIZE)
        runs = [scaling.view(session, run) for run in session.scalars(query)]
    return render(request, "scaling.html", runs=runs, run=None)


@router.get("/scaling/{run_id}", response_model=None)
def scaling_page(run_id: RowId, request: Request, session: SessionDep, user: SignedIn) -> Response:
    return _scaling_page(run_id, request, session, user)


def _scaling_page(
    run_id: int, request: Request, session: Session, user: Principal, error: str | None = None, status: int = 200
) -> Response:
    with session.begin():
        row = access.scaling_run_for(session, user, run_id)
        run = scaling.view(session, row)
        may_cancel = access.may_cancel_scaling_run(session, user, row)
    return render(request, "scaling.html", status, runs=None, run=run, may_cancel=may_cancel, error=error)


@router.post("/scaling/{run_id}/cancel", response_model=None)
def cancel_scaling(run_id: RowId, request: Request, session: SessionDep, user: SignedIn, _: CsrfChecked) -> Response:
    try:
        commands.cancel_scaling(session, user, run_id)
    except Conflict as exc:
        return _scaling_page(run_id, request, session, user, error=exc.message, status=409)
    return RedirectResponse(f"/scaling/{run_id}", status_code=303)
