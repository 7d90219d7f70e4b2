"""Live views: a job's or a study's progress in the terminal until it ends (long-polled)."""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.live import Live
from rich.table import Table

from phalanx.cli.output import console, fmt_metrics, fmt_params, fmt_value
from phalanx.client import Client
from phalanx.schemas import JobDetail, JobState, Study, StudyDetail, StudyState


def follow(client: Client, job_id: int, on_tick: Callable[[], None] | None = None) -> JobDetail:
    """Show a job's state, step and latest metrics live until it ends; `on_tick` runs after every
    refresh (`phalanx demo` checks its processes there)."""
    started = time.monotonic()

    def render(job: JobDetail) -> Table:
        table = Table(title=f"job {job.id} · {job.name}", expand=False)
        for column in ("state", "attempt", "step", "metrics", "elapsed"):
            table.add_column(column)
        note = job.wait_reason if job.state is JobState.QUEUED else (job.failure_reason or "")
        table.add_row(
            job.state.value,
            str(job.attempts),
            "-" if job.latest_step is None else str(job.latest_step),
            fmt_metrics(job.latest_metrics),
            f"{time.monotonic() - started:.1f}s",
        )
        if note:
            table.caption = note
        return table

    job = client.get_job(job_id)
    with Live(render(job), console=console, refresh_per_second=4, transient=False) as live:
        while not job.state.is_terminal:
            # A long-poll: a state change shows at once, the step and metrics refresh every second.
            job = client.get_job_change(job_id, job.state, wait=1.0)
            live.update(render(job))
            if on_tick:
                on_tick()
    colour = "green" if job.state is JobState.COMPLETED else "red"
    console.print(
        f"job {job.id} [bold {colour}]{job.state.value}[/]" + (f": {job.failure_reason}" if job.failure_reason else "")
    )
    return job


def _counts(study: Study) -> str:
    return "  ".join(f"{state.lower()} {n}" for state, n in sorted(study.trial_counts.items())) or "no trials yet"


def trials_table(study: StudyDetail) -> Table:
    table = Table(title=f"study {study.id} · {study.name} · {study.state.value}", caption=_counts(study))
    for column in ("trial", "job", "state", "value", "best so far", "step", "params", "note"):
        table.add_column(column)
    for trial in study.trials:
        mark = " [bold green]★[/]" if trial.best else ""
        state = trial.state.value if trial.state.value != "RUNNING" else trial.job_state.value.lower()
        table.add_row(
            f"{trial.number}{mark}",
            str(trial.job_id),
            state,
            fmt_value(trial.values),
            "-" if trial.best_so_far is None else f"{trial.best_so_far:.5g}",
            "-" if trial.last_step is None else str(trial.last_step),
            fmt_params(trial.params),
            trial.reason or "",
        )
    return table


def follow_study(client: Client, study_id: int) -> StudyDetail:
    """The trials table, live (long-polled: it changes when a trial does) until the study ends."""
    study = client.get_study(study_id)
    with Live(trials_table(study), console=console, refresh_per_second=4) as live:
        while study.state is StudyState.RUNNING:
            study = client.get_study_change(study_id, study.version, wait=20.0)
            live.update(trials_table(study))
    colour = "green" if study.state is StudyState.COMPLETED else "red"
    console.print(
        f"study {study.id} [bold {colour}]{study.state.value}[/]" + (f": {study.reason}" if study.reason else "")
    )
    return study
