"""The dashboard's job page with a 100,000-step metric.

    python bench/bench_dashboard.py [--steps 100000] [--repeat 20] [--loads 5]

A job on the PostgreSQL + Redis stack reports `--steps` steps of one metric through the real
path (`report()` -> metric batches -> COPY). Then, in this run:
1. Server time to render the chart data (`GET /jobs/{id}/chart-data`: read the series, LTTB down
   to 2,000 points, encode), read from its Server-Timing header; median of `--repeat` calls.
   Goal <= 100 ms. Baseline in the same run: the REST read of the same metric's raw points
   (`GET /api/v1/jobs/{id}/metrics?name=loss`, every point, no downsampling), client-side time,
   against the chart data's client-side time: the ratio says what a page that fetched the
   raw series would pay instead.
2. Browser load -> chart drawn: headless Chromium (Debian's, through Playwright) opens the job
   page; the figure is the page's own `performance.now()` when the chart was drawn (ms since
   navigation start, so it includes the page, the scripts, the chart-data fetch and uPlot's
   draw); median of `--loads` loads, after one warm-up. Goal <= 1 s.

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from bench._common import ADMIN_TOKEN, BenchError, log, median, postgres_stack, wait_for_job, wait_quiet
from phalanx.schemas import JobSpec

GOAL_SERVER_MS = 100.0
GOAL_BROWSER_MS = 1000.0
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"]
REPORTER = """\
import math

import phalanx.train as pt

ctx = pt.init()
for step in range(int(ctx.hparams["steps"])):
    ctx.report({"loss": 1.0 / (1.0 + step / 2000.0) + 0.05 * math.sin(step / 40.0)}, step=step)
ctx.finish()
"""


def timed_get(http: httpx.Client, url: str) -> tuple[float, httpx.Response]:
    started = time.perf_counter()
    response = http.get(url)
    response.raise_for_status()
    return (time.perf_counter() - started) * 1000, response


def server_ms(response: httpx.Response) -> float:
    timing = response.headers["server-timing"]  # "chart;dur=12.3"
    return float(timing.split("dur=")[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--loads", type=int, default=5)
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args()

    with postgres_stack(agents=1) as running, tempfile.TemporaryDirectory(prefix="phalanx-bench-") as tmp:
        workdir = Path(tmp)
        (workdir / "report.py").write_text(REPORTER)
        spec = JobSpec.model_validate(
            {
                "name": "chart-100k",
                "entrypoint": "python report.py",
                "resources": {"nodes": 1, "slots_per_node": 1},
                "hyperparameters": {"steps": args.steps},
            }
        )
        job = running.client.submit(spec, workdir)
        log(f"job {job.id} reports {args.steps} steps")
        detail = wait_for_job(running, job.id, 600)
        if detail.state.value != "COMPLETED":
            raise BenchError(f"job {job.id} ended {detail.state.value}")
        url = running.client.url
        api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=60)
        page_http = httpx.Client(base_url=url, cookies={"phalanx_session": ADMIN_TOKEN}, timeout=60)
        stored = len(api.get(f"/api/v1/jobs/{job.id}/metrics", params={"name": "loss"}).json())
        if stored != args.steps:
            raise BenchError(f"job {job.id} stored {stored} points, not {args.steps}")
        wait_quiet(running.pids)

        chart_client, chart_server, raw_client = [], [], []
        for _ in range(args.repeat):  # interleaved, so both see the same machine
            elapsed, response = timed_get(page_http, f"/jobs/{job.id}/chart-data")
            chart_client.append(elapsed)
            chart_server.append(server_ms(response))
            series = response.json()["series"]
            elapsed, _ = timed_get(api, f"/api/v1/jobs/{job.id}/metrics?name=loss")
            raw_client.append(elapsed)
        points = len(series[0]["steps"])
        log(f"chart data: server {median(chart_server):.1f} ms, {points} of {series[0]['total']} points")

        from playwright.sync_api import sync_playwright

        drawn = []
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
            context = browser.new_context(viewport={"width": 1280, "height": 900})
            context.add_cookies([{"name": "phalanx_session", "value": ADMIN_TOKEN, "url": url}])
            page = context.new_page()
            for load in range(args.loads + 1):
                page.goto(f"{url}/jobs/{job.id}")
                page.wait_for_selector("#charts[data-drawn]", timeout=30_000)
                shown = page.eval_on_selector('.chart[data-metric="loss"]', "e => Number(e.dataset.points)")
                if shown != points:
                    raise BenchError(f"the chart drew {shown} points, the server sent {points}")
                if load:  # the first load warms the browser's cache and the server's pools
                    drawn.append(float(page.eval_on_selector("#charts", "e => Number(e.dataset.drawn)")))
            browser.close()

    result = {
        "benchmark": "dashboard",
        "steps": args.steps,
        "chart_points": points,
        "chart_data_server_ms": round(median(chart_server), 1),
        "chart_data_client_ms": round(median(chart_client), 1),
        "raw_metrics_client_ms": round(median(raw_client), 1),
        "chart_vs_raw": round(median(chart_client) / median(raw_client), 3),
        "browser_load_to_chart_ms": round(median(drawn), 1),
        "browser_loads_ms": [round(d, 1) for d in drawn],
        "goal_server_ms": GOAL_SERVER_MS,
        "goal_browser_ms": GOAL_BROWSER_MS,
        "ok": median(chart_server) <= GOAL_SERVER_MS and median(drawn) <= GOAL_BROWSER_MS,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
