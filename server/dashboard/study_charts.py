"""The charts of a study's page, computed from its `StudyDetail` (and Optuna's study where only
Optuna holds the data): what optuna-dashboard shows. Optimisation history and intermediate values
become data for uPlot (embedded as JSON: no NaN, no infinities); parallel coordinates and parameter
importance are laid out here, ready for the template to draw as SVG and bars without JavaScript.
Pure functions of their arguments, but for `importance_bars`, which remembers its answers."""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from phalanx import schemas

if TYPE_CHECKING:
    import optuna

log = logging.getLogger(__name__)

PRUNED = schemas.TrialState.PRUNED


def _finite(value: Any) -> float | None:
    """A number JSON can carry (NaN and infinities would make the page's JSON unparseable)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def history_data(study: schemas.StudyDetail) -> dict[str, Any]:
    """Optimisation history: the first objective of every finished trial by trial number, COMPLETE
    and PRUNED apart, with the best so far (one objective) or the Pareto front (several)."""
    finished = [t for t in study.trials if t.values and t.state in (schemas.TrialState.COMPLETE, PRUNED)]

    def first(t: schemas.TrialView, state: schemas.TrialState) -> float | None:
        return _finite(t.values[0]) if t.values and t.state is state else None

    objective = study.spec.objectives[0]
    data: dict[str, Any] = {
        "metric": objective.metric,
        "direction": objective.direction.value,
        "multi": study.spec.multi_objective,
        "numbers": [t.number for t in finished],
        "complete": [first(t, schemas.TrialState.COMPLETE) for t in finished],
        "pruned": [first(t, PRUNED) for t in finished],
    }
    if study.spec.multi_objective:
        data["front"] = [first(t, schemas.TrialState.COMPLETE) if t.best else None for t in finished]
    else:
        data["best"] = [_finite(t.best_so_far) for t in finished]
    return data


def intermediate_data(study: schemas.StudyDetail, reported: dict[int, dict[int, float]]) -> dict[str, Any]:
    """One line per trial that reported intermediate values, on the steps of all of them (null
    where a trial has no value at a step); pruned trials say so."""
    trials = [t for t in study.trials if reported.get(t.number)]
    steps = sorted({step for t in trials for step in reported[t.number]})
    series = []
    for t in trials:
        note = {PRUNED: " (pruned)", schemas.TrialState.RUNNING: " (running)"}.get(t.state, "")
        series.append(
            {
                "number": t.number,
                "label": f"trial {t.number}{note}{' ★' if t.best else ''}",
                "pruned": t.state is PRUNED,
                "best": t.best,
                "values": [_finite(reported[t.number].get(step)) for step in steps],
            }
        )
    return {"metric": study.spec.objectives[0].metric, "steps": steps, "trials": series}


def reported_values(study: optuna.Study | None) -> dict[int, dict[int, float]]:
    """Each trial's intermediate values as Optuna holds them, by trial number."""
    if study is None:
        return {}
    return {t.number: dict(t.intermediate_values) for t in study.get_trials(deepcopy=False)}


@dataclass(frozen=True)
class Tick:
    y: float
    label: str


@dataclass(frozen=True)
class Axis:
    name: str  # the parameter, or the objective's metric
    title: str  # what hovering the name says
    x: float
    ticks: list[Tick]
    log: bool


@dataclass(frozen=True)
class Polyline:
    number: int
    points: str  # "x,y x,y …" in the SVG's coordinates
    color: str
    best: bool
    title: str


@dataclass(frozen=True)
class ParallelCoordinates:
    width: int
    height: int
    top: float
    bottom: float
    axes: list[Axis]
    lines: list[Polyline]  # worst first, so that the better ones are drawn over them
    objective: str
    value_range: tuple[float, float]


PC_WIDTH, PC_HEIGHT, PC_TOP, PC_BOTTOM, PC_SIDE = 1000, 340, 48, 310, 60
BEST_COLOR = "#e8590c"


def _label(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return "None" if value is None else str(value)


class _Scale:
    """Maps a value onto [0, 1] (0 at the bottom of its axis) and says where its ticks go."""

    def __init__(self, low: float, high: float, log: bool = False, integer: bool = False) -> None:
        self.log = log and low > 0
        self.integer = integer
        self.low, self.high = (math.log10(low), math.log10(high)) if self.log else (low, high)

    def fraction(self, value: Any) -> float | None:
        number = _finite(value)
        if number is None or (self.log and number <= 0):
            return None
        x = math.log10(number) if self.log else number
        if self.high == self.low:
            return 0.5
        return min(1.0, max(0.0, (x - self.low) / (self.high - self.low)))

    def ticks(self) -> list[Tick]:
        if self.high == self.low:
            return [Tick(0.5, _label(10**self.low if self.log else self.low))]
        if self.log:
            decades = range(math.ceil(self.low), math.floor(self.high) + 1)
            raw = [10**self.low, *(10.0**d for d in decades), 10**self.high]
        else:
            raw = [self.low + (self.high - self.low) * i / 4 for i in range(5)]
        if self.integer:
            raw = [round(v) for v in raw]
        ticks: list[Tick] = []
        for value in raw:
            y = self.fraction(value)
            if y is not None and all(abs(y - t.y) > 0.07 for t in ticks):
                ticks.append(Tick(y, _label(value)))
        return ticks


class _Categories:
    def __init__(self, choices: list[Any]) -> None:
        self.choices = choices

    def fraction(self, value: Any) -> float | None:
        keys = [repr(c) for c in self.choices]
        index = keys.index(repr(value)) if repr(value) in keys else None
        if index is None:
            return None
        return 0.5 if len(self.choices) == 1 else index / (len(self.choices) - 1)

    def ticks(self) -> list[Tick]:
        every = max(1, math.ceil(len(self.choices) / 10))  # at most about ten labels
        return [Tick(self.fraction(c) or 0.0, _label(c)) for c in self.choices[::every]]


def _blend(t: float) -> str:
    """Light (worst) to dark blue (best)."""
    light, dark = (0xA5, 0xB9, 0xF2), (0x12, 0x2E, 0x9E)
    return "#" + "".join(f"{round(a + (b - a) * t):02x}" for a, b in zip(light, dark, strict=True))


def parallel_coordinates(study: schemas.StudyDetail) -> ParallelCoordinates | None:
    """An axis per parameter (categories evenly spaced, log parameters on a log axis) and per
    objective; a polyline per COMPLETE trial, coloured by its first objective, the best marked."""
    complete = [
        t
        for t in study.trials
        if t.state is schemas.TrialState.COMPLETE and t.values and all(_finite(v) is not None for v in t.values)
    ]
    if not complete:
        return None
    columns: list[tuple[str, str, _Scale | _Categories, list[Any]]] = []
    for name, param in study.spec.search_space.items():
        scale: _Scale | _Categories
        if isinstance(param, schemas.CategoricalParam):
            scale, kind = _Categories(param.choices), "categorical"
        else:
            integer = isinstance(param, schemas.IntParam)
            scale = _Scale(param.low, param.high, param.log, integer)
            kind = f"{'int' if integer else 'float'} {_label(param.low)} … {_label(param.high)}"
            kind += ", log scale" if param.log else ""
        columns.append((name, f"{name} ({kind})", scale, [t.params.get(name) for t in complete]))
    for i, objective in enumerate(study.spec.objectives):
        outcomes = [(t.values or [])[i] for t in complete]
        title = f"{objective.metric} ({objective.direction.value}, objective {i + 1})"
        columns.append((objective.metric, title, _Scale(min(outcomes), max(outcomes)), outcomes))

    span = (PC_WIDTH - 2 * PC_SIDE) / (len(columns) - 1)
    axes = [
        Axis(name, title, PC_SIDE + i * span, scale.ticks(), isinstance(scale, _Scale) and scale.log)
        for i, (name, title, scale, _) in enumerate(columns)
    ]
    fractions = [[scale.fraction(v) for v in values] for _, _, scale, values in columns]

    first = [(t.values or [])[0] for t in complete]
    low, high = min(first), max(first)
    minimise = study.spec.objectives[0].direction is schemas.Direction.MINIMIZE
    ranked: list[tuple[bool, float, Polyline]] = []
    for row, t in enumerate(complete):
        ys = [column[row] for column in fractions]
        if any(y is None for y in ys):
            continue  # a value off its axis (a configuration enqueued outside the space)
        points = " ".join(
            f"{axis.x:.1f},{PC_BOTTOM - (y or 0.0) * (PC_BOTTOM - PC_TOP):.1f}"
            for axis, y in zip(axes, ys, strict=True)
        )
        position = 0.5 if high == low else (first[row] - low) / (high - low)
        goodness = 1 - position if minimise else position
        params = ", ".join(f"{name}={_label(t.params.get(name))}" for name in study.spec.search_space)
        outcome = ", ".join(f"{v:.5g}" for v in t.values or [])
        title = f"trial {t.number}{' ★ best' if t.best else ''}: {outcome} · {params}"
        color = BEST_COLOR if t.best else _blend(goodness)
        ranked.append((t.best, goodness, Polyline(t.number, points, color, t.best, title)))
    ranked.sort(key=lambda item: (item[0], item[1]))  # the best last: drawn on top
    lines = [line for _, _, line in ranked]
    metric = study.spec.objectives[0].metric
    return ParallelCoordinates(PC_WIDTH, PC_HEIGHT, PC_TOP, PC_BOTTOM, axes, lines, metric, (low, high))


@dataclass(frozen=True)
class Importance:
    name: str
    share: float  # of the total, 0..1
    width: float  # of the longest bar, in percent


IMPORTANCE_METHOD = "ped_anova"  # the API's default: fANOVA is far slower on big studies
_importance_cache: dict[tuple[int, str], list[Importance]] = {}
_importance_lock = threading.Lock()


def importance_bars(
    study: schemas.StudyDetail, optuna_study: optuna.Study | None, max_trials: int
) -> tuple[list[Importance], str | None]:
    """The parameters by importance (Optuna's evaluator, as `GET /studies/{id}/importance`, from
    the newest `max_trials` COMPLETE trials), or why there are none. Remembered per set of
    COMPLETE trials: only they change the answer."""
    if study.spec.multi_objective:
        return [], "Parameter importance is computed for single-objective studies only."
    complete = [(t.number, t.values) for t in study.trials if t.state is schemas.TrialState.COMPLETE]
    if len(complete) < 2:
        return [], f"Parameter importance needs 2 COMPLETE trials; {len(complete)} so far."
    if optuna_study is None:
        return [], "Optuna has no record of this study."
    key = (study.id, repr(complete))
    with _importance_lock:
        cached = _importance_cache.get(key)
    if cached is not None:
        return cached, None
    from server import tuning

    try:
        values = tuning.importances(optuna_study, IMPORTANCE_METHOD, max_trials)
    except Exception as exc:  # Optuna's evaluators fail in many ways on odd studies; the page stays up
        log.warning("study %s: parameter importance failed", study.id, exc_info=True)
        return [], f"Parameter importance could not be computed ({type(exc).__name__}: {exc})."
    total = sum(values.values()) or 1.0
    top = max(values.values(), default=0.0) or 1.0
    bars = [Importance(name, value / total, 100 * value / top) for name, value in values.items()]
    bars.sort(key=lambda bar: -bar.share)
    with _importance_lock:
        if len(_importance_cache) >= 64:
            _importance_cache.pop(next(iter(_importance_cache)))
        _importance_cache[key] = bars
    return bars, None
