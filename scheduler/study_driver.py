"""The study driver: one pass advances one study through Optuna's ask/tell.

A pass runs under the study's lock (one driver per study at a time, however many scheduler
processes run) and re-reads everything, so it is idempotent and a killed driver loses nothing:

1. read the study and its trials from Phalanx's tables (`StudySnapshot`);
2. open the Optuna study, creating it with its enqueued configurations on the first pass;
3. adopt orphans: an Optuna trial asked for by a driver that died before its job was committed
   gets its job now (or is told FAIL once the study ended): no lost and no duplicate trials;
4. report the objective's new values of running trials as intermediate values (rank 0's, each
   step once: the steps a resumed attempt re-does were reported already) and prune the trials
   Optuna's pruner picks: their jobs end PRUNED at once and get SIGTERM (they may checkpoint);
5. tell Optuna how every trial whose job ended came out: COMPLETE with the objective's last
   value(s), PRUNED, or FAIL (crash, cancel, no objective reported, a final objective of NaN;
   Optuna's `fail_reason` says which). Phalanx's job lifecycle is the liveness source: Optuna's
   heartbeat does not cover ask/tell, and a trial whose job failed for good is told FAIL, never
   left RUNNING. A NaN intermediate value is reported as it is: Optuna's pruners judge it (the
   median, percentile and halving pruners prune a trial gone NaN);
6. `plan` (pure) decides: launch k trials, wait, or end the study (cancelling what still runs);
   the pass acts on it.

Optuna commits in its own transactions: no Phalanx transaction is open while Optuna is called.
"""

from __future__ import annotations

import fcntl
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState as OptunaState
from sqlalchemy import select, text
from sqlalchemy.orm import Session, sessionmaker

from phalanx.schemas import Direction, JobState, StudySpec, StudyState, TrialState
from server import jobs, studies, tuning
from server.db import engine_for
from server.models import Job, JobEvent, Metric, TuningStudy, TuningTrial, utcnow
from server.settings import Settings
from server.transitions import db_now, transition_study, transition_trial
from server.wakeups import note_study_change

log = logging.getLogger(__name__)
STUDY_LOCK_NAMESPACE = 0x7374  # "st": pg_try_advisory_xact_lock(namespace, study id)
LOCK_WAIT_S = 30.0


# --- state ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TrialSnapshot:
    row_id: int
    number: int
    optuna_trial_id: int
    job_id: int
    job_state: JobState
    job_failure: str | None
    state: TrialState
    values: tuple[float, ...] | None
    reported_step: int | None

    @property
    def active(self) -> bool:
        return not self.job_state.is_terminal

    @property
    def untold(self) -> bool:
        return self.state is TrialState.RUNNING and self.job_state.is_terminal

    @property
    def failed(self) -> bool:
        """Counts towards max_failed_trials: a user's cancel is not the configuration's fault."""
        return self.state is TrialState.FAIL and self.job_state is not JobState.CANCELLED


@dataclass(frozen=True, slots=True)
class StudySnapshot:
    id: int
    state: StudyState
    spec: StudySpec
    optuna_name: str
    running_seconds: float
    trials: tuple[TrialSnapshot, ...]

    @property
    def numbers(self) -> set[int]:
        return {t.number for t in self.trials}


@dataclass(frozen=True, slots=True)
class Plan:
    """What the policy decided: launch `launch` trials, or end the study as `end`."""

    launch: int = 0
    end: StudyState | None = None
    reason: str = ""
    cancel: bool = False  # with `end`: cancel the trials still in flight


# --- policy -----------------------------------------------------------------------------------


def target_reached(snapshot: StudySnapshot) -> TrialSnapshot | None:
    target = snapshot.spec.target_value
    if target is None or snapshot.spec.multi_objective:
        return None
    maximize = snapshot.spec.objectives[0].direction is Direction.MAXIMIZE
    for trial in snapshot.trials:
        if trial.state is TrialState.COMPLETE and trial.values:
            value = trial.values[0]
            if (value >= target) if maximize else (value <= target):
                return trial
    return None


def plan(snapshot: StudySnapshot) -> Plan:
    """Policy only (pure): what a RUNNING study does next."""
    if snapshot.state is not StudyState.RUNNING:
        return Plan()
    spec = snapshot.spec
    failed = sum(t.failed for t in snapshot.trials)
    if spec.max_failed_trials is not None and failed >= spec.max_failed_trials:
        return Plan(
            end=StudyState.FAILED,
            reason=f"{failed} trials failed (max_failed_trials is {spec.max_failed_trials})",
            cancel=True,
        )
    reached = target_reached(snapshot)
    if reached is not None and reached.values:
        return Plan(
            end=StudyState.COMPLETED,
            reason=f"trial {reached.number} reached the target value {spec.target_value:g} ({reached.values[0]:g})",
            cancel=True,
        )
    active = sum(t.active for t in snapshot.trials)
    left = spec.n_trials - len(snapshot.trials)
    timed_out = spec.timeout is not None and snapshot.running_seconds >= spec.timeout
    if left <= 0 or timed_out:
        if active or any(t.untold for t in snapshot.trials):
            return Plan()  # the last trials finish (and are told) first
        why = f"timeout of {spec.timeout:g} s reached" if timed_out and left > 0 else f"all {spec.n_trials} trials ran"
        return Plan(end=StudyState.COMPLETED, reason=why)
    return Plan(launch=max(0, min(left, spec.parallelism - active)))


# --- reading Phalanx's side -------------------------------------------------------------------


def read(session: Session, study_id: int) -> StudySnapshot | None:
    study = session.get(TuningStudy, study_id, populate_existing=True)
    if study is None:
        return None
    seconds = study.running_seconds
    if study.running_since is not None:
        now = session.execute(select(utcnow())).scalar_one()
        seconds += (now - study.running_since).total_seconds()
    rows = session.execute(
        select(TuningTrial, Job.state, Job.failure_reason)
        .join(Job, Job.id == TuningTrial.job_id)
        .where(TuningTrial.study_id == study_id)
        .order_by(TuningTrial.number)
        .execution_options(populate_existing=True)
    )
    trials = tuple(
        TrialSnapshot(
            row_id=trial.id,
            number=trial.number,
            optuna_trial_id=trial.optuna_trial_id,
            job_id=trial.job_id,
            job_state=JobState(job_state),
            job_failure=failure,
            state=TrialState(trial.state),
            values=tuple(trial.values) if trial.values is not None else None,
            reported_step=trial.reported_step,
        )
        for trial, job_state, failure in rows
    )
    spec = StudySpec.model_validate(study.spec)
    return StudySnapshot(study.id, StudyState(study.state), spec, study.optuna_name, seconds, trials)


def objective_points(session: Session, job_id: int, metric: str, after: int | None) -> list[tuple[int, float]]:
    """Rank 0's values of `metric` by step (the newest per step), not counting superseded attempts."""
    query = select(Metric.step, Metric.value).where(
        Metric.job_id == job_id, Metric.name == metric, Metric.rank == 0, Metric.superseded.is_(False)
    )
    if after is not None:
        query = query.where(Metric.step > after)
    points = {step: value for step, value in session.execute(query.order_by(Metric.step, Metric.id))}
    return sorted(points.items())


def final_value(session: Session, job_id: int, metric: str) -> float | None:
    """The last value the job reported for `metric` (rank 0 first), its re-done steps excluded."""
    return session.execute(
        select(Metric.value)
        .where(Metric.job_id == job_id, Metric.name == metric, Metric.superseded.is_(False))
        .order_by(Metric.rank, Metric.step.desc(), Metric.id.desc())
        .limit(1)
    ).scalar_one_or_none()


# --- the pass ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Driver:
    settings: Settings
    sessions: sessionmaker[Session]

    @property
    def url(self) -> str:
        return self.settings.database_url

    @property
    def storage(self) -> optuna.storages.RDBStorage:
        return tuning.storage(self.url)

    def snapshot(self, study_id: int) -> StudySnapshot | None:
        with self.sessions.begin() as session:
            return read(session, study_id)

    def advance(self, study_id: int) -> int:
        """One pass; returns how many trials it launched."""
        with study_lock(self.settings, study_id) as locked:
            if not locked:
                log.warning("study %s: another driver held its lock for %.0f s; skipping", study_id, LOCK_WAIT_S)
                return 0
            snapshot = self.snapshot(study_id)
            if snapshot is None:
                return 0
            # the first pass creates it (again, idempotently, if a driver died before its first trial)
            open_study = tuning.load if snapshot.trials else tuning.create
            study = open_study(self.url, snapshot.optuna_name, snapshot.spec)
            if self._adopt_orphans(study, snapshot):
                snapshot = self._must_read(study_id)
            self._report_and_prune(study, snapshot)
            self._tell_finished(study, self._must_read(study_id))
            snapshot = self._must_read(study_id)
            decision = plan(snapshot)
            if decision.end is not None:
                self._end(study, snapshot, decision)
            elif decision.launch:
                return self._launch(study, snapshot, decision.launch)
        return 0

    def _must_read(self, study_id: int) -> StudySnapshot:
        snapshot = self.snapshot(study_id)
        assert snapshot is not None, "a study is never deleted while its lock is held"
        return snapshot

    def _adopt_orphans(self, study: optuna.Study, snapshot: StudySnapshot) -> bool:
        """Trials Optuna has RUNNING with no job: a driver died between its ask and its commit."""
        orphans = [
            t
            for t in study.get_trials(deepcopy=False, states=(OptunaState.RUNNING,))
            if t.number not in snapshot.numbers
        ]
        for orphan in orphans:
            trial_id = orphan._trial_id  # Optuna has no public accessor; optuna-dashboard reads it too
            if snapshot.state.is_terminal:
                _fail(self.storage, trial_id, "the study ended before this trial's job was created")
                continue
            if snapshot.state is StudyState.STOPPED:
                continue  # adopted when the study resumes
            params = _complete_params(study, trial_id, tuning.distributions(snapshot.spec))
            with self.sessions.begin() as session:
                row = studies.get_study(session, snapshot.id, lock=True)
                trial = studies.create_trial(session, row, orphan.number, trial_id, params)
                job_id = trial.job_id
            self.storage.set_trial_user_attr(trial_id, tuning.JOB_ID_ATTR, job_id)
            log.info("study %s: adopted trial %s (its asker died): job %s", snapshot.id, orphan.number, job_id)
        return bool(orphans)

    def _report_and_prune(self, study: optuna.Study, snapshot: StudySnapshot) -> None:
        if snapshot.spec.multi_objective:
            return  # Optuna takes intermediate values (and prunes) for one objective only
        metric = snapshot.spec.objectives[0].metric
        pruning = snapshot.spec.pruner.type != "none"
        for trial in snapshot.trials:
            if trial.state is not TrialState.RUNNING:
                continue
            with self.sessions.begin() as session:
                points = objective_points(session, trial.job_id, metric, trial.reported_step)
            if not points:
                continue
            for step, value in points:
                self.storage.set_trial_intermediate_value(trial.optuna_trial_id, step, value)
            prune = pruning and study.pruner.prune(study, self.storage.get_trial(trial.optuna_trial_id))
            last_step, last_value = points[-1]
            reason = f"pruned by the {snapshot.spec.pruner.type} pruner at step {last_step} ({metric} {last_value:g})"
            with self.sessions.begin() as session:
                pruned = False
                if prune:  # the job row first: a trial job's own transitions lock it alone
                    job = jobs.get_job(session, trial.job_id, lock=True)
                    pruned = job.state == JobState.RUNNING.value  # else it ended (or restarts) meanwhile
                    if pruned:
                        jobs.prune_job(session, job, reason)
                row = session.get(TuningTrial, trial.row_id)
                assert row is not None
                row.reported_step = last_step
                if pruned:
                    row.reason = reason
                note_study_change(session, snapshot.id)

    def _tell_finished(self, study: optuna.Study, snapshot: StudySnapshot) -> None:
        for trial in snapshot.trials:
            if not trial.untold:
                continue
            state, values, reason = self._outcome(snapshot.spec, trial)
            if state is OptunaState.FAIL and reason:
                _fail_reason(self.storage, trial.optuna_trial_id, reason)
            frozen = study.tell(trial.number, values=values, state=state, skip_if_finished=True)
            with self.sessions.begin() as session:
                row = session.get(TuningTrial, trial.row_id)
                assert row is not None
                transition_trial(
                    session,
                    row,
                    TrialState(frozen.state.name),
                    values=list(frozen.values) if frozen.values is not None else None,
                    reason=reason or row.reason,  # a pruned trial keeps why it was pruned
                    ended_at=db_now(session),
                )

    def _outcome(self, spec: StudySpec, trial: TrialSnapshot) -> tuple[OptunaState, list[float] | None, str | None]:
        if trial.job_state is JobState.PRUNED:
            return OptunaState.PRUNED, None, None
        if trial.job_state is JobState.CANCELLED:
            with self.sessions.begin() as session:
                why = session.execute(
                    select(JobEvent.reason).where(JobEvent.job_id == trial.job_id).order_by(JobEvent.id.desc()).limit(1)
                ).scalar_one()
            return OptunaState.FAIL, None, f"its job was {why}"  # "cancelled by user", "cancelled: ..."
        if trial.job_state is JobState.FAILED:
            return OptunaState.FAIL, None, f"its job failed: {trial.job_failure or 'no reason recorded'}"
        with self.sessions.begin() as session:
            values = [final_value(session, trial.job_id, o.metric) for o in spec.objectives]
        missing = [o.metric for o, v in zip(spec.objectives, values, strict=True) if v is None]
        if missing:
            return OptunaState.FAIL, None, f"its job completed without reporting {', '.join(missing)}"
        # Optuna refuses to complete a trial with a NaN value (and ranks infinities as it should)
        undefined = [o.metric for o, v in zip(spec.objectives, values, strict=True) if v is not None and v != v]
        if undefined:
            return OptunaState.FAIL, None, f"its job's last {', '.join(undefined)} was NaN"
        return OptunaState.COMPLETE, [v for v in values if v is not None], None

    def _end(self, study: optuna.Study, snapshot: StudySnapshot, decision: Plan) -> None:
        """Cancel what still runs (if asked), tell Optuna every outcome, and only then end the
        study: whoever sees it ended sees every trial told. A driver that dies half-way leaves a
        RUNNING study whose next pass decides again."""
        assert decision.end is not None
        if decision.cancel:
            with self.sessions.begin() as session:
                row = studies.get_study(session, snapshot.id, lock=True)
                if row.state != StudyState.RUNNING.value:
                    return  # a user stopped it meanwhile; the next pass decides again
                studies.cancel_trials(session, row, decision.reason)
            self._tell_finished(study, self._must_read(snapshot.id))
        for leftover in study.get_trials(deepcopy=False, states=(OptunaState.WAITING, OptunaState.RUNNING)):
            if leftover.number not in snapshot.numbers:  # enqueued and never asked for, or an orphan
                _fail(self.storage, leftover._trial_id, f"the study ended: {decision.reason}")
        with self.sessions.begin() as session:
            row = studies.get_study(session, snapshot.id, lock=True)
            if row.state == StudyState.RUNNING.value:
                transition_study(session, row, decision.end, decision.reason)
        log.info("study %s %s: %s", snapshot.id, decision.end.value, decision.reason)

    def _launch(self, study: optuna.Study, snapshot: StudySnapshot, count: int) -> int:
        distributions = tuning.distributions(snapshot.spec)
        launched = 0
        for i in range(count):
            study.sampler = tuning.sampler(snapshot.spec, trial_number=len(snapshot.trials) + i)
            started = time.perf_counter()
            trial = study.ask(distributions)
            asked_s = time.perf_counter() - started
            with self.sessions.begin() as session:
                row = studies.get_study(session, snapshot.id, lock=True)
                if row.state != StudyState.RUNNING.value:
                    return launched  # stopped meanwhile: this trial is adopted when it resumes
                job_id = studies.create_trial(session, row, trial.number, trial._trial_id, trial.params).job_id
            self.storage.set_trial_user_attr(trial._trial_id, tuning.JOB_ID_ATTR, job_id)
            log.info("study %s: trial %s asked in %.3f s, job %s", snapshot.id, trial.number, asked_s, job_id)
            launched += 1
        return launched


def _complete_params(study: optuna.Study, trial_id: int, distributions: dict[str, BaseDistribution]) -> dict[str, Any]:
    """The trial's parameters, sampling those its asker did not get to (it died mid-ask)."""
    trial = optuna.trial.Trial(study, trial_id)
    for name, dist in distributions.items():
        if name in trial.params:
            continue
        if isinstance(dist, FloatDistribution):
            trial.suggest_float(name, dist.low, dist.high, step=dist.step, log=dist.log)
        elif isinstance(dist, IntDistribution):
            trial.suggest_int(name, dist.low, dist.high, step=dist.step, log=dist.log)
        elif isinstance(dist, CategoricalDistribution):
            trial.suggest_categorical(name, dist.choices)
    return dict(trial.params)


def _fail_reason(storage: optuna.storages.BaseStorage, trial_id: int, reason: str) -> None:
    with suppress(optuna.exceptions.UpdateFinishedTrialError):  # told already by a driver that then died
        storage.set_trial_system_attr(trial_id, tuning.FAIL_REASON_ATTR, reason)


def _fail(storage: optuna.storages.BaseStorage, trial_id: int, reason: str) -> None:
    _fail_reason(storage, trial_id, reason)
    with suppress(optuna.exceptions.UpdateFinishedTrialError):
        storage.set_trial_state_values(trial_id, OptunaState.FAIL)


# --- one driver per study ---------------------------------------------------------------------


@contextmanager
def study_lock(settings: Settings, study_id: int) -> Iterator[bool]:
    """Hold the study's lock (yields False if it could not be had within LOCK_WAIT_S). PostgreSQL:
    a transaction-scoped advisory lock on a connection of its own, whose transaction stays open
    for the pass and is rolled back after it (or by the database if this process dies). Never a
    session-level lock: behind PgBouncer in transaction mode the next transaction may run on
    another server connection, and the lock would stay with the first. SQLite (one machine): an
    flock on a file under the data dir."""
    if settings.is_sqlite:
        folder = settings.data_dir / "locks"
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"study-{study_id}.lock", "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield True
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)
        return
    with engine_for(settings.database_url).connect() as connection:
        key = {"ns": STUDY_LOCK_NAMESPACE, "id": study_id}
        deadline = time.monotonic() + LOCK_WAIT_S
        while not connection.execute(text("SELECT pg_try_advisory_xact_lock(:ns, :id)"), key).scalar_one():
            connection.rollback()
            if time.monotonic() > deadline:
                yield False
                return
            time.sleep(0.05)
        try:
            yield True
        finally:
            connection.rollback()  # ends the transaction, and with it the lock
