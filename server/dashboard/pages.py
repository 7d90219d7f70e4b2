"""Dashboard pages: sign in and out, the overview, the jobs table, a job's page (kill button,
checkpoint downloads, logs), the agents and their drain buttons, the studies and their trials.

Pages render on the server and read without JavaScript. A page without a valid session redirects
to /login (and back after it); unknown or foreign ids render a 404 page; a POST without the right
CSRF token is refused with 403 before anything changes. Users see their own jobs; admins see all.
"""

from __future__ import annotations

from typing import Annotated, Any
from urllib.parse import quote

import yaml
from fastapi import APIRouter, Form, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from sqlalchemy import func, select
from sqlalchemy.orm import Session, selectinload

from phalanx import schemas
from server import checkpoints, lifecycle, studies, views
from server.api.deps import SessionDep, authenticate
from server.auth import Principal
from server.dashboard.session import csrf_ok, csrf_token, current_user, remember_csrf, sign_in, sign_out
from server.errors import Conflict, NotFound
from server.models import (
    Agent,
    Allocation,
    AllocationNode,
    Checkpoint,
    Job,
    LogLine,
    SlotLease,
    TuningStudy,
    utcnow,
)
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
    return target if target.startswith("/") and not target.startswith("//") else "/overview"


def forbidden(request: Request) -> HTMLResponse:
    message = "The form's CSRF token is missing or wrong. Reload the page and try again."
    return render(request, "error.html", 403, title="Forbidden", message=message)


def not_found(request: Request, message: str) -> HTMLResponse:
    return render(request, "error.html", 404, title="Not found", message=message)


@router.get("/login", response_class=HTMLResponse)
def login_page(request: Request, next: str = "/overview") -> HTMLResponse:
    return render(request, "login.html", next=_safe_next(next), error=None)


@router.post("/login", response_model=None)
def login(
    request: Request,
    token: Annotated[str, Form()] = "",
    next: Annotated[str, Form()] = "/overview",
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
        saved = [
            views.checkpoint(c)
            for c in session.scalars(
                select(Checkpoint)
                .where(Checkpoint.job_id == job_id, Checkpoint.state == checkpoints.COMMITTED)
                .order_by(Checkpoint.step)
            )
        ]
    spec = job.spec.model_dump(mode="json")
    return render(
        request,
        "job.html",
        job=job,
        checkpoints=saved,
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


def _visible_job_or_none(session: Session, user: Principal, job_id: int) -> Job | None:
    return session.scalars(visible_jobs(user).where(Job.id == job_id)).one_or_none()


@router.get("/jobs/{job_id}/logs", response_model=None)
def logs_page(
    job_id: int,
    request: Request,
    session: SessionDep,
    rank: Annotated[str, Query()] = "",
    limit: Annotated[int, Query(ge=1, le=10_000)] = 2000,
) -> Response:
    """The newest `limit` lines, every rank interleaved or one rank's."""
    user = current_user(request)
    if user is None:
        return to_login(request)
    chosen = int(rank) if rank.isdigit() else None
    with session.begin():
        job = _visible_job_or_none(session, user, job_id)
        if job is None:
            return not_found(request, f"There is no job {job_id} that you can see.")
        query = select(LogLine).where(LogLine.job_id == job_id).order_by(LogLine.id.desc()).limit(limit)
        if chosen is not None:
            query = query.where(LogLine.rank == chosen)
        lines = [views.log_record(row) for row in reversed(list(session.scalars(query)))]
        ranks = sorted(
            r for r in session.scalars(select(LogLine.rank).where(LogLine.job_id == job_id).distinct()) if r is not None
        )
        name = job.name
    return render(request, "logs.html", job_id=job_id, name=name, lines=lines, ranks=ranks, rank=chosen)


@router.get("/jobs/{job_id}/checkpoints/{step}/archive", response_model=None)
def checkpoint_archive(job_id: int, step: int, request: Request, session: SessionDep) -> Response:
    """A checkpoint's files as .tar.gz, for the download links of a job's page."""
    user = current_user(request)
    if user is None:
        return to_login(request)
    with session.begin():
        row = None
        if _visible_job_or_none(session, user, job_id) is not None:
            row = session.scalars(
                select(Checkpoint).where(
                    Checkpoint.job_id == job_id, Checkpoint.step == step, Checkpoint.state == checkpoints.COMMITTED
                )
            ).first()
        if row is None:
            return not_found(request, f"Job {job_id} has no checkpoint of step {step} that you can see.")
        path = row.path
    headers = {"Content-Disposition": f'attachment; filename="job-{job_id}-step-{step}.tar.gz"'}
    return StreamingResponse(checkpoints.archive(path), media_type="application/gzip", headers=headers)


@router.get("/agents", response_model=None)
def agents_page(request: Request, session: SessionDep) -> Response:
    """Every agent's slots, which job and rank holds each, its heartbeat's age, a drain button."""
    user = current_user(request)
    if user is None:
        return to_login(request)
    with session.begin():
        agents = list(session.scalars(select(Agent).order_by(Agent.id)))
        now = session.execute(select(utcnow())).scalar_one()
        holders = slot_holders(session)
        rows = [
            {
                "agent": view,
                "heartbeat_age": (now - view.last_heartbeat).total_seconds(),
                "slots": [
                    (slot_type, index, holders.get((view.id, slot_type, index)))
                    for slot_type, count in (("cpu", view.cpu_slots), ("gpu", view.gpu_slots))
                    for index in range(count)
                ],
            }
            for view in views.agents(session, agents)
        ]
    return render(request, "agents.html", rows=rows)


def slot_holders(session: Session) -> dict[tuple[int, str, int], tuple[int, str, int]]:
    """(agent, slot type, slot index) → (job id, job name, global rank) for every held slot."""
    held = session.execute(
        select(SlotLease, AllocationNode, Job)
        .join(AllocationNode, AllocationNode.id == SlotLease.node_id)
        .join(Allocation, Allocation.id == AllocationNode.allocation_id)
        .join(Job, Job.id == Allocation.job_id)
    )
    holders = {}
    for lease, node, job in held:
        local_rank = list(node.slot_indices).index(lease.slot_index)
        holders[(lease.agent_id, lease.slot_type, lease.slot_index)] = (
            job.id,
            job.name,
            node.node_rank * job.slots_per_node + local_rank,
        )
    return holders


@router.post("/agents/{agent_id}/drain", response_model=None)
def drain_agent(
    agent_id: int, request: Request, session: SessionDep, csrf: Annotated[str, Form(alias="csrf_token")] = ""
) -> Response:
    user = current_user(request)
    if user is None:
        return to_login(request)
    if not csrf_ok(request, csrf):
        return forbidden(request)
    with session.begin():
        agent = session.get(Agent, agent_id, with_for_update=True)
        if agent is None:
            return not_found(request, f"There is no agent {agent_id}.")
        woken = lifecycle.drain_agent(session, agent) | {agent.id}
    request.app.state.publisher.publish(agent_channel(a) for a in woken)
    return RedirectResponse("/agents", status_code=303)


RECENT_FAILURES = 5


@router.get("/overview", response_model=None)
def overview_page(request: Request, session: SessionDep) -> Response:
    """The cluster at a glance: slots free, used and lost; the queue; running jobs; recent failures."""
    user = current_user(request)
    if user is None:
        return to_login(request)
    with session.begin():
        agents = views.agents(session, list(session.scalars(select(Agent).order_by(Agent.id))))
        slots = {"free": 0, "used": 0, "lost": 0}
        for agent in agents:
            total = agent.cpu_slots + agent.gpu_slots
            used = agent.used_cpu_slots + agent.used_gpu_slots
            if agent.state is schemas.AgentState.LOST:
                slots["lost"] += total
            else:
                slots["used"] += used
                slots["free"] += total - used if agent.state is schemas.AgentState.ACTIVE else 0
        counts = {state: n for state, n in session.execute(visible_count_by_state(user))}
        running = [
            views.job(session, row)
            for row in session.scalars(
                visible_jobs(user).where(Job.state == "RUNNING").order_by(Job.id.desc()).limit(20)
            )
        ]
        failures = [
            views.job(session, row, latest=False)
            for row in session.scalars(
                visible_jobs(user).where(Job.state == "FAILED").order_by(Job.ended_at.desc()).limit(RECENT_FAILURES)
            )
        ]
    return render(
        request, "overview.html", agents=agents, slots=slots, counts=counts, running=running, failures=failures
    )


def visible_count_by_state(user: Principal) -> Any:
    query = select(Job.state, func.count()).group_by(Job.state)
    return query if user.is_admin else query.where(Job.owner_id == user.user_id)


def visible_studies(user: Principal) -> Any:
    query = select(TuningStudy).options(selectinload(TuningStudy.owner))
    return query if user.is_admin else query.where(TuningStudy.owner_id == user.user_id)


@router.get("/studies", response_model=None)
def studies_page(request: Request, session: SessionDep) -> Response:
    user = current_user(request)
    if user is None:
        return to_login(request)
    with session.begin():
        rows = [
            views.study(session, row) for row in session.scalars(visible_studies(user).order_by(TuningStudy.id.desc()))
        ]
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


@router.get("/studies/{study_id}", response_model=None)
def study_page(
    study_id: int,
    request: Request,
    session: SessionDep,
    sort: Annotated[str, Query(max_length=80)] = "number",
    desc: Annotated[bool, Query()] = False,
) -> Response:
    user = current_user(request)
    if user is None:
        return to_login(request)
    with session.begin():
        row = session.scalars(visible_studies(user).where(TuningStudy.id == study_id)).one_or_none()
        if row is None:
            return not_found(request, f"There is no study {study_id} that you can see.")
        study = views.study_detail(session, row)
    params = list(study.spec.search_space)
    key = sort if sort in TRIAL_SORTS or sort.removeprefix("param:") in params else "number"
    return render(
        request,
        "study.html",
        study=study,
        trials=sort_trials(study.trials, key, desc),
        params=params,
        sort=key,
        desc=desc,
    )


@router.post("/studies/{study_id}/{action}", response_model=None)
def study_action(
    study_id: int,
    action: str,
    request: Request,
    session: SessionDep,
    csrf: Annotated[str, Form(alias="csrf_token")] = "",
) -> Response:
    """The stop and resume buttons."""
    user = current_user(request)
    if user is None:
        return to_login(request)
    if not csrf_ok(request, csrf):
        return forbidden(request)
    if action not in ("stop", "resume"):
        return not_found(request, f"There is no study action {action!r}.")
    woken: set[int] = set()
    try:
        with session.begin():
            if session.scalars(visible_studies(user).where(TuningStudy.id == study_id)).one_or_none() is None:
                raise NotFound(f"There is no study {study_id} that you can see.")
            row = studies.get_study(session, study_id, lock=True)
            if action == "stop":
                woken = studies.stop_study(session, row)
            else:
                studies.resume_study(session, row)
    except NotFound as exc:
        return not_found(request, exc.message)
    except Conflict:
        pass  # it changed meanwhile: its page says how
    request.app.state.publisher.publish(agent_channel(a) for a in woken)
    if action == "resume":
        request.app.state.kick_scheduler()
        request.app.state.drive_study(study_id)
    return RedirectResponse(f"/studies/{study_id}", status_code=303)
