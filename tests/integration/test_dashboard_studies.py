"""The study page's charts on a real PostgreSQL: optimisation history and intermediate values (their
JSON), parallel coordinates and parameter importance (drawn on the server), escaping, the live
fragment. (Drawing in a real browser comes with the browser tests.)"""

from __future__ import annotations

import html
import json
import re
from typing import Any

import pytest
from fastapi.testclient import TestClient

from server import tuning
from server.dashboard import study_charts
from server.settings import Settings
from tests.integration.test_dashboard import USER, sign_in
from tests.integration.test_studies import create, driver, finish, report, start_trial, study_body, trials

pytestmark = pytest.mark.integration
EVIL = "<script>alert(1)</script>"
SPACE: dict[str, Any] = {
    "x": {"type": "float", "low": 0.0, "high": 1.0},
    "lr": {"type": "float", "low": 1e-4, "high": 1e-1, "log": True},
    "opt": {"type": "categorical", "choices": ["sgd", "adam", EVIL]},
    EVIL: {"type": "int", "low": 1, "high": 4},
}


def embedded(page: str, element_id: str) -> Any:
    match = re.search(rf'<script type="application/json" id="{element_id}">(.*?)</script>', page, re.S)
    assert match, page
    return json.loads(match.group(1))


def run_trial(client: TestClient, settings: Settings, study_id: int, number: int, points: dict[int, float]) -> None:
    """Start trial `number`, report its losses (the driver hands them to Optuna) and end its job."""
    trial = trials(client, study_id)[number]
    allocation, agent = start_trial(client, settings, trial["job_id"])
    report(client, allocation, {step: {"loss": loss} for step, loss in points.items()})
    driver(settings).advance(study_id)
    pruned = client.get(f"/api/v1/jobs/{trial['job_id']}", headers=USER).json()["state"] == "PRUNED"
    finish(client, allocation, agent, exit_code=143 if pruned else 0)
    driver(settings).advance(study_id)  # tells Optuna, launches the next trial


@pytest.fixture
def tuned(client: TestClient, settings: Settings) -> int:
    """Trials 0, 2 and 3 COMPLETE, trial 1 PRUNED."""
    pruner = {"type": "median", "n_startup_trials": 1, "n_warmup_steps": 0}
    body = study_body(search_space=SPACE, pruner=pruner, n_trials=4, parallelism=1)
    response = create(client, body)
    assert response.status_code == 201, response.text
    study_id = int(response.json()["id"])
    driver(settings).advance(study_id)
    run_trial(client, settings, study_id, 0, {0: 1.0, 1: 0.5, 2: 0.2})
    run_trial(client, settings, study_id, 1, {0: 5.0, 1: 4.0})
    run_trial(client, settings, study_id, 2, {0: 0.8, 1: 0.3, 2: 0.1})
    run_trial(client, settings, study_id, 3, {0: 0.7, 1: 0.35, 2: 0.12})
    shown = [(t["state"], t["values"]) for t in trials(client, study_id)]
    assert shown == [("COMPLETE", [0.2]), ("PRUNED", [4.0]), ("COMPLETE", [0.1]), ("COMPLETE", [0.12])]
    study_charts._importance_cache.clear()
    sign_in(client)
    return study_id


def test_history_and_intermediate_values_are_embedded_as_json(client: TestClient, tuned: int) -> None:
    page = client.get(f"/studies/{tuned}").text
    history = embedded(page, "history-data")
    assert history["numbers"] == [0, 1, 2, 3] and history["metric"] == "loss" and not history["multi"]
    assert history["complete"] == [0.2, None, 0.1, 0.12]
    assert history["pruned"] == [None, 4.0, None, None]  # the pruned trial apart, at its last value
    assert history["best"] == [0.2, 0.2, 0.1, 0.1]
    intermediate = embedded(page, "intermediate-data")
    assert intermediate["steps"] == [0, 1, 2]
    lines = {t["number"]: t for t in intermediate["trials"]}
    assert lines[0]["values"] == [1.0, 0.5, 0.2] and lines[1]["values"] == [5.0, 4.0, None]
    assert lines[1]["pruned"] and lines[1]["label"] == "trial 1 (pruned)"
    assert not lines[0]["pruned"] and lines[2]["best"] and "pruned" not in lines[2]["label"]
    assert '<script src="/static/study.js" defer></script>' in page


def test_parallel_coordinates_draw_one_polyline_per_complete_trial(client: TestClient, tuned: int) -> None:
    page = client.get(f"/studies/{tuned}").text
    svg = page[page.index('<svg class="parcoords"') : page.index("</svg>")]
    lines = re.findall(r'<polyline data-number="(\d+)" points="([^"]+)" stroke="(#[0-9a-f]{6})"( class="best")?>', svg)
    assert sorted(int(n) for n, *_ in lines) == [0, 2, 3]  # COMPLETE ones; the pruned trial 1 has none
    assert [(n, best) for n, _, _, best in lines][-1] == ("2", ' class="best"')  # the best, drawn on top
    for _, points, _, _ in lines:
        assert len(points.split()) == len(SPACE) + 1  # a point on each parameter's axis and the objective's
    by_trial = {int(n): [tuple(map(float, p.split(","))) for p in points.split()] for n, points, *_ in lines}
    # the objective's axis: higher is up (smaller y); 0.1 at the bottom, 0.2 at the top
    assert by_trial[2][-1][1] > by_trial[3][-1][1] > by_trial[0][-1][1]
    # categories are evenly spaced: sgd, adam, EVIL at the bottom, middle and top of the "opt" axis
    opt_y = {n: by_trial[n][2][1] for n in by_trial}
    chosen = {t["number"]: t["params"]["opt"] for t in trials(client, tuned) if t["number"] in by_trial}
    slots = {"sgd": 310.0, "adam": 179.0, EVIL: 48.0}
    assert all(opt_y[n] == slots[choice] for n, choice in chosen.items())
    assert '<text class="scale" y="38">log</text>' in svg  # lr's axis, and only it, is a log axis
    assert svg.count('class="scale"') == 1


def test_importance_bars_and_their_notes(
    client: TestClient, settings: Settings, tuned: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    page = client.get(f"/studies/{tuned}").text
    bars = re.findall(r'<div class="row" data-param="([^"]+)">.*?style="width: ([\d.]+)%"', page)
    assert sorted(html.unescape(name) for name, _ in bars) == sorted(SPACE)
    widths = [float(w) for _, w in bars]
    assert widths == sorted(widths, reverse=True) and widths[0] == 100.0  # the longest bar is the most important
    api = client.get(f"/api/v1/studies/{tuned}/importance", headers=USER).json()  # the same evaluator
    expected = api["importances"]
    assert api["method"] == study_charts.IMPORTANCE_METHOD and set(expected) == set(SPACE)
    assert html.unescape(bars[0][0]) == max(expected, key=expected.__getitem__)

    def broken(*_: Any) -> dict[str, float]:
        raise RuntimeError("no variance")

    study_charts._importance_cache.clear()
    monkeypatch.setattr(tuning, "importances", broken)
    failed = client.get(f"/studies/{tuned}")
    assert failed.status_code == 200 and 'class="row"' not in failed.text
    assert "Parameter importance could not be computed (RuntimeError: no variance)." in failed.text


def test_a_new_study_has_notes_instead_of_charts(client: TestClient, settings: Settings) -> None:
    study_id = int(create(client, study_body()).json()["id"])
    driver(settings).advance(study_id)
    sign_in(client)
    page = client.get(f"/studies/{study_id}").text
    assert embedded(page, "history-data")["numbers"] == [] and embedded(page, "intermediate-data")["trials"] == []
    assert "No finished trial yet." in page and "<svg" not in page and "No COMPLETE trial yet" in page
    assert "Parameter importance needs 2 COMPLETE trials; 0 so far." in page


def test_user_text_in_parameters_is_escaped(client: TestClient, tuned: int) -> None:
    page = client.get(f"/studies/{tuned}").text
    assert EVIL not in page and "<script>alert" not in page
    assert html.escape(EVIL, quote=False) in page  # the axis, the bar, the table header


def test_a_multi_objective_study_plots_its_first_objective_and_its_front(
    client: TestClient,
    settings: Settings,
) -> None:
    body = study_body(
        objective=[{"metric": "acc", "direction": "maximize"}, {"metric": "latency", "direction": "minimize"}],
        sampler={"type": "nsga2", "seed": 0, "population_size": 4},
        n_trials=3,
        parallelism=3,
    )
    study_id = int(create(client, body).json()["id"])
    driver(settings).advance(study_id)
    for trial, (acc, latency) in zip(trials(client, study_id), [(0.9, 10.0), (0.8, 5.0), (0.7, 7.0)], strict=True):
        allocation, agent = start_trial(client, settings, trial["job_id"])
        report(client, allocation, {0: {"acc": acc, "latency": latency}})
        finish(client, allocation, agent)
    driver(settings).advance(study_id)
    sign_in(client)
    page = client.get(f"/studies/{study_id}").text
    history = embedded(page, "history-data")
    assert history["multi"] and history["metric"] == "acc" and history["complete"] == [0.9, 0.8, 0.7]
    assert history["front"] == [0.9, 0.8, None] and "best" not in history  # trial 2 is dominated
    assert "the first of 2 objectives" in page
    assert "single-objective studies only" in page  # no intermediate values, no importance
    assert page.count("<polyline") == 3 and page.count('class="best"') >= 2


def test_the_live_fragment_keeps_the_sort(client: TestClient, tuned: int) -> None:
    page = client.get(f"/studies/{tuned}?sort=value&desc=true").text
    wrapper = re.search(r'<div id="study-live"[^>]*>', page, re.S)
    assert wrapper, page
    attributes = wrapper.group(0)
    version = client.get(f"/api/v1/studies/{tuned}", headers=USER).json()["version"]  # no event for what it shows
    assert f'sse-connect="/studies/{tuned}/events?since={version}"' in attributes
    assert 'hx-trigger="sse:changed"' in attributes
    assert f'hx-get="/studies/{tuned}?fragment=1&amp;sort=value&amp;desc=true"' in attributes
    assert 'hx-select="#study-body"' in attributes and "every" not in attributes  # no polling
    fragment = client.get(f"/studies/{tuned}?fragment=1&sort=value&desc=true").text
    assert fragment.lstrip().startswith('<div id="study-body"') and "<html" not in fragment
    assert "study.js" not in fragment and 'id="history-data"' in fragment
    # descending by value: the pruned trial's 4.0 first, then 0.2, 0.12, 0.1
    order = [int(n) for n in re.findall(r'<tr data-trial="(\d+)"', fragment)]
    assert order == [1, 0, 3, 2]
