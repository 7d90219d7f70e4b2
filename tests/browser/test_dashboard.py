"""The dashboard in a real browser against the real stack (PostgreSQL, Redis, scheduler, two
agents, torchrun ranks): live updates without reloads, charts, logs, buttons, study pages."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Page, expect

from phalanx.client import load_job_file
from tests.browser.conftest import ARTIFACTS, shot, sign_in
from tests.conftest import ADMIN_TOKEN, AGENT_TOKEN
from tests.processes import REPO, Stack

pytestmark = [pytest.mark.browser, pytest.mark.e2e]
SCRIPTED = REPO / "examples" / "scripted" / "job.yaml"
LIVE_S = 90_000  # ms: a job's start on 2 cores, its steps, its end


def submit_scripted(stack: Stack, name: str, **hyperparameters: object) -> int:
    spec, workdir = load_job_file(SCRIPTED)
    spec = spec.model_copy(update={"name": name, "hyperparameters": {**spec.hyperparameters, **hyperparameters}})
    with stack.client() as client:
        return client.submit(spec, workdir).id


def mark_page(page: Page) -> None:
    """A flag that only survives while the page is not reloaded."""
    page.evaluate("window.__notReloaded = true")


def assert_not_reloaded(page: Page) -> None:
    assert page.evaluate("window.__notReloaded === true"), "the page was reloaded"


def test_a_job_goes_live_from_queued_to_completed_with_its_chart_and_both_ranks_logs(stack: Stack, page: Page) -> None:
    sign_in(page, stack, "/jobs")
    shot(page, "jobs-empty")
    mark_page(page)
    steps = 30
    job_id = submit_scripted(stack, "live-job", steps=steps, step_seconds=0.1)
    # the table learns of the job over Server-Sent Events, without a reload
    expect(page.locator(f'#jobs tr[data-job="{job_id}"]')).to_be_visible(timeout=LIVE_S)
    assert_not_reloaded(page)

    page.click(f'#jobs tr[data-job="{job_id}"] td a')
    page.wait_for_url(f"{stack.url}/jobs/{job_id}")
    mark_page(page)
    expect(page.locator("#job-state")).to_have_text("COMPLETED", timeout=LIVE_S)
    assert_not_reloaded(page)
    chart = page.locator('.chart[data-metric="step_value"]')
    expect(chart).to_have_attribute("data-points", str(steps), timeout=10_000)  # one point per reported step
    expect(chart.locator("canvas")).to_be_visible()
    logs = page.locator("#job-logs")
    expect(logs).to_contain_text("step 0 rank 0")
    expect(logs).to_contain_text("step 0 rank 1")
    page.select_option("#log-rank", "1")  # the rank filter hides rank 0's lines
    expect(logs.locator('span[data-rank="0"]').first).to_be_hidden()
    expect(logs.locator('span[data-rank="1"]').first).to_be_visible()
    shot(page, "job")

    page.goto(f"{stack.url}/jobs/{job_id}/logs?rank=0")
    expect(page.locator("#logs")).to_contain_text(f"step {steps - 1} rank 0")
    shot(page, "logs")
    for path, name in (("/overview", "overview"), ("/agents", "agents"), ("/jobs", "jobs")):
        page.goto(stack.url + path)
        shot(page, name)


def test_the_kill_button_cancels_a_running_job_and_user_text_stays_text(stack: Stack, page: Page) -> None:
    job_id = submit_scripted(stack, "to-kill", steps=10_000, step_seconds=0.1, note="<script>window.__xss=1</script>")
    sign_in(page, stack, f"/jobs/{job_id}")
    expect(page.locator("#job-state")).to_have_text("RUNNING", timeout=LIVE_S)
    expect(page.locator('.chart[data-metric="step_value"] canvas')).to_be_visible(timeout=30_000)
    expect(page.locator("pre").filter(has_text="<script>window.__xss=1</script>").first).to_be_visible()
    assert page.evaluate("window.__xss === undefined")
    shot(page, "running")
    page.once("dialog", lambda dialog: dialog.accept())
    page.click('button[data-action="kill"]')
    expect(page.locator("#job-state")).to_have_text("CANCELLED", timeout=LIVE_S)
    expect(page.locator('button[data-action="kill"]')).to_have_count(0)
    shot(page, "cancelled")


def test_the_study_page_lists_its_trials_with_the_pruned_one_marked(stack: Stack, page: Page) -> None:
    from phalanx.schemas import StudySpec

    spec, workdir = load_job_file(SCRIPTED)
    trial = spec.model_dump(mode="json", exclude={"name"})
    trial["resources"] = {"nodes": 1, "slots_per_node": 1}
    trial["hyperparameters"] = {"steps": 12, "step_seconds": 0.25}
    study = StudySpec.model_validate(
        {
            "name": "browser-tune",
            "objective": {"metric": "loss", "direction": "minimize"},
            "search_space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            "sampler": {"type": "random", "seed": 0},
            # the good configuration first, then a far worse one: the median pruner stops it
            "pruner": {"type": "median", "n_startup_trials": 1, "n_warmup_steps": 2},
            "enqueue": [{"x": 0.3}, {"x": 1.0}],
            "n_trials": 2,
            "parallelism": 1,
            "trial": trial,
        }
    )
    with stack.client() as client:
        study_id = client.create_study(study, workdir).id
        sign_in(page, stack, f"/studies/{study_id}")
        mark_page(page)
        done = client.wait_study(study_id, timeout=240)
    assert done.state.value == "COMPLETED", done
    # the page followed the study live, without a reload
    expect(page.locator("#study-state")).to_have_text("COMPLETED", timeout=30_000)
    expect(page.locator('#trials tr[data-trial="1"] .state')).to_have_text("PRUNED")
    expect(page.locator('#trials tr[data-trial="0"] .state')).to_have_text("COMPLETE")
    assert_not_reloaded(page)
    shot(page, "study")
    page.goto(stack.url + "/studies")
    expect(page.locator("body")).to_contain_text("browser-tune")
    shot(page, "studies")


def test_a_100000_step_chart_is_downsampled_and_drawn_quickly(stack: Stack, page: Page, tmp_path: Path) -> None:
    """The issue's benchmark, measured in the browser run: chart data's server time (its
    Server-Timing header) and the page's load -> chart drawn. The goals (100 ms, 1 s) are
    checked by bench/bench_dashboard.py on a quiet machine; here the bounds only catch a
    regression by an order of magnitude, and the figures go to test-artifacts/."""
    from bench.bench_dashboard import REPORTER, server_ms
    from phalanx.schemas import JobSpec

    steps = 100_000
    (tmp_path / "report.py").write_text(REPORTER)
    spec = JobSpec.model_validate(
        {
            "name": "chart-100k",
            "entrypoint": "python report.py",
            "resources": {"nodes": 1, "slots_per_node": 1},
            "hyperparameters": {"steps": steps},
        }
    )
    with stack.client() as client:
        job_id = client.submit(spec, tmp_path).id
        job = client.wait(job_id, timeout=240)
    assert job.state.value == "COMPLETED", job
    sign_in(page, stack, f"/jobs/{job_id}")
    with httpx.Client(base_url=stack.url, cookies={"phalanx_session": ADMIN_TOKEN}) as http:
        timings = []
        for _ in range(10):
            response = http.get(f"/jobs/{job_id}/chart-data")
            timings.append(server_ms(response))
        (series,) = response.json()["series"]
    assert series["total"] == steps and len(series["steps"]) == 2000
    drawn = []
    for _ in range(3):
        page.goto(f"{stack.url}/jobs/{job_id}")
        page.wait_for_selector("#charts[data-drawn]")
        expect(page.locator('.chart[data-metric="loss"]')).to_have_attribute("data-points", "2000")
        drawn.append(float(page.eval_on_selector("#charts", "e => Number(e.dataset.drawn)")))
    shot(page, "job")
    figures = {"chart_data_server_ms": statistics.median(timings), "load_to_chart_drawn_ms": statistics.median(drawn)}
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "chart-100k.json").write_text(json.dumps(figures))
    print(f"100,000-step chart: {figures}")
    assert figures["chart_data_server_ms"] < 1000 and figures["load_to_chart_drawn_ms"] < 5000, figures


def test_the_embedded_stack_updates_the_job_page_live_too(tmp_path: Path, page: Page) -> None:
    """`phalanx up` (SQLite, no Redis): the streams are woken through the data dir's files."""
    import os
    import subprocess

    from phalanx.client import Client
    from tests.processes import PHALANX, free_port, processes_with_env, wait_for

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
    data = tmp_path / "data"
    data.mkdir()  # `phalanx up` keeps the tokens it finds there
    (data / "credentials.json").write_text(json.dumps({"admin_token": ADMIN_TOKEN, "agent_token": AGENT_TOKEN}))
    log = (tmp_path / "up.log").open("wb")
    up = subprocess.Popen(
        [*PHALANX, "up", "--port", str(port), "--data-dir", str(data)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        with Client(url, ADMIN_TOKEN) as client:
            wait_for(lambda: client.healthy() and len(client.agents()) == 2, 90, "phalanx up to serve two agents")
            spec, workdir = load_job_file(SCRIPTED)
            spec = spec.model_copy(
                update={"name": "embedded-live", "hyperparameters": {"steps": 25, "step_seconds": 0.1}}
            )
            job_id = client.submit(spec, workdir).id
            page.goto(f"{url}/login?next=/jobs/{job_id}")
            page.fill("input[name=token]", ADMIN_TOKEN)
            page.click("button[type=submit]")
            page.wait_for_url(f"{url}/jobs/{job_id}")
            mark_page(page)
            expect(page.locator("#job-state")).to_have_text("COMPLETED", timeout=LIVE_S)
            expect(page.locator('.chart[data-metric="step_value"]')).to_have_attribute("data-points", "25")
            expect(page.locator("#job-logs")).to_contain_text("step 24 rank 1")
            assert_not_reloaded(page)
            shot(page, "job")
    except BaseException:
        print((tmp_path / "up.log").read_text(errors="replace")[-6000:])
        raise
    finally:
        up.terminate()  # as a service manager stops it: the whole stack goes
        up.wait(timeout=60)
        log.close()
    assert processes_with_env("PHALANX_DATA_DIR", str(data.resolve())) == []
