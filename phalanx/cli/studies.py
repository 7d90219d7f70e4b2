"""Hyperparameter studies: `studies create|list|show|best|stop|resume`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from phalanx.cli.live import follow_study, trials_table
from phalanx.cli.output import JsonOpt, api, console, fail, fmt_params, fmt_value, jsonable, print_json
from phalanx.client import SpecError, load_study_file
from phalanx.schemas import Study, StudyState

app = typer.Typer(help="Hyperparameter studies: Optuna drives the trials, each one a job.", no_args_is_help=True)


@app.command("create")
def studies_create(
    file: Annotated[Path, typer.Argument(help="A study file (YAML).")],
    wait: Annotated[bool, typer.Option("--wait", help="Follow the trials and exit with the outcome.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Create a study; its trials' workdir is uploaded with it."""
    with api() as client:
        try:
            spec, workdir = load_study_file(file)
        except SpecError as exc:
            fail(str(exc), 2)
        study = client.create_study(spec, workdir)
        if as_json and not wait:
            print_json({"id": study.id, "name": study.name, "state": study.state.value})
            return
        if not as_json:
            console.print(f"created study [bold]{study.id}[/] ({study.name}); `phalanx studies show {study.id}`")
        if wait:
            final = client.wait_study(study.id) if as_json else follow_study(client, study.id)
            if as_json:
                print_json({"id": final.id, "name": final.name, "state": final.state.value, "reason": final.reason})
            raise typer.Exit(0 if final.state is StudyState.COMPLETED else 1)


@app.command("list")
def studies_list(
    state: Annotated[StudyState | None, typer.Option(help="Only studies in this state.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """List studies, newest first."""
    with api() as client:
        rows = client.list_studies(state.value if state else None)
    if as_json:
        print_json(rows)
        return
    table = Table()
    for column in ("id", "name", "state", "owner", "trials", "best", "objective", "note"):
        table.add_column(column)
    for study in rows:
        objective = ", ".join(f"{o.direction.value} {o.metric}" for o in study.spec.objectives)
        best = "-" if study.best_trial is None else f"{fmt_value(study.best_values)} (trial {study.best_trial})"
        done = sum(study.trial_counts.values())
        table.add_row(
            str(study.id),
            study.name,
            study.state.value,
            f"{study.owner} ({study.team})" if study.team else study.owner,
            f"{done}/{study.spec.n_trials}",
            best,
            objective,
            study.reason or "",
        )
    console.print(table)


@app.command("show")
def studies_show(study_id: int, as_json: JsonOpt = False) -> None:
    """A study's trials (best marked ★), its best value so far and each parameter's importance."""
    with api() as client:
        study = client.get_study(study_id)
        importance = None
        if not study.spec.multi_objective:
            importance = client.param_importances(study_id)
    if as_json:
        print_json({**jsonable(study), "importance": jsonable(importance) if importance else None})
        return
    objective = ", ".join(f"{o.direction.value} {o.metric}" for o in study.spec.objectives)
    console.print(f"[bold]study {study.id}[/] {study.name}  state [bold]{study.state.value}[/]  {objective}")
    if study.reason:
        console.print(f"reason: {study.reason}")
    console.print(f"optuna study: {study.optuna_study_name} (optuna-dashboard <PHALANX_DATABASE_URL> shows it)")
    console.print(trials_table(study))
    if importance is not None:
        if importance.importances:
            shares = "  ".join(f"{name} {share:.2f}" for name, share in importance.importances.items())
            console.print(f"parameter importance ({importance.method}): {shares}")
        elif importance.note:
            console.print(f"parameter importance: {importance.note}")


@app.command("best")
def studies_best(study_id: int, as_json: JsonOpt = False) -> None:
    """The best trial (every trial on the Pareto front for several objectives)."""
    with api() as client:
        best = client.best_trials(study_id)
    if as_json:
        print_json(best)
        return
    for trial in best.trials:
        console.print(
            f"trial {trial.number} (job {trial.job_id}): {fmt_value(trial.values)}  {fmt_params(trial.params)}"
        )


@app.command("stop")
def studies_stop(study_id: int, as_json: JsonOpt = False) -> None:
    """Start no more trials; the running ones checkpoint and pause until `studies resume`."""
    with api() as client:
        _print_study_state(client.stop_study(study_id), as_json)


@app.command("resume")
def studies_resume(study_id: int, as_json: JsonOpt = False) -> None:
    """Resume the paused trials from their checkpoints and go on to n_trials."""
    with api() as client:
        _print_study_state(client.resume_study(study_id), as_json)


def _print_study_state(study: Study, as_json: bool) -> None:
    if as_json:
        print_json({"id": study.id, "state": study.state.value})
    else:
        console.print(f"study {study.id} {study.state.value}")
