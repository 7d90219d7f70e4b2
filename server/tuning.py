"""The bridge to Optuna: its storage in Phalanx's database, and a `StudySpec` as Optuna objects.

Contract: Optuna's tables live in the same database as Phalanx's (its RDBStorage, so that
optuna-dashboard pointed at PHALANX_DATABASE_URL shows the same trials). They are created by
`phalanx db upgrade` (`server.db.upgrade`), never by a worker: `storage()` only opens them, and
raises `SchemaOutOfDate` when they are missing. Optuna commits in its own transactions, so a caller
never holds a Phalanx write transaction while it calls Optuna (on SQLite that would deadlock).
Samplers are built per ask with a seed derived from the spec's and the trial's number: a pass
that restarts (or a scheduler that was killed) draws the same sequence instead of repeating the
first draw. Importing this module imports Optuna (≈0.4 s): only the server and the scheduler do.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.storages import RDBStorage

from phalanx import schemas
from server.db import check_optuna_schema, optuna_storage_options, sqlite_pragmas

log = logging.getLogger(__name__)
# Optuna's names of the objects it keeps per trial; optuna-dashboard shows both.
FAIL_REASON_ATTR = "fail_reason"
JOB_ID_ATTR = "phalanx_job_id"


_storages: dict[str, RDBStorage] = {}
_storages_lock = threading.Lock()


def storage(url: str) -> RDBStorage:
    """This process's Optuna storage on `url` (thread-safe: Optuna scopes a session per thread)."""
    with _storages_lock:
        if url not in _storages:
            check_optuna_schema(url)
            storage_url, engine_kwargs = optuna_storage_options(url)
            rdb = RDBStorage(storage_url, engine_kwargs=engine_kwargs, skip_table_creation=True)
            if url.startswith("sqlite"):
                # the same write-lock-first transactions as Phalanx's own engine, or two writers deadlock
                sqlite_pragmas(rdb.engine)
                rdb.engine.dispose()
            _storages[url] = rdb
        return _storages[url]


def dispose_storages() -> None:
    """Close every storage's connections (tests drop their databases; a process that ends)."""
    with _storages_lock:
        for rdb in _storages.values():
            rdb.engine.dispose()
        _storages.clear()


def distributions(spec: schemas.StudySpec) -> dict[str, BaseDistribution]:
    result: dict[str, BaseDistribution] = {}
    for name, param in spec.search_space.items():
        if isinstance(param, schemas.FloatParam):
            result[name] = FloatDistribution(param.low, param.high, log=param.log, step=param.step)
        elif isinstance(param, schemas.IntParam):
            result[name] = IntDistribution(param.low, param.high, log=param.log, step=param.step)
        else:
            result[name] = CategoricalDistribution(param.choices)
    return result


def directions(spec: schemas.StudySpec) -> list[optuna.study.StudyDirection]:
    return [optuna.study.StudyDirection[o.direction.name] for o in spec.objectives]


class AskTellGridSampler(optuna.samplers.GridSampler):
    """Optuna's grid sampler without its `study.stop()` once the grid is exhausted: that stops an
    `optimize()` loop and raises anywhere else (in a tell). A study's n_trials, which the spec
    caps at the grid's size, ends it instead."""

    def after_trial(self, *args: Any, **kwargs: Any) -> None:
        return None


def _seed(seed: int | None, trial_number: int) -> int | None:
    return None if seed is None else (seed * 1_000_003 + trial_number) % 2**32


def sampler(spec: schemas.StudySpec, trial_number: int = 0) -> optuna.samplers.BaseSampler:
    """The spec's sampler, seeded for the trial about to be asked for."""
    config = spec.sampler
    seed = _seed(config.seed, trial_number)
    if isinstance(config, schemas.TpeSampler):
        return optuna.samplers.TPESampler(
            seed=seed,
            n_startup_trials=config.n_startup_trials,
            multivariate=config.multivariate,
            constant_liar=config.constant_liar,
        )
    if isinstance(config, schemas.RandomSampler):
        return optuna.samplers.RandomSampler(seed=seed)
    if isinstance(config, schemas.GridSampler):
        return AskTellGridSampler(spec.grid(), seed=config.seed)  # its order: one seed for all trials
    if isinstance(config, schemas.CmaEsSampler):
        return optuna.samplers.CmaEsSampler(
            seed=seed, n_startup_trials=config.n_startup_trials, sigma0=config.sigma0, warn_independent_sampling=False
        )
    if isinstance(config, schemas.GpSampler):
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=config.n_startup_trials)
    return optuna.samplers.NSGAIISampler(seed=seed, population_size=config.population_size)


def pruner(spec: schemas.StudySpec) -> optuna.pruners.BasePruner:
    config = spec.pruner
    if isinstance(config, schemas.MedianPruner):
        return optuna.pruners.MedianPruner(config.n_startup_trials, config.n_warmup_steps, config.interval_steps)
    if isinstance(config, schemas.PercentilePruner):
        return optuna.pruners.PercentilePruner(
            config.percentile, config.n_startup_trials, config.n_warmup_steps, config.interval_steps
        )
    if isinstance(config, schemas.SuccessiveHalvingPruner):
        return optuna.pruners.SuccessiveHalvingPruner(
            config.min_resource, config.reduction_factor, config.min_early_stopping_rate
        )
    if isinstance(config, schemas.HyperbandPruner):
        return optuna.pruners.HyperbandPruner(config.min_resource, config.max_resource, config.reduction_factor)
    return optuna.pruners.NopPruner()


def load(url: str, optuna_name: str, spec: schemas.StudySpec) -> optuna.Study:
    return optuna.load_study(study_name=optuna_name, storage=storage(url), sampler=sampler(spec), pruner=pruner(spec))


def create(url: str, optuna_name: str, spec: schemas.StudySpec) -> optuna.Study:
    """Create the Optuna study with its enqueued configurations; idempotent (a driver that died
    half-way creates nothing twice: enqueued configurations already present are skipped)."""
    study = optuna.create_study(
        storage=storage(url),
        study_name=optuna_name,
        directions=directions(spec),
        sampler=sampler(spec),
        pruner=pruner(spec),
        load_if_exists=True,
    )
    for params in spec.enqueue:
        study.enqueue_trial(params, skip_if_exists=True)
    return study


IMPORTANCE_METHODS = ("ped_anova", "fanova")


def importances(study: optuna.Study, method: str, max_trials: int) -> dict[str, float]:
    """Parameter importance of a single-objective study (Optuna's evaluators), from its newest
    `max_trials` COMPLETE trials: fANOVA's forests grow with the trials, and a request computes
    this while its caller waits (the parameters are bounded by the spec already). Raises
    ValueError when there are too few complete trials."""
    evaluator: optuna.importance.BaseImportanceEvaluator
    if method == "fanova":
        evaluator = optuna.importance.FanovaImportanceEvaluator(seed=0)
    else:
        evaluator = optuna.importance.PedAnovaImportanceEvaluator()
    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    if len(complete) > max_trials:
        newest = optuna.create_study(directions=study.directions)  # in memory: a copy to evaluate
        newest.add_trials(sorted(complete, key=lambda t: t.number)[-max_trials:])
        study = newest
    return optuna.importance.get_param_importances(study, evaluator=evaluator)
