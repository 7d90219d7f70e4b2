"""Dashboard pages on a real PostgreSQL: sign-in, CSRF, who sees what, escaping, the kill button.
(Rendering and live updates in a real browser come with the browser tests.)"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from fastapi.testclient import TestClient

from server.dashboard import job_pages
from server.settings import Settings
from tests.agent_tokens import as_agent
from tests.conftest import ADMIN_TOKEN, AGENT_TOKEN

pytestmark = pytest.mark.integration
USER = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def submit(client: TestClient, headers: dict[str, str] = USER, **spec: Any) -> int:
    body = {"name": "j", "entrypoint": "python t.py", **spec}
    response = client.post("/api/v1/jobs", files={"spec": (None, json.dumps(body))}, headers=headers)
    assert response.status_code == 201, response.text
    return int(response.json()["id"])


def csrf(client: TestClient, page: str = "/login") -> str:
    html = client.get(page).text
    match = re.search(r'name="csrf_token" value="([^"]+)"', html)
    assert match, html
    return match.group(1)


def sign_in(client: TestClient, token: str = ADMIN_TOKEN) -> None:
    response = client.post("/login", data={"token": token, "csrf_token": csrf(client)})
    assert response.status_code == 303 and response.headers["location"] == "/overview"


def test_a_page_without_a_session_redirects_to_sign_in_and_back(client: TestClient) -> None:
    response = client.get("/jobs/7?x=1")
    assert response.status_code == 303 and response.headers["location"] == "/login?next=/jobs/7%3Fx%3D1"
    login = client.get("/login?next=/jobs/7")
    assert 'name="next" value="/jobs/7"' in login.text
    cookie = login.headers["set-cookie"].lower()
    assert "phalanx_csrf=" in cookie and "httponly" in cookie and "samesite=strict" in cookie
    signed = client.post("/login", data={"token": ADMIN_TOKEN, "next": "/jobs/7", "csrf_token": csrf(client)})
    assert signed.status_code == 303 and signed.headers["location"] == "/jobs/7"
    session_cookie = signed.headers["set-cookie"].lower()
    assert "phalanx_session=" in session_cookie and "httponly" in session_cookie and "samesite=strict" in session_cookie


def test_sign_in_refuses_bad_tokens_forged_forms_and_open_redirects(client: TestClient) -> None:
    token = csrf(client)
    wrong = client.post("/login", data={"token": "phx_u_nope", "csrf_token": token})
    assert wrong.status_code == 401 and "not a valid user token" in wrong.text
    agent = client.post("/login", data={"token": AGENT_TOKEN, "csrf_token": token})
    assert agent.status_code == 401
    forged = client.post("/login", data={"token": ADMIN_TOKEN, "csrf_token": "guess"})
    assert forged.status_code == 403 and "CSRF" in forged.text
    missing = client.post("/login", data={"token": ADMIN_TOKEN})
    assert missing.status_code == 403
    away = client.post("/login", data={"token": ADMIN_TOKEN, "next": "//evil.example/x", "csrf_token": token})
    assert away.status_code == 303 and away.headers["location"] == "/overview"
    assert client.get("/jobs").status_code == 200  # that last sign-in worked


def test_the_jobs_table_filters_searches_and_pages(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    first = submit(client, name="alpha")
    second = submit(client, name="beta")
    client.post(f"/api/v1/jobs/{first}/kill", headers=USER)
    sign_in(client)
    table = client.get("/jobs").text
    assert f'data-job="{first}"' in table and f'data-job="{second}"' in table and "CANCELLED" in table
    only_cancelled = client.get("/jobs?state=CANCELLED").text
    assert f'data-job="{first}"' in only_cancelled and f'data-job="{second}"' not in only_cancelled
    searched = client.get("/jobs?q=bet").text
    assert f'data-job="{second}"' in searched and f'data-job="{first}"' not in searched
    assert "No jobs match" in client.get("/jobs?q=zzz").text
    monkeypatch.setattr(job_pages, "PAGE_SIZE", 1)
    third = submit(client, name="gamma")
    page1 = client.get("/jobs").text
    assert f'data-job="{third}"' in page1 and f"before={third}" in page1 and "← newer" not in page1
    page2 = client.get(f"/jobs?before={third}").text
    assert f'data-job="{second}"' in page2 and f"after={second}" in page2 and f"before={second}" in page2
    page3 = client.get(f"/jobs?before={second}").text
    assert f'data-job="{first}"' in page3 and "← newer" in page3 and "older →" not in page3
    back = client.get(f"/jobs?after={first}").text  # "← newer" from the oldest page
    assert f'data-job="{second}"' in back and f"after={second}" in back and f"before={second}" in back
    newest = client.get(f"/jobs?after={second}").text  # less than a page newer: the newest page
    assert f'data-job="{third}"' in newest and "← newer" not in newest


def test_user_text_is_escaped_everywhere(client: TestClient) -> None:
    job_id = submit(client, hyperparameters={"note": "<script>alert('x')</script>"})
    sign_in(client)
    page = client.get(f"/jobs/{job_id}").text
    assert "<script>alert" not in page
    assert "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;" in page  # shown as text


def test_users_see_their_own_jobs_and_admins_every_job(client: TestClient) -> None:
    alice = client.post("/api/v1/tokens", json={"kind": "user", "name": "alice"}, headers=USER).json()["token"]
    admins = submit(client, name="admins-job")
    alices = submit(client, headers={"Authorization": f"Bearer {alice}"}, name="alices-job")
    sign_in(client, alice)
    table = client.get("/jobs").text
    assert f'data-job="{alices}"' in table and f'data-job="{admins}"' not in table
    hidden = client.get(f"/jobs/{admins}")
    assert hidden.status_code == 404 and "no job" in hidden.text
    assert client.post(f"/jobs/{admins}/kill", data={"csrf_token": csrf(client, "/jobs")}).status_code == 404
    sign_in(client)
    assert f'data-job="{alices}"' in client.get("/jobs").text


def test_unknown_jobs_get_a_404_page(client: TestClient) -> None:
    sign_in(client)
    response = client.get("/jobs/4242")
    assert response.status_code == 404 and "text/html" in response.headers["content-type"]
    assert "There is no job 4242" in response.text


def test_the_kill_button_needs_its_csrf_token(client: TestClient) -> None:
    job_id = submit(client)
    sign_in(client)
    page = client.get(f"/jobs/{job_id}").text
    assert f'action="/jobs/{job_id}/kill"' in page and "data-confirm=" in page
    assert client.post(f"/jobs/{job_id}/kill", data={"csrf_token": "forged"}).status_code == 403
    assert client.post(f"/jobs/{job_id}/kill").status_code == 403
    assert client.get(f"/api/v1/jobs/{job_id}", headers=USER).json()["state"] == "QUEUED"
    killed = client.post(f"/jobs/{job_id}/kill", data={"csrf_token": csrf(client, f"/jobs/{job_id}")})
    assert killed.status_code == 303 and killed.headers["location"] == f"/jobs/{job_id}"
    assert client.get(f"/api/v1/jobs/{job_id}", headers=USER).json()["state"] == "CANCELLED"
    assert 'action="/jobs/{job_id}/kill"' not in client.get(f"/jobs/{job_id}").text  # no kill for an ended job


def test_sign_out(client: TestClient) -> None:
    sign_in(client)
    assert client.post("/logout", data={"csrf_token": "forged"}).status_code == 403
    out = client.post("/logout", data={"csrf_token": csrf(client, "/jobs")})
    assert out.status_code == 303 and out.headers["location"] == "/login"
    assert client.get("/jobs").status_code == 303


def schedule(settings: Settings) -> None:
    from scheduler.service import schedule_pass
    from server.db import session_scope

    with session_scope(settings.database_url) as session:
        schedule_pass(session)


def test_the_agents_page_shows_who_holds_each_slot_and_drains(client: TestClient, settings: Settings) -> None:
    job_id = submit(client, name="holder", resources={"nodes": 1, "slots_per_node": 2})
    schedule(settings)
    sign_in(client)
    page = client.get("/agents").text
    assert "a0" in page and all(f"job {job_id} (holder)</a>, rank {r}" in page for r in (0, 1))
    assert "s ago" in page and 'action="/agents/1/drain"' in page
    assert client.post("/agents/1/drain", data={"csrf_token": "forged"}).status_code == 403
    assert client.get("/api/v1/agents", headers=USER).json()[0]["state"] == "ACTIVE"
    drained = client.post("/agents/1/drain", data={"csrf_token": csrf(client, "/agents")})
    assert drained.status_code == 303 and drained.headers["location"] == "/agents"
    assert client.get("/api/v1/agents", headers=USER).json()[0]["state"] == "DRAINING"
    assert "DRAINING" in client.get("/agents").text and "/agents/1/drain" not in client.get("/agents").text


def test_the_overview_counts_slots_the_queue_and_failures(client: TestClient, settings: Settings) -> None:
    submit(client, name="waits", resources={"nodes": 1, "slots_per_node": 2})
    submit(client, name="queued-too")
    schedule(settings)
    sign_in(client)
    page = client.get("/overview").text
    assert "0 free · 2 used · 0 lost" in page and "1 queued" in page and "No failures." in page


def test_the_logs_page_filters_by_rank_and_escapes(client: TestClient, settings: Settings) -> None:
    job_id = submit(client, resources={"nodes": 1, "slots_per_node": 2})
    schedule(settings)
    (allocation,) = client.get(f"/api/v1/jobs/{job_id}", headers=USER).json()["allocations"]
    lines = [
        {"rank": 0, "stream": "stdout", "time": 0.0, "line": "hello from <b>zero</b>"},
        {"rank": 1, "stream": "stderr", "time": 0.0, "line": "hello from one"},
    ]
    url = f"/api/v1/agents/1/allocations/{allocation['id']}/logs"
    assert client.post(url, json={"lines": lines}, headers=as_agent(1)).status_code == 204
    sign_in(client)
    both = client.get(f"/jobs/{job_id}/logs").text
    assert "[rank 0] hello from &lt;b&gt;zero&lt;/b&gt;" in both and "[rank 1] hello from one" in both
    one = client.get(f"/jobs/{job_id}/logs?rank=1").text
    assert "hello from one" in one and "zero" not in one
    assert client.get("/jobs/999/logs").status_code == 404


def test_the_job_page_shows_the_runtime_env_its_lock_and_its_setup_lines(
    client: TestClient, settings: Settings
) -> None:
    job_id = submit(client, resources={"nodes": 1}, runtime_env={"pip": ["phx-probe==1.0"]})
    sign_in(client)
    assert "phx-probe==1.0</code> · not resolved yet" in client.get(f"/jobs/{job_id}").text
    schedule(settings)
    (allocation,) = client.get(f"/api/v1/jobs/{job_id}", headers=USER).json()["allocations"]
    agent = allocation["nodes"][0]["agent_id"]
    base = f"/api/v1/agents/{agent}/allocations/{allocation['id']}"
    lock = "phx-probe==1.0 \\\n    --hash=sha256:<b>aa</b>\n"
    assert client.post(f"{base}/environment", json={"lock": lock}, headers=as_agent(agent)).status_code == 200
    line = {"rank": None, "stream": "setup", "time": 0.0, "line": "building environment 0123abcd"}
    assert client.post(f"{base}/logs", json={"lines": [line]}, headers=as_agent(agent)).status_code == 204
    page = client.get(f"/jobs/{job_id}").text
    assert "the lock every node installs" in page and "--hash=sha256:&lt;b&gt;aa&lt;/b&gt;" in page
    assert "[setup] building environment 0123abcd" in page
    assert "[setup] building environment 0123abcd" in client.get(f"/jobs/{job_id}/logs").text


def test_checkpoint_downloads_need_a_session_and_a_checkpoint(client: TestClient) -> None:
    job_id = submit(client)
    assert client.get(f"/jobs/{job_id}/checkpoints/5/archive").status_code == 303
    sign_in(client)
    assert "No checkpoint yet." in client.get(f"/jobs/{job_id}").text
    missing = client.get(f"/jobs/{job_id}/checkpoints/5/archive")
    assert missing.status_code == 404 and "no checkpoint of step 5" in missing.text


def test_the_study_pages_list_sort_mark_the_best_and_stop(client: TestClient, settings: Settings) -> None:
    from tests.integration.test_studies import create, driver, finish, report, start_trial, study_body, trials

    study = create(client, study_body(n_trials=3, parallelism=2)).json()
    driver(settings).advance(study["id"])
    for trial, loss in zip(trials(client, study["id"]), (0.3, 0.1), strict=True):
        allocation, agent = start_trial(client, settings, trial["job_id"])
        report(client, allocation, {0: {"loss": loss}})
        finish(client, allocation, agent)
    driver(settings).advance(study["id"])  # tells both, launches trial 2
    sign_in(client)
    listed = client.get("/studies").text
    assert f'data-study="{study["id"]}"' in listed and "3/3" in listed and "0.1 (trial 1)" in listed
    page = client.get(f"/studies/{study['id']}").text
    assert page.index('data-trial="0"') < page.index('data-trial="1"') < page.index('data-trial="2"')
    assert '<tr data-trial="1" class="best">' in page and "★" in page
    by_value = client.get(f"/studies/{study['id']}?sort=value").text
    # ascending by value: 0.1, 0.3, then the trial without a value
    assert by_value.index('data-trial="1"') < by_value.index('data-trial="0"') < by_value.index('data-trial="2"')
    by_x = client.get(f"/studies/{study['id']}?sort=param:x&desc=true").text
    assert "x ▼" in by_x
    assert client.get(f"/studies/{study['id']}?sort=evil").status_code == 200  # an unknown key sorts by number
    assert client.post(f"/studies/{study['id']}/stop", data={"csrf_token": "forged"}).status_code == 403
    stopped = client.post(f"/studies/{study['id']}/stop", data={"csrf_token": csrf(client, "/studies")})
    assert stopped.status_code == 303
    assert client.get(f"/api/v1/studies/{study['id']}", headers=USER).json()["state"] == "STOPPED"
    assert 'action="/studies/1/resume"' in client.get(f"/studies/{study['id']}").text
    assert client.get("/studies/99").status_code == 404


def test_the_job_page_splits_each_ranks_step_and_names_the_slowest(client: TestClient, settings: Settings) -> None:
    from tests.agent_tokens import as_rank

    job_id = submit(client, resources={"nodes": 1, "slots_per_node": 2})
    schedule(settings)
    (allocation,) = client.get(f"/api/v1/jobs/{job_id}", headers=USER).json()["allocations"]

    def figures(rank: int, step: int, exposed: float) -> dict[str, Any]:
        values = {
            "phalanx/step_time_s": 0.1,
            "phalanx/data_time_s": 0.01,
            "phalanx/compute_time_s": 0.05,
            "phalanx/comm_exposed_s": exposed,
            "phalanx/comm_time_s": 0.04,
            "phalanx/comm_bytes_per_step": 4_000_000.0,
        }
        return {"rank": rank, "step": step, "time": 0.0, "values": values}

    # rank 1 waits 30 ms in the all-reduce for rank 0, which waits 5: rank 0 is the straggler;
    # each rank's older report (step 10) is superseded by its newer one
    records = [figures(0, 10, 0.09), figures(1, 10, 0.09), figures(0, 20, 0.005), figures(1, 20, 0.03)]
    url = f"/api/v1/allocations/{allocation['id']}/metrics"
    assert client.post(url, json={"records": records}, headers=as_rank(client, allocation["id"])).status_code == 204
    comm = client.get(f"/api/v1/jobs/{job_id}", headers=USER).json()["communication"]
    assert comm["slowest_rank"] == 0 and comm["bytes_per_step"] == 4_000_000.0
    assert comm["straggler_ratio"] == pytest.approx(0.095 / ((0.095 + 0.07) / 2))
    assert comm["comm_fraction"] == pytest.approx(((0.005 + 0.03) / 2) / 0.1)
    assert [r["step"] for r in comm["ranks"]] == [20, 20]
    assert comm["ranks"][1]["other_s"] == pytest.approx(0.1 - 0.01 - 0.05 - 0.03)
    assert "phalanx/step_time_s" not in client.get(f"/api/v1/jobs/{job_id}", headers=USER).json()["latest_metrics"]
    sign_in(client)
    page = client.get(f"/jobs/{job_id}").text
    assert "Slowest rank: <strong>0</strong>" in page and 'class="slowest"' in page
    assert "3.81 MiB all-reduced per step" in page


def test_the_profile_button_asks_the_ranks_and_the_page_shows_each_ranks_trace(
    client: TestClient, settings: Settings
) -> None:
    import gzip
    import json

    from tests.agent_tokens import as_rank

    job_id = submit(client, resources={"nodes": 1, "slots_per_node": 2})
    schedule(settings)
    (allocation,) = client.get(f"/api/v1/jobs/{job_id}", headers=USER).json()["allocations"]
    sign_in(client)
    page = client.get(f"/jobs/{job_id}").text
    assert 'data-action="profile"' in page
    asked = client.post(f"/jobs/{job_id}/profile", data={"steps": "5", "csrf_token": csrf(client, f"/jobs/{job_id}")})
    assert asked.status_code == 303 and asked.headers["location"].startswith(f"/jobs/{job_id}#profile-")
    twice = client.post(f"/jobs/{job_id}/profile", data={"steps": "5", "csrf_token": csrf(client, f"/jobs/{job_id}")})
    assert twice.status_code == 409 and "is still recording" in twice.text
    forged = client.post(f"/jobs/{job_id}/profile", data={"steps": "5", "csrf_token": "guess"})
    assert forged.status_code == 403
    (profile,) = client.get(f"/api/v1/jobs/{job_id}/profiles", headers=USER).json()
    assert profile["steps"] == 5 and profile["state"] == "recording"

    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "tid": 1, "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "tid": 1, "ts": 0, "dur": 500},
        {"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce", "tid": 2, "ts": 400, "dur": 400},
    ]
    body = gzip.compress(json.dumps({"traceEvents": events}).encode())
    url = f"/api/v1/allocations/{allocation['id']}/profiles/{profile['id']}/ranks/0"
    rank_token = as_rank(client, allocation["id"])
    assert client.put(url, content=body, headers={**rank_token, "Content-Type": "application/gzip"}).status_code == 204
    failed = client.put(url[:-1] + "1", json={"message": "profiler busy"}, headers=rank_token)
    assert failed.status_code == 204

    page = client.get(f"/jobs/{job_id}").text
    assert f"Profile {profile['id']}" in page and "2 of 2 ranks answered" in page
    assert "no trace: profiler busy" in page
    link = f"/jobs/{job_id}/profiles/{profile['id']}/ranks/0/trace"
    assert f'href="{link}"' in page and 'class="overlap" style="width: 10.0%"' in page
    download = client.get(link)
    assert download.status_code == 200 and download.content == body
    assert client.get(link[:-7] + "1/trace").status_code == 404
