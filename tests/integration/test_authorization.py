"""Every route (REST, pages, Server-Sent Event streams) by every kind of caller, with the answer
each must get, over real HTTP (uvicorn) on PostgreSQL.

A route that is not in the table fails `test_every_route_is_in_the_table`: whoever adds one says
here who may call it. Categories: ALLOWED means the caller got past every access rule (2xx, a
redirect that is not to the sign-in page, or a 409/422 about the request itself); LOGIN is the
dashboard's redirect to its sign-in page; numbers are exact statuses.
"""

from __future__ import annotations

import gzip
import itertools
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.routing import Mount

from scheduler.service import schedule_pass
from server.app import create_app
from server.db import session_scope
from server.settings import Settings
from tests.conftest import ADMIN_TOKEN, AGENT_TOKEN
from tests.integration.test_api import bundle_bytes
from tests.integration.test_dashboard_live import LiveServer
from tests.integration.test_studies import study_body

pytestmark = pytest.mark.integration

ALLOWED, LOGIN = "allowed", "login"
NONE, OTHER, MEMBER, TEAM_ADMIN, OWNER, ADMIN = "none", "other user", "team member", "team admin", "owner", "admin"
AGENT, CLUSTER_AGENT, RANK = "agent", "cluster agent token", "job credential"
USERS = (OTHER, MEMBER, TEAM_ADMIN, OWNER, ADMIN)
MACHINES = (AGENT, CLUSTER_AGENT, RANK)
PRINCIPALS = (NONE, *USERS, *MACHINES)


def table(**by: object) -> dict[str, object]:
    return {p: by[p] for p in PRINCIPALS}


def users(value: object, **overrides: object) -> dict[str, object]:
    """REST: every user `value`, machines 403, no token 401."""
    return {NONE: 401, **dict.fromkeys(USERS, value), **dict.fromkeys(MACHINES, 403), **overrides}


READ = users(ALLOWED, **{OTHER: 404})  # the owner, their team, cluster admins
ACT = users(ALLOWED, **{OTHER: 404, MEMBER: 403})  # the owner, their team's admins, cluster admins
ANY_USER = users(ALLOWED)
ADMIN_ONLY = users(403, **{ADMIN: ALLOWED})
MANAGE_TEAM = users(ALLOWED, **{OTHER: 404, MEMBER: 403, OWNER: 403})
AGENT_SELF = {NONE: 401, **dict.fromkeys(USERS, 403), AGENT: ALLOWED, CLUSTER_AGENT: 403, RANK: 403}
REPORT = {**AGENT_SELF, RANK: ALLOWED}
REGISTER = {**AGENT_SELF, CLUSTER_AGENT: ALLOWED}
PUBLIC = dict.fromkeys(PRINCIPALS, ALLOWED)
PAGE = {NONE: LOGIN, **dict.fromkeys(USERS, ALLOWED), **dict.fromkeys(MACHINES, LOGIN)}  # cookie sessions only
PAGE_READ = {**PAGE, OTHER: 404}
PAGE_ACT = {**PAGE_READ, MEMBER: 403}
PAGE_ADMIN = {**PAGE, **dict.fromkeys(USERS, 403), ADMIN: ALLOWED}
PAGE_MANAGE_TEAM = {**PAGE_READ, MEMBER: 403, OWNER: 403}


@dataclass
class World:
    """What the table's requests name: users in team "t", an agent hosting job `job`'s allocation,
    a job `ended` (cancelled, for streams that end and for node reports), a study, an idle agent."""

    url: str
    tokens: dict[str, str]
    job: int
    ended: int
    allocation: int
    ended_allocation: int
    study: int
    agent: int
    agent_name: str
    idle_agent: int
    profile: int  # of `job`, complete: its rank 0 sent a trace
    scaling: int  # a scaling run of the owner's
    counter: Iterator[int] = field(default_factory=itertools.count)


@dataclass
class Row:
    method: str
    path: str  # the route's template, as the app declares it
    expect: dict[str, object]
    url: Callable[[World], str]
    json: Callable[[World], Any] | None = None
    form: Callable[[World], dict[str, str]] | None = None
    files: Callable[[World], dict[str, Any]] | None = None
    before: Callable[[World, httpx.Client], None] | None = None  # run (as the admin) before each call
    last: bool = False  # it changes what later rows rely on (rotates the agent's token)


def at(template: str) -> Callable[[World], str]:
    return lambda w: template.format(w=w)


def job_file(w: World) -> dict[str, Any]:
    spec = {"name": "x", "entrypoint": "python t.py", "resources": {"nodes": 1}}
    return {"spec": (None, json.dumps(spec), "application/json"), "bundle": ("b.tar.gz", bundle_bytes())}


def study_file(w: World) -> dict[str, Any]:
    return {"spec": (None, json.dumps(study_body()), "application/json")}


def scaling_files(w: World) -> dict[str, Any]:
    spec = {"name": "x", "entrypoint": "python t.py", "resources": {"nodes": 1}}
    return {
        "spec": (None, json.dumps(spec), "application/json"),
        "request": (None, json.dumps({"nodes": [1], "steps": 5}), "application/json"),
    }


def trace_bytes() -> bytes:
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "tid": 1, "ts": 0, "dur": 10}]
    return gzip.compress(json.dumps({"traceEvents": events}).encode())


def spare_profile(w: World, admin: httpx.Client) -> None:
    """A fresh profile of `job` for the delete row to name (`w.spare_profile`): one at a time
    records, so whatever still records is deleted first."""
    for profile in admin.get(f"/api/v1/jobs/{w.job}/profiles").json():
        if profile["state"] == "recording":
            assert admin.delete(f"/api/v1/jobs/{w.job}/profiles/{profile['id']}").status_code == 204
    created = admin.post(f"/api/v1/jobs/{w.job}/profiles", json={})
    assert created.status_code == 201, created.text
    w.spare_profile = created.json()["id"]  # type: ignore[attr-defined]


def readd_spare(w: World, admin: httpx.Client) -> None:
    assert admin.put("/api/v1/teams/t/members/spare", json={"role": "member"}).status_code == 200


def spare_token(w: World, admin: httpx.Client) -> None:
    """A fresh user's token for the revoke row to name (`w.spare_token_id`)."""
    created = admin.post("/api/v1/tokens", json={"kind": "user", "name": f"spare{next(w.counter)}"})
    assert created.status_code == 201
    w.spare_token_id = created.json()["id"]  # type: ignore[attr-defined]


ROWS = [
    # --- REST: jobs
    Row("POST", "/api/v1/jobs", ANY_USER, at("/api/v1/jobs"), files=job_file),
    Row("GET", "/api/v1/jobs", ANY_USER, at("/api/v1/jobs")),
    Row("GET", "/api/v1/jobs/{job_id}", READ, at("/api/v1/jobs/{w.job}")),
    Row("GET", "/api/v1/jobs/{job_id}/logs", READ, at("/api/v1/jobs/{w.job}/logs")),
    Row("GET", "/api/v1/jobs/{job_id}/metrics", READ, at("/api/v1/jobs/{w.job}/metrics")),
    Row("GET", "/api/v1/jobs/{job_id}/checkpoints", READ, at("/api/v1/jobs/{w.job}/checkpoints")),
    Row(
        "GET",
        "/api/v1/jobs/{job_id}/checkpoints/{step}/archive",
        READ,
        at("/api/v1/jobs/{w.job}/checkpoints/1/archive"),
    ),
    Row(
        "GET",
        "/api/v1/jobs/{job_id}/bundle",
        {**AGENT_SELF},
        at("/api/v1/jobs/{w.job}/bundle"),
    ),
    Row("POST", "/api/v1/jobs/{job_id}/pause", ACT, at("/api/v1/jobs/{w.ended}/pause")),
    Row("POST", "/api/v1/jobs/{job_id}/resume", ACT, at("/api/v1/jobs/{w.ended}/resume")),
    Row("POST", "/api/v1/jobs/{job_id}/kill", ACT, at("/api/v1/jobs/{w.ended}/kill")),
    # holding is an admin's: the team's or the cluster's (the owner pauses instead); 409 for an ended job
    Row("POST", "/api/v1/jobs/{job_id}/hold", MANAGE_TEAM, at("/api/v1/jobs/{w.ended}/hold")),
    Row("POST", "/api/v1/jobs/{job_id}/release", MANAGE_TEAM, at("/api/v1/jobs/{w.ended}/release")),
    Row("POST", "/api/v1/jobs/{job_id}/profiles", ACT, at("/api/v1/jobs/{w.job}/profiles"), json=lambda w: {}),
    Row("GET", "/api/v1/jobs/{job_id}/profiles", READ, at("/api/v1/jobs/{w.job}/profiles")),
    Row("GET", "/api/v1/jobs/{job_id}/profiles/{profile_id}", READ, at("/api/v1/jobs/{w.job}/profiles/{w.profile}")),
    Row(
        "GET",
        "/api/v1/jobs/{job_id}/profiles/{profile_id}/ranks/{rank}/trace",
        READ,
        at("/api/v1/jobs/{w.job}/profiles/{w.profile}/ranks/0/trace"),
    ),
    Row(
        "DELETE",
        "/api/v1/jobs/{job_id}/profiles/{profile_id}",
        ACT,
        lambda w: f"/api/v1/jobs/{w.job}/profiles/{w.spare_profile}",  # type: ignore[attr-defined]
        before=spare_profile,
    ),
    Row("POST", "/api/v1/scaling", ANY_USER, at("/api/v1/scaling"), files=scaling_files),
    Row("GET", "/api/v1/scaling", ANY_USER, at("/api/v1/scaling")),
    Row("GET", "/api/v1/scaling/{run_id}", READ, at("/api/v1/scaling/{w.scaling}")),
    Row("POST", "/api/v1/scaling/{run_id}/cancel", ACT, at("/api/v1/scaling/{w.scaling}/cancel")),
    Row("GET", "/api/v1/queue", ANY_USER, at("/api/v1/queue")),
    Row("GET", "/api/v1/usage", ANY_USER, at("/api/v1/usage")),
    # --- REST: studies
    Row("POST", "/api/v1/studies", ANY_USER, at("/api/v1/studies"), files=study_file),
    Row("GET", "/api/v1/studies", ANY_USER, at("/api/v1/studies")),
    Row("GET", "/api/v1/studies/{study_id}", READ, at("/api/v1/studies/{w.study}")),
    Row("GET", "/api/v1/studies/{study_id}/best", READ, at("/api/v1/studies/{w.study}/best")),
    Row("GET", "/api/v1/studies/{study_id}/importance", READ, at("/api/v1/studies/{w.study}/importance")),
    Row("POST", "/api/v1/studies/{study_id}/stop", ACT, at("/api/v1/studies/{w.study}/stop")),
    Row("POST", "/api/v1/studies/{study_id}/resume", ACT, at("/api/v1/studies/{w.study}/resume")),
    # --- REST: agents
    Row("GET", "/api/v1/agents", ANY_USER, at("/api/v1/agents")),
    Row("POST", "/api/v1/agents/{agent_id}/drain", ADMIN_ONLY, at("/api/v1/agents/{w.idle_agent}/drain")),
    Row("POST", "/api/v1/agents/{agent_id}/undrain", ADMIN_ONLY, at("/api/v1/agents/{w.idle_agent}/undrain")),
    Row("POST", "/api/v1/agents/{agent_id}/heartbeat", AGENT_SELF, at("/api/v1/agents/{w.agent}/heartbeat")),
    Row("GET", "/api/v1/agents/{agent_id}/work", AGENT_SELF, at("/api/v1/agents/{w.agent}/work")),
    Row(
        "POST",
        "/api/v1/agents/{agent_id}/reports",
        AGENT_SELF,
        at("/api/v1/agents/{w.agent}/reports"),
        json=lambda w: {"reports": [{"kind": "started", "allocation_id": w.ended_allocation, "node_rank": 0}]},
    ),
    Row(
        "POST",
        "/api/v1/agents/{agent_id}/logs",
        AGENT_SELF,
        at("/api/v1/agents/{w.agent}/logs"),
        json=lambda w: {
            "batches": [
                {"allocation_id": w.allocation, "lines": [{"rank": 0, "stream": "stdout", "time": 1.0, "line": "hi"}]}
            ]
        },
    ),
    Row(
        "POST",
        "/api/v1/agents/{agent_id}/allocations/{allocation_id}/rendezvous",
        AGENT_SELF,
        at("/api/v1/agents/{w.agent}/allocations/{w.ended_allocation}/rendezvous"),
        json=lambda w: {"master_port": 29500},
    ),
    Row(
        "POST",
        "/api/v1/agents/{agent_id}/allocations/{allocation_id}/environment",
        AGENT_SELF,
        at("/api/v1/agents/{w.agent}/allocations/{w.ended_allocation}/environment"),
        json=lambda w: {"lock": "six==1.16.0\n"},
    ),
    Row(
        "POST",
        "/api/v1/agents/{agent_id}/allocations/{allocation_id}/started",
        AGENT_SELF,
        at("/api/v1/agents/{w.agent}/allocations/{w.ended_allocation}/started"),
        json=lambda w: {"node_rank": 0},
    ),
    Row(
        "POST",
        "/api/v1/agents/{agent_id}/allocations/{allocation_id}/exit",
        AGENT_SELF,
        at("/api/v1/agents/{w.agent}/allocations/{w.ended_allocation}/exit"),
        json=lambda w: {"node_rank": 0, "exit_code": 0},
    ),
    Row(
        "POST",
        "/api/v1/agents/{agent_id}/allocations/{allocation_id}/logs",
        AGENT_SELF,
        at("/api/v1/agents/{w.agent}/allocations/{w.allocation}/logs"),
        json=lambda w: {"lines": [{"rank": 0, "stream": "stdout", "time": 1.0, "line": "hi"}]},
    ),
    Row(
        "POST",
        "/api/v1/agents/register",
        REGISTER,
        at("/api/v1/agents/register"),
        json=lambda w: {"name": w.agent_name, "address": "127.0.0.1", "cpu_slots": 2},
        last=True,
    ),
    # --- REST: what a job's ranks report
    Row(
        "POST",
        "/api/v1/allocations/{allocation_id}/metrics",
        REPORT,
        at("/api/v1/allocations/{w.allocation}/metrics"),
        json=lambda w: {"records": [{"rank": 0, "step": next(w.counter), "time": 1.0, "values": {"loss": 1.0}}]},
    ),
    Row(
        "PUT",
        "/api/v1/allocations/{allocation_id}/profiles/{profile_id}/ranks/{rank}",
        REPORT,
        at("/api/v1/allocations/{w.allocation}/profiles/{w.profile}/ranks/0"),
        json=lambda w: {"message": "answered already: a no-op"},
    ),
    Row(
        "POST",
        "/api/v1/allocations/{allocation_id}/checkpoints",
        REPORT,
        at("/api/v1/allocations/{w.allocation}/checkpoints"),
        json=lambda w: {"step": 1, "path": "file:///nowhere/step-1", "size_bytes": 1},
    ),
    # --- REST: teams and tokens
    Row("POST", "/api/v1/teams", ADMIN_ONLY, at("/api/v1/teams"), json=lambda w: {"name": f"n{next(w.counter)}"}),
    Row("GET", "/api/v1/teams", ANY_USER, at("/api/v1/teams")),
    Row("GET", "/api/v1/teams/{team}", READ, at("/api/v1/teams/t")),
    Row("PATCH", "/api/v1/teams/{team}", ADMIN_ONLY, at("/api/v1/teams/t"), json=lambda w: {"weight": 1}),
    Row("POST", "/api/v1/teams/{team}/hold", MANAGE_TEAM, at("/api/v1/teams/t/hold")),
    Row("POST", "/api/v1/teams/{team}/release", MANAGE_TEAM, at("/api/v1/teams/t/release")),
    Row(
        "PUT",
        "/api/v1/teams/{team}/members/{member}",
        MANAGE_TEAM,
        at("/api/v1/teams/t/members/spare"),
        json=lambda w: {"role": "member"},
    ),
    Row(
        "DELETE",
        "/api/v1/teams/{team}/members/{member}",
        MANAGE_TEAM,
        at("/api/v1/teams/t/members/spare"),
        before=readd_spare,
    ),
    Row(
        "POST",
        "/api/v1/tokens",
        ADMIN_ONLY,
        at("/api/v1/tokens"),
        json=lambda w: {"kind": "user", "name": f"u{next(w.counter)}"},
    ),
    Row("GET", "/api/v1/tokens", ANY_USER, at("/api/v1/tokens")),
    Row(
        "DELETE",
        "/api/v1/tokens/{token_id}",
        users(404, **{ADMIN: ALLOWED}),
        lambda w: f"/api/v1/tokens/{w.spare_token_id}",  # type: ignore[attr-defined]
        before=spare_token,
    ),
    # --- operations and the API's own docs
    Row("GET", "/healthz", PUBLIC, at("/healthz")),
    Row("GET", "/metrics", ANY_USER, at("/metrics")),
    Row("GET", "/", PUBLIC, at("/")),
    Row("GET", "/openapi.json", PUBLIC, at("/openapi.json")),
    Row("GET", "/docs", PUBLIC, at("/docs")),
    Row("GET", "/redoc", PUBLIC, at("/redoc")),
    # --- dashboard pages (a cookie session; bearer tokens do not sign in)
    Row("GET", "/login", PUBLIC, at("/login")),
    # an empty sign-in form: without the form's CSRF token 403, with it but no token 401
    Row(
        "POST",
        "/login",
        {**dict.fromkeys(PRINCIPALS, 403), **dict.fromkeys(USERS, 401)},
        at("/login"),
        form=lambda w: {},
    ),
    # signing out needs the form's CSRF token, and sends to the sign-in page
    Row(
        "POST",
        "/logout",
        {**dict.fromkeys(PRINCIPALS, 403), **dict.fromkeys(USERS, LOGIN)},
        at("/logout"),
        form=lambda w: {},
        last=True,
    ),
    Row("GET", "/overview", PAGE, at("/overview")),
    Row("GET", "/agents", PAGE, at("/agents")),
    Row("POST", "/agents/{agent_id}/drain", PAGE_ADMIN, at("/agents/{w.idle_agent}/drain"), form=lambda w: {}),
    Row("POST", "/agents/{agent_id}/undrain", PAGE_ADMIN, at("/agents/{w.idle_agent}/undrain"), form=lambda w: {}),
    Row("GET", "/jobs", PAGE, at("/jobs")),
    Row("GET", "/jobs/{job_id}", PAGE_READ, at("/jobs/{w.job}")),
    Row("GET", "/jobs/{job_id}/chart-data", PAGE_READ, at("/jobs/{w.job}/chart-data")),
    Row("GET", "/jobs/{job_id}/logs", PAGE_READ, at("/jobs/{w.job}/logs")),
    Row("GET", "/jobs/{job_id}/checkpoints/{step}/archive", PAGE_READ, at("/jobs/{w.job}/checkpoints/1/archive")),
    Row("POST", "/jobs/{job_id}/{action}", PAGE_ACT, at("/jobs/{w.ended}/kill"), form=lambda w: {}),
    Row("POST", "/jobs/{job_id}/profile", PAGE_ACT, at("/jobs/{w.job}/profile"), form=lambda w: {}),
    Row(
        "GET",
        "/jobs/{job_id}/profiles/{profile_id}/ranks/{rank}/trace",
        PAGE_READ,
        at("/jobs/{w.job}/profiles/{w.profile}/ranks/0/trace"),
    ),
    Row("GET", "/jobs/{job_id}/events", PAGE_READ, at("/jobs/{w.ended}/events")),
    Row("GET", "/events/jobs", PAGE, at("/events/jobs")),
    Row("GET", "/scaling", PAGE, at("/scaling")),
    Row("GET", "/scaling/{run_id}", PAGE_READ, at("/scaling/{w.scaling}")),
    Row("POST", "/scaling/{run_id}/cancel", PAGE_ACT, at("/scaling/{w.scaling}/cancel"), form=lambda w: {}),
    Row("GET", "/studies", PAGE, at("/studies")),
    Row("GET", "/studies/{study_id}", PAGE_READ, at("/studies/{w.study}")),
    Row("POST", "/studies/{study_id}/{action}", PAGE_ACT, at("/studies/{w.study}/resume"), form=lambda w: {}),
    Row("GET", "/studies/{study_id}/events", PAGE_READ, at("/studies/{w.study}/events")),
    Row("GET", "/submit", PAGE, at("/submit")),
    Row("POST", "/submit", PAGE, at("/submit"), form=lambda w: {"text": "name: x"}),
    Row("GET", "/queue", PAGE, at("/queue")),
    Row("GET", "/usage", PAGE, at("/usage")),
    Row("POST", "/teams/{team}/policy", PAGE_ADMIN, at("/teams/t/policy"), form=lambda w: {"weight": "1"}),
    Row("POST", "/teams/{team}/hold", PAGE_MANAGE_TEAM, at("/teams/t/hold"), form=lambda w: {}),
    Row("POST", "/teams/{team}/release", PAGE_MANAGE_TEAM, at("/teams/t/release"), form=lambda w: {}),
    Row("GET", "/teams", PAGE, at("/teams")),
    Row("POST", "/teams", PAGE_ADMIN, at("/teams"), form=lambda w: {"name": f"p{next(w.counter)}"}),
    Row(
        "POST",
        "/teams/{team}/members",
        PAGE_MANAGE_TEAM,
        at("/teams/t/members"),
        form=lambda w: {"member": "spare", "role": "member"},
    ),
    Row(
        "POST",
        "/teams/{team}/members/{member}/remove",
        PAGE_MANAGE_TEAM,
        at("/teams/t/members/spare/remove"),
        form=lambda w: {},
        before=readd_spare,
    ),
]


def flatten(routes: list[Any]) -> Iterator[Any]:
    """Routes as the app matches them: FastAPI keeps included routers as branches."""
    for route in routes:
        if hasattr(route, "effective_candidates"):
            yield from flatten(route.effective_candidates())
        else:
            yield route


def app_routes(settings: Settings) -> set[tuple[str, str]]:
    app = create_app(settings, enqueue=lambda *_, **__: None)
    found = set()
    for route in flatten(app.routes):
        if isinstance(route, Mount):
            continue  # static files
        found |= {(method, route.path) for method in route.methods or () if method != "HEAD"}
    return found


def test_every_route_is_in_the_table(settings: Settings) -> None:
    listed = [(row.method, row.path) for row in ROWS]
    assert len(listed) == len(set(listed)), "a route is in the table twice"
    routes = app_routes(settings)
    assert routes - set(listed) == set(), "routes nobody said who may call: add them to ROWS"
    assert set(listed) - routes == set(), "rows for routes that no longer exist"
    for row in ROWS:
        assert set(row.expect) == set(PRINCIPALS), (row.method, row.path)


def make_world(live: str, settings: Settings) -> World:
    admin = httpx.Client(base_url=live, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30)
    tokens = {ADMIN: ADMIN_TOKEN}
    for role, name in ((OTHER, "other"), (MEMBER, "member"), (TEAM_ADMIN, "lead"), (OWNER, "owner"), (None, "spare")):
        created = admin.post("/api/v1/tokens", json={"kind": "user", "name": name})
        assert created.status_code == 201, created.text
        if role:
            tokens[role] = created.json()["token"]
    assert admin.post("/api/v1/teams", json={"name": "t"}).status_code == 201
    for name, role in (("member", "member"), ("lead", "admin"), ("owner", "member"), ("spare", "member")):
        assert admin.put(f"/api/v1/teams/t/members/{name}", json={"role": role}).status_code == 200
    cluster_agent = {"Authorization": f"Bearer {AGENT_TOKEN}"}
    registered = admin.post(
        "/api/v1/agents/register", json={"name": "host", "address": "127.0.0.1", "cpu_slots": 2}, headers=cluster_agent
    ).json()
    tokens[AGENT], tokens[CLUSTER_AGENT] = registered["agent_token"], AGENT_TOKEN
    owner = {"Authorization": f"Bearer {tokens[OWNER]}"}
    job_ids = []
    for _ in range(2):
        created = admin.post("/api/v1/jobs", files=job_file(None), headers=owner)  # type: ignore[arg-type]
        assert created.status_code == 201 and created.json()["team"] == "t", created.text
        job_ids.append(created.json()["id"])
    with session_scope(settings.database_url) as session:
        schedule_pass(session)
    study = admin.post("/api/v1/studies", files=study_file(None), headers=owner)  # type: ignore[arg-type]
    assert study.status_code == 201, study.text
    agent_auth = {"Authorization": f"Bearer {tokens[AGENT]}"}
    work = admin.get(f"/api/v1/agents/{registered['id']}/work", headers=agent_auth).json()
    by_job = {a["job_id"]: a for a in work["assignments"]}
    tokens[RANK] = by_job[job_ids[0]]["credential"]
    assert admin.post(f"/api/v1/jobs/{job_ids[1]}/kill").status_code == 200  # ended: its stream ends
    idle = admin.post(
        "/api/v1/agents/register", json={"name": "idle", "address": "127.0.0.1", "cpu_slots": 0}, headers=cluster_agent
    ).json()
    checkpoint = Path(settings.checkpoint_uri.removeprefix("file://")) / f"job-{job_ids[0]}" / "step-1"
    checkpoint.mkdir(parents=True)
    (checkpoint / "model.pt").write_bytes(b"weights")
    rank = {"Authorization": f"Bearer {tokens[RANK]}"}
    commit = {"step": 1, "path": f"{settings.checkpoint_uri}/job-{job_ids[0]}/step-1", "size_bytes": 7}
    assert (
        admin.post(
            f"/api/v1/allocations/{by_job[job_ids[0]]['allocation_id']}/checkpoints", json=commit, headers=rank
        ).status_code
        == 201
    )
    profile = admin.post(f"/api/v1/jobs/{job_ids[0]}/profiles", json={"steps": 2}, headers=owner).json()["id"]
    traced = admin.put(
        f"/api/v1/allocations/{by_job[job_ids[0]]['allocation_id']}/profiles/{profile}/ranks/0",
        content=trace_bytes(),
        headers={**rank, "Content-Type": "application/gzip"},
    )
    assert traced.status_code == 204, traced.text
    scaling = admin.post("/api/v1/scaling", files=scaling_files(None), headers=owner)  # type: ignore[arg-type]
    assert scaling.status_code == 201 and scaling.json()["team"] == "t", scaling.text
    admin.close()
    return World(
        url=live,
        tokens=tokens,
        job=job_ids[0],
        ended=job_ids[1],
        allocation=by_job[job_ids[0]]["allocation_id"],
        ended_allocation=by_job[job_ids[1]]["allocation_id"],
        study=study.json()["id"],
        agent=registered["id"],
        agent_name="host",
        idle_agent=idle["id"],
        profile=profile,
        scaling=scaling.json()["id"],
    )


def client_for(world: World, principal: str) -> httpx.Client:
    """Users sign in to the dashboard too (their cookie carries the session); machines and no one
    send only what they hold."""
    http = httpx.Client(base_url=world.url, timeout=30, follow_redirects=False)
    token = world.tokens.get(principal)
    if token is None:
        return http
    http.headers["Authorization"] = f"Bearer {token}"
    if principal in USERS:
        form = {"token": token, "csrf_token": csrf(http)}
        assert http.post("/login", data=form).status_code == 303
    return http


def csrf(http: httpx.Client) -> str:
    match = re.search(r'name="csrf_token" value="([^"]+)"', http.get("/login").text)
    assert match
    return match.group(1)


def category(response: httpx.Response) -> object:
    status = response.status_code
    if status == 303 and response.headers["location"].startswith("/login"):
        return LOGIN
    if status < 400 or status in (409, 422):
        return ALLOWED
    return status


def test_every_route_answers_each_caller_as_the_table_says(settings: Settings) -> None:
    with LiveServer(settings) as live:
        world = make_world(live.url, settings)
        admin = client_for(world, ADMIN)
        clients = {p: client_for(world, p) for p in PRINCIPALS}
        wrong = []
        for row in sorted(ROWS, key=lambda r: r.last):
            for principal in sorted(PRINCIPALS, key=lambda p: row.expect[p] == ALLOWED):  # refusals first
                if row.before:
                    row.before(world, admin)
                http = clients[principal]
                kwargs: dict[str, Any] = {}
                if row.json:
                    kwargs["json"] = row.json(world)
                if row.files:
                    kwargs["files"] = row.files(world)
                if row.form is not None:
                    form = row.form(world)
                    if principal in USERS:
                        form.setdefault("csrf_token", csrf(http))
                    kwargs["data"] = form
                with http.stream(row.method, row.url(world), **kwargs) as response:
                    got = category(response)
                    detail = "" if got == row.expect[principal] else response.read()[:300].decode(errors="replace")
                    detail = " ".join(re.findall(r"<title>[^<]*|\"error\":\"[^\"]*", detail)) or detail[:80]
                if got != row.expect[principal]:
                    wrong.append(
                        f"{row.method} {row.path} as {principal}: {got}, expected {row.expect[principal]} {detail}"
                    )
        for http in clients.values():
            http.close()
        admin.close()
    assert wrong == [], "\n".join(wrong)
