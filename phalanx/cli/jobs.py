"""Jobs: `submit`, `jobs list|show|scaling|profile|logs|kill|pause|resume`, and a job's `checkpoints`
(`jobs hold|release` are in `phalanx.cli.sharing`)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from phalanx.cli.live import follow
from phalanx.cli.output import JsonOpt, api, console, fail, fmt_metrics, print_json
from phalanx.client import SpecError
from phalanx.schemas import (
    Communication,
    JobDetail,
    JobState,
    JobView,
    ProfileView,
    QueuePlace,
    ScalingRunView,
    ScalingState,
)

app = typer.Typer(help="Inspect and control jobs.", no_args_is_help=True)
checkpoints_app = typer.Typer(help="A job's committed checkpoints.", no_args_is_help=True)


def submit(
    file: Annotated[Path, typer.Argument(help="A job file (YAML).")],
    wait: Annotated[bool, typer.Option("--wait", help="Follow the job and exit with its outcome.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Submit a job file; its workdir is uploaded with it."""
    with api() as client:
        try:
            job = client.submit_file(file)
        except SpecError as exc:
            fail(str(exc), 2)
        if as_json and not wait:
            print_json({"id": job.id, "name": job.name, "state": job.state.value, "team": job.team})
            return
        if not as_json:
            console.print(f"submitted job [bold]{job.id}[/] ({job.name}); `phalanx jobs show {job.id}` for details")
        if wait:
            final = client.wait(job.id) if as_json else follow(client, job.id)
            if as_json:
                print_json({"id": final.id, "name": final.name, "state": final.state.value, "team": final.team})
            raise typer.Exit(0 if final.state is JobState.COMPLETED else 1)


def restart_budgets(job: JobView) -> str:
    """Used/allowed restarts: the job's own failures, then lost infrastructure (its own budget)."""
    return f"{job.restarts_used}/{job.spec.max_restarts} infra {job.infra_restarts_used}/{job.spec.max_infra_restarts}"


@app.command("list")
def jobs_list(
    state: Annotated[JobState | None, typer.Option(help="Only jobs in this state.")] = None,
    limit: Annotated[int, typer.Option(help="At most this many.")] = 50,
    before: Annotated[
        int | None, typer.Option(help="Only jobs older than this job id (the next page; the table ends with it).")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """List jobs, newest first, a page of `--limit` at a time (`--before` for the next)."""
    with api() as client:
        jobs, following = client.jobs_page(state.value if state else None, limit, before)
    if as_json:
        print_json(jobs)
        return
    table = Table()
    for column in ("id", "name", "state", "owner", "nodes x slots", "restarts", "step", "metrics", "note"):
        table.add_column(column)
    for job in jobs:
        res = job.spec.resources
        note = job.wait_reason if job.state is JobState.QUEUED else (job.failure_reason or "")
        if job.queue is not None:
            note = describe_place(job.queue)
        table.add_row(
            str(job.id),
            job.name,
            job.state.value,
            f"{job.owner} ({job.team})" if job.team else job.owner,
            f"{res.nodes}x{res.slots_per_node} {res.slot_type.value}",
            restart_budgets(job),
            "-" if job.latest_step is None else str(job.latest_step),
            fmt_metrics(job.latest_metrics),
            note or "",
        )
    console.print(table)
    if following is not None:
        more = (f" --state {state.value}" if state else "") + (f" --limit {limit}" if limit != 50 else "")
        console.print(f"older jobs: phalanx jobs list --before {following}{more}")


def describe_runtime_env(job: JobDetail) -> str:
    """What the job asked for, and what it resolved to (exact versions; hashes are in --json)."""
    env = job.spec.runtime_env
    assert env is not None
    asked = " ".join([*env.pip, *([f"-r {env.requirements}"] if env.requirements else [])])
    if job.env_lock is None:
        return f"{asked} (not resolved yet: node rank 0 resolves it at the first start)"
    pins = [line.split()[0] for line in job.env_lock.splitlines() if line and not line[0].isspace() and "==" in line]
    return f"{asked} -> {' '.join(pins)} (build log: `phalanx jobs logs {job.id}`, lines [setup])"


def print_communication(comm: Communication) -> None:
    """Where the ranks' step time goes, and what to try when communication dominates."""
    console.print(
        f"communication: step {comm.step_time_s * 1000:.1f} ms, {comm.comm_fraction:.0%} of it waiting for the "
        f"all-reduce; {comm.bytes_per_step / 2**20:.2f} MiB per step per rank; slowest rank {comm.slowest_rank} "
        f"({comm.straggler_ratio:.2f}x the median rank's own work)"
    )
    table = Table()
    for column in ("rank", "step ms", "data", "compute", "exposed comm", "other", "MiB/step"):
        table.add_column(column, justify="right")
    for rank in comm.ranks:
        table.add_row(
            str(rank.rank),
            f"{rank.step_time_s * 1000:.1f}",
            *(
                f"{part * 1000:.1f}"
                for part in (rank.data_time_s, rank.compute_time_s, rank.comm_exposed_s, rank.other_s)
            ),
            f"{rank.bytes_per_step / 2**20:.2f}",
        )
    console.print(table)
    if comm.comm_fraction > 0.3:
        console.print(
            "communication dominates: try larger buckets (ddp.bucket_cap_mb), compression (ddp.comm_hook: bf16 "
            "or powersgd), gradient accumulation, or fewer nodes (README: Reading the communication figures)"
        )


@app.command("show")
def jobs_show(job_id: int, as_json: JsonOpt = False) -> None:
    """A job's state, why it waits or failed, latest metrics, attempts and events."""
    with api() as client:
        job = client.get_job(job_id)
    if as_json:
        print_json(job)
        return
    team = f"  team {job.team}" if job.team else ""
    console.print(f"[bold]job {job.id}[/] {job.name}  state [bold]{job.state.value}[/]  owner {job.owner}{team}")
    console.print(f"restarts used: {restart_budgets(job)}")
    if job.held:
        console.print("[yellow]held by an admin[/]: it waits until released (`phalanx jobs release`)")
    if job.queue is not None:
        console.print(f"in line: {describe_place(job.queue)}")
        console.print(f"estimate: {job.queue.estimate}")
    elif job.state is JobState.QUEUED and job.wait_reason:
        console.print(f"waiting: {job.wait_reason}")
    if job.failure_reason:
        console.print(f"[red]failed:[/] {job.failure_reason}")
    if job.spec.runtime_env is not None:
        console.print(f"runtime env: {describe_runtime_env(job)}", markup=False, highlight=False)
    if job.spec.launcher != "torchrun":
        console.print(f"launcher: {job.spec.launcher} (the entrypoint once per slot, no torchrun)")
    if job.latest_metrics:
        console.print(f"step {job.latest_step}: {fmt_metrics(job.latest_metrics)}")
    if job.communication is not None:
        print_communication(job.communication)
    for allocation in job.allocations:
        nodes = ", ".join(
            f"node {n.node_rank}@{n.agent_name} {n.state.value}"
            + ("" if n.exit_code is None else f" exit {n.exit_code}")
            for n in allocation.nodes
        )
        port = allocation.master_port or "-"
        console.print(f"attempt {allocation.attempt}: master {allocation.master_addr}:{port}  {nodes}")
    table = Table(title="events")
    for column in ("time", "from", "to", "reason"):
        table.add_column(column)
    for event in job.events:
        table.add_row(
            str(event.time),
            event.from_state.value if event.from_state else "",
            event.to_state.value,
            event.reason,
        )
    console.print(table)


@app.command("scaling")
def jobs_scaling(
    file: Annotated[Path, typer.Argument(help="A job file (YAML) whose script reports a metric every step.")],
    nodes: Annotated[str, typer.Option(help="The sizes to run, in nodes: 1,2,4.")] = "1,2",
    steps: Annotated[int, typer.Option(help="Steps measured at each size, after the warm-up.")] = 100,
    warmup: Annotated[int, typer.Option(help="Steps left out of the rate at the start of each run.")] = 10,
    as_json: JsonOpt = False,
) -> None:
    """Run a job at several sizes for a bounded number of steps each (on the server, one size after
    another, smallest first): throughput, scaling efficiency and the communication share at each."""
    from phalanx.client import load_job_file

    try:
        sizes = [int(part) for part in nodes.split(",") if part.strip()]
        spec, workdir = load_job_file(file)
    except ValueError as exc:
        fail(f"--nodes {nodes!r}: give sizes such as 1,2,4 ({exc})", 2)
    except SpecError as exc:
        fail(str(exc), 2)

    def progress(run: ScalingRunView) -> None:
        if not as_json and run.measuring is not None:
            done = ", ".join(f"{p.nodes}: {p.steps_per_second:.2f} steps/s" for p in run.points)
            job = run.job_ids[-1] if run.job_ids else "-"
            console.print(f"measuring {run.measuring} node(s) (job {job}){'; ' + done if done else ''}")

    with api() as client:
        run = client.start_scaling(spec, workdir, sizes, steps=steps, warmup=warmup)
        if not as_json:
            console.print(f"scaling run {run.id}: sizes {', '.join(map(str, run.nodes))}, one after another")
        progress(run)
        run = client.wait_scaling(run.id, progress=progress)
    if run.state is not ScalingState.COMPLETED:
        fail(f"scaling run {run.id} {run.state.value}: {run.reason}", 1)
    points = run.points
    if as_json:
        print_json(points)
        return
    table = Table(title=f"scaling of {spec.name}: {steps} steps after {warmup} of warm-up at each size")
    for column in ("nodes", "ranks", "steps/s", "throughput", "efficiency", "", "comm share", "MiB/step", "job"):
        table.add_column(column, justify="right" if column else "left")
    for point in points:
        bar = "#" * round(20 * min(point.efficiency, 1.5))
        table.add_row(
            str(point.nodes),
            str(point.world_size),
            f"{point.steps_per_second:.2f}",
            f"{point.throughput:.2f}",
            f"{point.efficiency:.0%}",
            bar,
            "-" if point.comm_fraction is None else f"{point.comm_fraction:.0%}",
            "-" if point.bytes_per_step is None else f"{point.bytes_per_step / 2**20:.2f}",
            str(point.job_id),
        )
    console.print(table)
    console.print(
        "throughput: steps/s x ranks (per-rank batches a second); efficiency: against linear from the smallest size"
    )


def print_profile(profile: ProfileView) -> None:
    """A profile's state and each rank's breakdown (per step, ms)."""
    console.print(
        f"profile {profile.id} of job {profile.job_id}: {profile.steps} steps on {profile.world_size} ranks "
        f"(attempt {profile.attempt}), [bold]{profile.state}[/], {len(profile.ranks)} of {profile.world_size} "
        "ranks answered"
    )
    if profile.step_time_s is not None and profile.comm_fraction is not None:
        console.print(
            f"median step {profile.step_time_s * 1000:.1f} ms, {profile.comm_fraction:.0%} of it waiting for "
            f"communication; slowest rank {profile.slowest_rank}"
        )
    table = Table()
    for column in ("rank", "device", "steps", "step ms", "compute", "comm", "overlap", "exposed comm", "idle", "trace"):
        table.add_column(column, justify="right")
    for rank in profile.ranks:
        s = rank.summary
        if s is None:
            table.add_row(str(rank.rank), *[""] * 8, f"none: {rank.error}")
            continue
        parts = (s.step_time_s, s.compute_s, s.comm_s, s.overlap_s, s.exposed_comm_s, s.idle_s)
        table.add_row(
            str(rank.rank),
            s.device,
            str(s.steps),
            *(f"{part * 1000:.1f}" for part in parts),
            f"{rank.size_bytes / 1024:.0f} KiB",
        )
    console.print(table)


@app.command("profile")
def jobs_profile(
    job_id: int,
    steps: Annotated[int, typer.Option(help="Optimizer steps to record on every rank (1-200).")] = 20,
    show: Annotated[
        int | None, typer.Option("--show", help="Show profile N of the job (and wait for it) instead of a new one.")
    ] = None,
    download: Annotated[
        Path | None, typer.Option(help="Write every rank's trace (.json.gz: Perfetto opens it) into this folder.")
    ] = None,
    delete: Annotated[int | None, typer.Option("--delete", help="Delete profile N of the job and its traces.")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the ranks' traces.")] = 600.0,
    as_json: JsonOpt = False,
) -> None:
    """Record torch.profiler traces of the next STEPS steps on every rank of a running job, wait
    for them, and show where each rank's steps went (compute, communication, overlap, idle)."""
    with api() as client:
        if delete is not None:
            client.delete_profile(job_id, delete)
            if as_json:
                print_json({"deleted": delete})
            else:
                console.print(f"profile {delete} of job {job_id} deleted")
            return
        if show is None:
            profile = client.request_profile(job_id, steps)
            if not as_json:
                console.print(
                    f"profile {profile.id}: each rank records its next {steps} steps once it hears of it (with its "
                    "next metric batch, every few seconds for models prepared with ctx.prepare_model)"
                )
        else:
            profile = client.get_profile(job_id, show)

        def progress(view: ProfileView) -> None:
            if not as_json:
                console.print(f"{len(view.ranks)} of {view.world_size} ranks answered")

        try:
            profile = client.wait_profile(job_id, profile.id, timeout=timeout, progress=progress)
        except TimeoutError as exc:
            fail(f"{exc}; see it later with `phalanx jobs profile {job_id} --show {profile.id}`", 1)
        files = []
        if download is not None:
            files = [
                client.download_trace(job_id, profile.id, rank.rank, download)
                for rank in profile.ranks
                if rank.summary is not None
            ]
    if as_json:
        print_json(profile)
        return
    print_profile(profile)
    for path in files:
        console.print(f"wrote {path}")
    if profile.ranks and download is None:
        console.print(
            f"the traces open in Perfetto (ui.perfetto.dev) or chrome://tracing: "
            f"`phalanx jobs profile {job_id} --show {profile.id} --download DIR`"
        )


@app.command("logs")
def jobs_logs(
    job_id: int,
    follow_logs: Annotated[bool, typer.Option("-f", "--follow", help="Keep printing new lines.")] = False,
    rank: Annotated[int | None, typer.Option(help="Only this global rank.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """A job's output, every rank interleaved (prefixed) or one rank."""
    with api() as client:
        after, ended = 0, False
        while True:
            lines = client.logs(job_id, rank=rank, after=after, limit=5000)
            for line in lines:
                if as_json:
                    sys.stdout.write(line.model_dump_json() + "\n")
                else:
                    who = line.source
                    sys.stdout.write(f"[{who}] {line.line}\n")
            sys.stdout.flush()
            if lines:
                after = lines[-1].id
                continue
            if not follow_logs or ended:
                return
            # One more read after the job ends: lines shipped just before the end.
            ended = client.get_job(job_id).state.is_terminal
            if not ended:
                time.sleep(0.5)


@app.command("kill")
def jobs_kill(job_id: int, as_json: JsonOpt = False) -> None:
    """Cancel a job: its workers get SIGTERM, then SIGKILL after the grace period."""
    with api() as client:
        _print_state(client.kill_job(job_id), as_json)


def _print_state(job: JobView, as_json: bool) -> None:
    if as_json:
        print_json({"id": job.id, "state": job.state.value})
    else:
        console.print(f"job {job.id} {job.state.value}")


@app.command("pause")
def jobs_pause(job_id: int, as_json: JsonOpt = False) -> None:
    """SIGTERM the workers so they checkpoint and leave; `jobs resume` continues from there."""
    with api() as client:
        _print_state(client.pause_job(job_id), as_json)


@app.command("resume")
def jobs_resume(job_id: int, as_json: JsonOpt = False) -> None:
    """Queue a paused job again; it starts from its newest checkpoint."""
    with api() as client:
        _print_state(client.resume_job(job_id), as_json)


@checkpoints_app.command("list")
def checkpoints_list(job_id: int, as_json: JsonOpt = False) -> None:
    """Committed checkpoints of a job, oldest first."""
    with api() as client:
        rows = client.checkpoints(job_id)
    if as_json:
        print_json(rows)
        return
    table = Table()
    for column in ("step", "attempt", "size", "metrics", "created", "path"):
        table.add_column(column)
    for c in rows:
        size = f"{c.size_bytes / 2**20:.1f} MiB"
        table.add_row(str(c.step), str(c.attempt), size, fmt_metrics(c.metrics), str(c.created_at), c.path)
    console.print(table)


@checkpoints_app.command("download")
def checkpoints_download(
    job_id: int,
    args: Annotated[list[str], typer.Argument(help="[STEP] DIR: the step (default: newest) and where to unpack")],
    as_json: JsonOpt = False,
) -> None:
    """Download a checkpoint's files into DIR."""
    if len(args) not in (1, 2) or (len(args) == 2 and not args[0].isdigit()):
        fail("usage: phalanx checkpoints download JOB [STEP] DIR", 2)
    step = int(args[0]) if len(args) == 2 else None
    with api() as client:
        chosen = client.download_checkpoint(job_id, args[-1], step)
    if as_json:
        print_json(chosen)
    else:
        console.print(f"checkpoint of step {chosen.step} (attempt {chosen.attempt}) unpacked into {args[-1]}")


def describe_place(place: QueuePlace) -> str:
    """ "#3 of 12 (#1 in its team); starts ~2026-12-05 14:05 UTC: <reason>" """
    if place.position is None:
        where = "not in line"
    else:
        team = f" (#{place.team_position} in its team)" if place.team_position else ""
        where = f"#{place.position} of {place.queued}{team}"
    eta = f"; starts ~{place.estimated_start:%Y-%m-%d %H:%M} UTC" if place.estimated_start else ""
    return f"{where}{eta}: {place.reason}"
