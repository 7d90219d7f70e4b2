"""The dashboard's sharing pages on the real app and PostgreSQL: team shares and queue holds, a
job's place in line and its hold button, the queue page, and the usage page with its chart."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.settings import Settings
from tests.agent_tokens import register_agent
from tests.integration.test_access import new_user
from tests.integration.test_dashboard import csrf, sign_in
from tests.integration.test_fair_share import schedule, submit
from tests.integration.test_fault_tolerance import exit_node, start_all
from tests.integration.test_teams import make_team


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    """The app with no agent: each test registers the slots its story needs."""
    with TestClient(create_app(settings, enqueue=lambda *_, **__: None), follow_redirects=False) as test_client:
        yield test_client


def token_of(headers: dict[str, str]) -> str:
    return headers["Authorization"].removeprefix("Bearer ")


def test_a_cluster_admin_sets_a_teams_share_and_its_admins_hold_its_queue(client: TestClient) -> None:
    lead, dev = new_user(client, "lead"), new_user(client, "dev")
    make_team(client, "vision", lead="admin", dev="member")
    sign_in(client)
    form = {
        "weight": "2",
        "guarantee": "cpu=4",
        "limit": "cpu=8, gpu=2",
        "user_limit": "",
        "csrf_token": csrf(client, "/teams"),
    }
    assert client.post("/teams/vision/policy", data=form).status_code == 303
    page = client.get("/teams").text
    assert "cpu=4" in page and "cpu=8, gpu=2" in page and 'action="/teams/vision/policy"' in page
    bad = client.post("/teams/vision/policy", data={**form, "limit": "cpu=lots"})
    assert bad.status_code == 422 and "SLOT_TYPE=N" in bad.text
    assert client.post("/teams/vision/policy", data={**form, "weight": "heavy"}).status_code == 422
    assert client.post("/teams/vision/policy", data={**form, "limit": "cpu=²"}).status_code == 422  # not int()'d
    too_many = client.post("/teams/vision/policy", data={**form, "limit": "cpu=2000000"})
    assert too_many.status_code == 422 and "out of bounds" in too_many.text

    sign_in(client, token_of(lead))  # a team admin holds the queue, but does not set shares
    page = client.get("/teams").text
    assert 'action="/teams/vision/policy"' not in page and "Hold queue" in page
    token = csrf(client, "/teams")
    assert client.post("/teams/vision/policy", data={**form, "csrf_token": token}).status_code == 403
    assert client.post("/teams/vision/hold", data={"csrf_token": token}).status_code == 303
    assert "queue held" in client.get("/teams").text
    assert client.get("/api/v1/teams/vision", headers=lead).json()["queue_held"] is True

    sign_in(client, token_of(dev))
    page = client.get("/teams").text
    assert "Hold queue" not in page and "Release queue" not in page
    assert client.post("/teams/vision/release", data={"csrf_token": csrf(client, "/teams")}).status_code == 403


def test_a_queued_jobs_page_shows_its_place_and_team_admins_hold_it(client: TestClient, settings: Settings) -> None:
    lead, dev = new_user(client, "lead"), new_user(client, "dev")
    make_team(client, "vision", lead="admin", dev="member")
    register_agent(client, "n1", cpu_slots=1)
    running, waiting = submit(client, dev, "first"), submit(client, dev, "second")
    schedule(settings)
    sign_in(client, token_of(dev))
    page = client.get(f"/jobs/{waiting}").text
    assert 'id="job-queue"' in page and "#1 of 1" in page and 'data-action="hold"' not in page  # its owner pauses
    assert "#1 of 1" in client.get("/jobs").text
    sign_in(client, token_of(lead))
    page = client.get(f"/jobs/{waiting}").text
    assert 'data-action="hold"' in page
    held = client.post(f"/jobs/{waiting}/hold", data={"csrf_token": csrf(client, f"/jobs/{waiting}")})
    assert held.status_code == 303
    page = client.get(f"/jobs/{waiting}").text
    assert 'id="job-held"' in page and 'data-action="release"' in page and "not in line" in page
    assert "SCHEDULED" in client.get(f"/jobs/{running}").text  # the first took the slot


def test_the_queue_page_lists_jobs_in_placement_order_and_hides_another_teams_names(
    client: TestClient, settings: Settings
) -> None:
    heavy, light = new_user(client, "heavy"), new_user(client, "light")
    make_team(client, "big", heavy="member")
    make_team(client, "tiny", light="member")
    register_agent(client, "n1", cpu_slots=1)
    running = submit(client, heavy, "running")
    schedule(settings)
    start_all(client, running)
    queued = [submit(client, heavy, "secret-name"), submit(client, light, "mine")]
    sign_in(client, token_of(light))
    page = client.get("/queue").text
    assert page.index(f"{queued[1]} · mine") < page.index("another team's job")
    assert "secret-name" not in page and "2 queued" in page


def test_the_usage_page_charts_slot_hours_by_team_and_refuses_a_bad_date(
    client: TestClient, settings: Settings
) -> None:
    dev = new_user(client, "dev")
    make_team(client, "vision", dev="member")
    register_agent(client, "n1", cpu_slots=2)
    job_id = submit(client, dev, "used", slots=2)
    schedule(settings)
    exit_node(client, start_all(client, job_id), 0, 0)
    sign_in(client, token_of(dev))
    page = client.get("/usage").text
    assert 'id="usage-chart"' in page and "<rect" in page and "vision" in page
    assert "<td>dev</td>" in page
    empty = client.get("/usage", params={"since": "2020-01-01", "until": "2020-01-02"}).text
    assert "No slot was held in this period." in empty
    bad = client.get("/usage", params={"since": "yesterday"})
    assert bad.status_code == 422 and "2026-12-01" in bad.text
    reversed_period = client.get("/usage", params={"since": "2030-01-02", "until": "2030-01-01"})
    assert reversed_period.status_code == 422
    widest = client.get("/usage", params={"since": "0001-01-01", "until": "9999-12-31"})  # no overflow: a 4xx
    assert widest.status_code == 422 and "at most 3660 days" in widest.text
