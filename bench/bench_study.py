"""Hyperparameter studies: what Phalanx adds to Optuna, and what pruning buys.

    python bench/bench_study.py [--trials 20] [--efficiency-trials 16] [--skip-efficiency | --efficiency-only]

1. Study overhead. The same 20-trial study (TPE, seed 0, constant liar, parallelism 2) over the
   scripted workload (x in [0, 1], 10 steps of 50 ms, loss = (x - 0.3)^2 + 1/10) twice in this
   run: through Phalanx (every trial a job on one of two 1-slot agents, PostgreSQL + Redis) and
   as `study.optimize(n_jobs=2)` in this process, whose objective runs the same script under a
   plain `torchrun --nproc-per-node 1` (a subprocess per trial, so both sides pay a process start
   per trial). Figure: wall time Phalanx / Optuna, goal <= 1.3. Shown beside it: each side's
   median per-trial time, the job start cost that dominates.
2. Ask -> trial RUNNING. For every trial that waited for a free place: from the end of the trial
   whose place it took (its job's end, database clock) to its own job RUNNING (torchrun started),
   i.e. the driver's tell + ask + job creation + placement + the agent's launch; against the same
   stack's submit -> RUNNING of plain jobs of that script (placement + launch). Figure: median
   turnaround - median job start, goal <= 0.5 s.
3. Sample efficiency (Optuna's, shown as the issue asks): the digits example's study file, TPE +
   median pruning vs random sampling without pruning, the same number of trials (5 epochs each,
   seeds 0 and 1); the best val_accuracy after N trials, and the wall time each took. Also how soon a pruned trial's job
   ended PRUNED after rank 0 reported the value it was pruned on (the report interval is 1 s).

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import optuna

from bench._common import REPO, RunningStack, free_port, log, median, postgres_stack, wait_quiet, without_phalanx_env
from phalanx.client import load_job_file, load_study_file
from phalanx.schemas import JobDetail, JobSpec, JobState, StudyDetail, StudySpec

SCRIPTED = REPO / "examples" / "scripted" / "job.yaml"
DIGITS_STUDY = REPO / "examples" / "digits" / "study.yaml"
GOAL_RATIO = 1.3
GOAL_ASK_TO_RUNNING_S = 0.5
STEPS, STEP_SECONDS, SEED, PARALLELISM = 10, 0.05, 0, 2


def scripted_trial() -> tuple[dict[str, Any], Path]:
    job, workdir = load_job_file(SCRIPTED)
    trial = job.model_dump(mode="json", exclude={"name"})
    trial["resources"] = {"nodes": 1, "slots_per_node": 1}
    trial["hyperparameters"] = {"steps": STEPS, "step_seconds": STEP_SECONDS}
    return trial, workdir


def overhead_spec(n_trials: int) -> tuple[StudySpec, Path]:
    trial, workdir = scripted_trial()
    spec = StudySpec.model_validate(
        {
            "name": "bench-overhead",
            "objective": {"metric": "loss", "direction": "minimize"},
            "search_space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            "sampler": {"type": "tpe", "seed": SEED},
            "n_trials": n_trials,
            "parallelism": PARALLELISM,
            "trial": trial,
        }
    )
    return spec, workdir


def run_optuna_in_process(n_trials: int) -> dict[str, Any]:
    """`study.optimize` with the same sampler; each trial runs the script under plain torchrun."""
    _, workdir = scripted_trial()
    env = {**without_phalanx_env(), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    durations: list[float] = []
    lock = threading.Lock()

    def objective(trial: optuna.Trial) -> float:
        x = trial.suggest_float("x", 0.0, 1.0)
        hparams = {"steps": STEPS, "step_seconds": STEP_SECONDS, "x": x}
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=1",
            "--nproc-per-node=1",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
            "--rdzv-backend=static",
            "--max-restarts=0",
            "workload.py",
        ]
        started = time.perf_counter()
        with tempfile.TemporaryFile() as out:
            done = subprocess.run(
                argv, cwd=workdir, env={**env, "PHALANX_HPARAMS": json.dumps(hparams)}, stdout=out, stderr=out
            )
            if done.returncode:
                out.seek(0)
                raise RuntimeError(f"the trial script exited with {done.returncode}: {out.read()[-2000:]!r}")
        with lock:
            durations.append(time.perf_counter() - started)
        return (x - 0.3) ** 2 + 1 / STEPS  # the loss the script reports at its last step

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(seed=SEED, constant_liar=True)
    study = optuna.create_study(direction="minimize", sampler=sampler)
    started = time.perf_counter()
    study.optimize(objective, n_trials=n_trials, n_jobs=PARALLELISM)
    return {
        "wall_s": time.perf_counter() - started,
        "trial_median_s": median(durations),
        "best_value": study.best_value,
    }


def running_at(job: JobDetail) -> float:
    times = [e.time for e in job.events if e.to_state is JobState.RUNNING]
    return times[0].timestamp()


def ask_to_running(running: RunningStack, study: StudyDetail) -> list[float]:
    """For each trial that took a finished trial's place: that trial's end -> its own RUNNING."""
    jobs = {t.number: running.client.get_job(t.job_id) for t in study.trials}
    turnarounds = []
    for number, job in jobs.items():
        before = [
            j.ended_at.timestamp()
            for n, j in jobs.items()
            if n != number and j.ended_at is not None and j.ended_at <= job.submitted_at
        ]
        if number >= study.spec.parallelism and before:
            turnarounds.append(running_at(job) - max(before))
    return turnarounds


def plain_job_starts(running: RunningStack, count: int) -> list[float]:
    """submit -> RUNNING (database clock) of ordinary jobs of the same script, one at a time."""
    spec, workdir = load_job_file(SCRIPTED)
    trial, _ = scripted_trial()
    spec = JobSpec.model_validate(
        {**trial, "name": "bench-plain", "hyperparameters": {**trial["hyperparameters"], "x": 0.5}}
    )
    starts = []
    for _ in range(count):
        wait_quiet(running.pids)
        job = running.client.submit(spec, workdir)
        done = running.client.wait(job.id, timeout=120)
        starts.append(running_at(done) - done.submitted_at.timestamp())
    return starts


def run_phalanx_study(
    running: RunningStack, spec: StudySpec, workdir: Path, timeout: float = 900
) -> tuple[StudyDetail, float]:
    wait_quiet(running.pids)
    started = time.perf_counter()
    created = running.client.create_study(spec, workdir)
    study = running.client.wait_study(created.id, timeout=timeout)
    wall = time.perf_counter() - started
    if study.state.value != "COMPLETED":
        raise RuntimeError(f"study {study.id} ended {study.state.value}: {study.reason}")
    return study, wall


def trial_seconds(running: RunningStack, study: StudyDetail) -> list[float]:
    spans = []
    for trial in study.trials:
        job = running.client.get_job(trial.job_id)
        assert job.ended_at is not None
        spans.append((job.ended_at - job.submitted_at).total_seconds())
    return spans


def prune_latencies(running: RunningStack, study: StudyDetail) -> list[float]:
    """For each pruned trial: from rank 0's report of the step it was pruned at (the rank's clock)
    to its job's PRUNED (the database's; one machine, one clock)."""
    metric = study.spec.objectives[0].metric
    latencies = []
    for trial in study.trials:
        if trial.state.value != "PRUNED" or trial.last_step is None:
            continue
        job = running.client.get_job(trial.job_id)
        pruned_at = next(e.time for e in job.events if e.to_state is JobState.PRUNED)
        reported = [
            p.time
            for p in running.client.metrics(trial.job_id, name=metric)
            if p.rank == 0 and p.step == trial.last_step
        ]
        if reported:
            latencies.append((pruned_at - reported[0]).total_seconds())
    return latencies


EFFICIENCY_EPOCHS = 5  # short trainings: the hyperparameters matter more than with 30 epochs


def efficiency(running: RunningStack, n_trials: int, seeds: tuple[int, ...] = (0, 1)) -> dict[str, Any]:
    """TPE + median pruning vs random without pruning, `n_trials` each, one study per seed."""
    spec, workdir = load_study_file(DIGITS_STUDY)
    trial = spec.trial.model_copy(update={"entrypoint": f"python train.py --epochs {EFFICIENCY_EPOCHS}"})
    base = {**spec.model_dump(mode="json"), "n_trials": n_trials, "trial": trial.model_dump(mode="json")}
    variants = {
        "tpe_median_pruning": lambda seed: {"sampler": {"type": "tpe", "seed": seed, "n_startup_trials": 4}},
        "random_no_pruning": lambda seed: {"sampler": {"type": "random", "seed": seed}, "pruner": {"type": "none"}},
    }
    results: dict[str, Any] = {}
    for name, overrides in variants.items():
        runs = []
        for seed in seeds:
            variant = StudySpec.model_validate({**base, **overrides(seed), "name": f"bench-{name[:6]}-{seed}"})
            study, wall = run_phalanx_study(running, variant, workdir)
            latencies = prune_latencies(running, study)
            runs.append(
                {
                    "seed": seed,
                    "best_value": study.best_values[0] if study.best_values else None,
                    "best_so_far": [t.best_so_far for t in study.trials],
                    "pruned": study.trial_counts.get("PRUNED", 0),
                    "wall_s": round(wall, 1),
                    "prune_latency_runs": [round(x, 3) for x in latencies],
                }
            )
            log(f"{name} seed {seed}: best {runs[-1]['best_value']} in {wall:.0f} s, pruned {runs[-1]['pruned']}")
        bests = [r["best_value"] for r in runs if r["best_value"] is not None]
        latencies = [x for r in runs for x in r["prune_latency_runs"]]
        results[name] = {
            "mean_best_value": round(sum(bests) / len(bests), 4) if bests else None,
            "mean_wall_s": round(sum(r["wall_s"] for r in runs) / len(runs), 1),
            "prune_latency_median_s": round(median(latencies), 3) if latencies else None,
            "runs": runs,
        }
    return results


def run_efficiency_only(efficiency_trials: int) -> dict[str, Any]:
    with postgres_stack() as running:
        return {"bench": "study_efficiency", "efficiency": efficiency(running, efficiency_trials), "ok": True}


def run(n_trials: int, efficiency_trials: int, skip_efficiency: bool) -> dict[str, Any]:
    log(f"optuna in process: {n_trials} trials, parallelism {PARALLELISM}")
    baseline = run_optuna_in_process(n_trials)
    log(f"optuna in process: {baseline['wall_s']:.1f} s")
    with postgres_stack() as running:
        spec, workdir = overhead_spec(n_trials)
        study, wall = run_phalanx_study(running, spec, workdir)
        log(f"phalanx: {wall:.1f} s")
        # a second baseline after the stack's run: the machine's load may have drifted meanwhile
        baseline_after = run_optuna_in_process(n_trials)
        log(f"optuna in process again: {baseline_after['wall_s']:.1f} s")
        turnarounds = ask_to_running(running, study)
        starts = plain_job_starts(running, 5)
        spans = trial_seconds(running, study)
        effect = None if skip_efficiency else efficiency(running, efficiency_trials)
    optuna_wall = median([baseline["wall_s"], baseline_after["wall_s"]])
    ratio = wall / optuna_wall
    added = median(turnarounds) - median(starts)
    return {
        "bench": "study",
        "trials": n_trials,
        "parallelism": PARALLELISM,
        "ratio": round(ratio, 3),
        "goal_ratio": GOAL_RATIO,
        "phalanx_wall_s": round(wall, 2),
        "optuna_wall_s": [round(baseline["wall_s"], 2), round(baseline_after["wall_s"], 2)],
        "phalanx_trial_median_s": round(median(spans), 2),
        "optuna_trial_median_s": round(median([baseline["trial_median_s"], baseline_after["trial_median_s"]]), 2),
        "best_value": {"phalanx": study.best_values, "optuna": [baseline["best_value"], baseline_after["best_value"]]},
        "ask_to_running_median_s": round(median(turnarounds), 3),
        "job_start_median_s": round(median(starts), 3),
        "ask_to_running_added_s": round(added, 3),
        "goal_added_s": GOAL_ASK_TO_RUNNING_S,
        "ask_to_running_runs": [round(t, 3) for t in turnarounds],
        "job_start_runs": [round(s, 3) for s in starts],
        "efficiency": effect,
        "ok": ratio <= GOAL_RATIO and added <= GOAL_ASK_TO_RUNNING_S,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--efficiency-trials", type=int, default=16)
    parser.add_argument("--skip-efficiency", action="store_true")
    parser.add_argument("--efficiency-only", action="store_true", help="part 3 alone (no goal)")
    args = parser.parse_args(argv)
    if args.efficiency_only:
        report = run_efficiency_only(args.efficiency_trials)
    else:
        report = run(args.trials, args.efficiency_trials, args.skip_efficiency)
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
