"""Dashboard pages: sign in and out, the jobs table, a job's page and its kill button.

Pages render on the server and read without JavaScript. A page without a valid session redirects
to /login (and back after it); unknown or foreign ids render a 404 page; a POST without the right
CSRF token is refused with 403 before anything changes. Users see their own jobs; admins see all.
"""

from __future__ import annotations

from typing import Annotated, Any
from urllib.parse import quote

import yaml
from fastapi import APIRouter, Form, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from sqlalchemy import select
from sqlalchemy.orm import selectinload

from phalanx import schemas
from server import lifecycle, views
from server.api.deps import SessionDep, authenticate
from server.auth import Principal
from server.dashboard.session import csrf_ok, csrf_token, current_user, remember_csrf, sign_in, sign_out
from server.errors import Conflict, NotFound
from server.models import Allocation, AllocationNode, Job
from server.wakeups import agent_channel

router = APIRouter(include_in_schema=False)
PAGE_SIZE = 50


def render(request: Request, template: str, status: int = 200, **context: Any) -> HTMLResponse:
    context = {"user": current_user(request), "csrf_token": csrf_token(request), **context}
    response: HTMLResponse = request.app.state.templates.TemplateResponse(
        request, template, context, status_code=status
    )
    return remember_csrf(request, response)


def to_login(request: Request) -> RedirectResponse:
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return RedirectResponse(f"/login?next={quote(target)}", status_code=303)


def _safe_next(target: str) -> str:
    """Only a path on this site (never //host or a scheme): no open redirect after signing in."""
    return target if target.startswith("/") and not target.startswith("//") else "/jobs"


def forbidden(request: Request) -> HTMLResponse:
    message = "The form's CSRF token is missing or wrong. Reload the page and try again."
    return render(request, "error.html", 403, title="Forbidden", message=message)


def not_found(request: Request, message: str) -> HTMLResponse:
    return render(request, "error.html", 404, title="Not found", message=message)


@router.get("/login", response_class=HTMLResponse)
def login_page(request: Request, next: str = "/jobs") -> HTMLResponse:
    return render(request, "login.html", next=_safe_next(next), error=None)


@router.post("/login", response_model=None)
def login(
    request: Request,
    token: Annotated[str, Form()] = "",
    next: Annotated[str, Form()] = "/jobs",
    csrf: Annotated[str, Form(alias="csrf_token")] = "",
) -> Response:
    if not csrf_ok(request, csrf):
        return forbidden(request)
    principal = authenticate(request, token.strip()) if token.strip() else None
    if principal is None or principal.kind != "user":
        error = "That token is not a valid user token. Use the admin token `phalanx up` printed, or ask an admin."
        return render(request, "login.html", 401, next=_safe_next(next), error=error)
    return sign_in(request, RedirectResponse(_safe_next(next), status_code=303), token.strip())


@router.post("/logout", response_model=None)
def logout(request: Request, csrf: Annotated[str, Form(alias="csrf_token")] = "") -> Response:
    if not csrf_ok(request, csrf):
        return forbidden(request)
    return sign_out(RedirectResponse("/login", status_code=303))


def visible_jobs(user: Principal) -> Any:
    query = select(Job).options(selectinload(Job.owner))
    return query if user.is_admin else query.where(Job.owner_id == user.user_id)


@router.get("/jobs", response_model=None)
def jobs_page(
    request: Request,
    session: SessionDep,
    state: Annotated[str, Query()] = "",
    q: Annotated[str, Query(max_length=64)] = "",
    page: Annotated[int, Query(ge=1)] = 1,
) -> Response:
    user = current_user(request)
    if user is None:
        return to_login(request)
    chosen = state if state in schemas.JobState.__members__ else ""
    query = visible_jobs(user).order_by(Job.id.desc()).limit(PAGE_SIZE + 1).offset((page - 1) * PAGE_SIZE)
    if chosen:
        query = query.where(Job.state == chosen)
    if q:
        query = query.where(Job.name.contains(q, autoescape=True))
    with session.begin():
        rows = [views.job(session, row) for row in session.scalars(query)]
    return render(
        request,
        "jobs.html",
        jobs=rows[:PAGE_SIZE],
        states=list(schemas.JobState),
        state=chosen,
        q=q,
        page=page,
        more=len(rows) > PAGE_SIZE,
    )


@router.get("/jobs/{job_id}", response_model=None)
def job_page(job_id: int, request: Request, session: SessionDep) -> Response:
    user = current_user(request)
    if user is None:
        return to_login(request)
    with session.begin():
        row = session.scalars(
            visible_jobs(user)
            .where(Job.id == job_id)
            .options(
                selectinload(Job.events),
                selectinload(Job.allocations).selectinload(Allocation.nodes).selectinload(AllocationNode.agent),
            )
        ).one_or_none()
        if row is None:
            return not_found(request, f"There is no job {job_id} that you can see.")
        job = views.job_detail(session, row)
    spec = job.spec.model_dump(mode="json")
    return render(
        request,
        "job.html",
        job=job,
        hyperparameters=yaml.safe_dump(spec["hyperparameters"], sort_keys=False) if spec["hyperparameters"] else "",
        job_file=yaml.safe_dump(spec, sort_keys=False),
    )


@router.post("/jobs/{job_id}/kill", response_model=None)
def kill_job(
    job_id: int, request: Request, session: SessionDep, csrf: Annotated[str, Form(alias="csrf_token")] = ""
) -> Response:
    user = current_user(request)
    if user is None:
        return to_login(request)
    if not csrf_ok(request, csrf):
        return forbidden(request)
    try:
        with session.begin():
            if session.scalars(visible_jobs(user).where(Job.id == job_id)).one_or_none() is None:
                raise NotFound(f"There is no job {job_id} that you can see.")
            woken = lifecycle.kill_job(session, lifecycle.get_job(session, job_id, lock=True))
    except NotFound as exc:
        return not_found(request, exc.message)
    except Conflict:
        woken = set()  # it ended meanwhile: its page says how
    request.app.state.publisher.publish(agent_channel(a) for a in woken)
    return RedirectResponse(f"/jobs/{job_id}", status_code=303)
