"""A training stand-in for lifecycle tests: it trains nothing, and its hyperparameters script it.

    steps         steps to run (default 20)
    step_seconds  sleep per step (default 0.1)
    exit_code     exit status after the last step (default 0)
    crash_rank    this rank exits with exit_code at crash_step, abruptly (default: none)
    crash_step
    crash_attempt only in this attempt (default: every attempt)
    crash_exit_code  the crash's status (default: exit_code)
    hang_rank     this rank sleeps forever at hang_step, deaf to SIGTERM like a rank stuck in
    hang_step     a collective: its peers notice at the process-group timeout (default: none)
    report        report {"step_value": step} every step (default true)
    x             also report loss = (x - 0.3)^2 + 1 / (step + 1) every step: an objective for
                  studies, best at x = 0.3 (default: none)
    checkpoint_every  save a checkpoint every N steps (default: never); a restarted attempt
    checkpoint_mb     resumes after the newest one. Its size in MiB (default 1).

Every step prints `step S rank R` and does one tiny all_reduce, so the ranks move in lock step.
That all_reduce also carries should_stop() (SIGTERM, or a superseded attempt): all ranks then
leave at the same step with status 143, as a process ended by SIGTERM would.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

import phalanx.train as pt

STOPPED_EXIT_CODE = 143  # 128 + SIGTERM


def main() -> int:
    ctx = pt.init()
    hp = ctx.hparams
    steps = int(hp.get("steps", 20))
    step_seconds = float(hp.get("step_seconds", 0.1))
    exit_code = int(hp.get("exit_code", 0))
    crash_rank = hp.get("crash_rank")
    crash_step = int(hp.get("crash_step", 0))
    crash_attempt = hp.get("crash_attempt")
    crash_exit_code = int(hp.get("crash_exit_code", exit_code))
    if crash_attempt is not None and int(crash_attempt) != ctx.attempt:
        crash_rank = None
    hang_rank = hp.get("hang_rank")
    hang_step = int(hp.get("hang_step", 0))
    report = bool(hp.get("report", True))
    x = hp.get("x")
    checkpoint_every = int(hp.get("checkpoint_every") or 0)
    checkpoint_mb = float(hp.get("checkpoint_mb", 1))
    start = 0
    if ctx.latest_checkpoint is not None:
        state = ctx.latest_checkpoint.load()
        assert state["blob"].numel() == int(checkpoint_mb * 2**18), "a checkpoint came back incomplete"
        start = state["step"] + 1
        print(f"rank {ctx.rank} resumed from the checkpoint of step {state['step']}", flush=True)
    print(
        f"workload rank {ctx.rank}/{ctx.world_size} job {ctx.job_id} allocation {ctx.allocation_id} "
        f"attempt {ctx.attempt} hparams {hp}",
        flush=True,
    )

    for step in range(start, steps):
        if crash_rank is not None and ctx.rank == int(crash_rank) and step == crash_step:
            print(f"rank {ctx.rank} crashing at step {step} with exit code {crash_exit_code}", flush=True)
            os._exit(crash_exit_code)  # like a real crash: no cleanup, no metrics flush
        if hang_rank is not None and ctx.rank == int(hang_rank) and step == hang_step:
            print(f"rank {ctx.rank} hanging at step {step}", flush=True)
            while True:
                time.sleep(3600)

        stop = torch.tensor([1.0 if ctx.should_stop() else 0.0])
        if ctx.world_size > 1:
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item() > 0:
            print(f"rank {ctx.rank} stopping at step {step}: asked to stop", flush=True)
            ctx.finish()
            return STOPPED_EXIT_CODE

        print(f"step {step} rank {ctx.rank}", flush=True)
        if report:
            values = {"step_value": step}
            if x is not None:
                values["loss"] = (float(x) - 0.3) ** 2 + 1 / (step + 1)
            ctx.report(values, step=step)
        if checkpoint_every and step % checkpoint_every == 0:
            blob = torch.full((int(checkpoint_mb * 2**18),), float(step))  # float32: 4 bytes each
            ctx.save_checkpoint({"step": step, "blob": blob}, step=step)
        time.sleep(step_seconds)

    ctx.finish()
    print(f"rank {ctx.rank} done after {steps} steps; exit code {exit_code}", flush=True)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
