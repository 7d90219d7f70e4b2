"""The `phalanx` command. Every read command takes --json; errors say how to fix them."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn

import httpx
import typer
from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from phalanx.client import ApiError, Client, SpecError
from phalanx.schemas import JobDetail, JobState, JobView, Study, StudyDetail, StudyState

app = typer.Typer(
    help="Phalanx: distributed PyTorch training on your own machines.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
jobs_app = typer.Typer(help="Inspect and control jobs.", no_args_is_help=True)
agents_app = typer.Typer(help="Inspect agents (the nodes that run workers).", no_args_is_help=True)
db_app = typer.Typer(help="Database schema.", no_args_is_help=True)
tokens_app = typer.Typer(help="Mint API tokens (admin).", no_args_is_help=True)
checkpoints_app = typer.Typer(help="A job's committed checkpoints.", no_args_is_help=True)
studies_app = typer.Typer(
    help="Hyperparameter studies: Optuna drives the trials, each one a job.", no_args_is_help=True
)
app.add_typer(jobs_app, name="jobs")
app.add_typer(agents_app, name="agents")
app.add_typer(db_app, name="db")
app.add_typer(tokens_app, name="tokens")
app.add_typer(checkpoints_app, name="checkpoints")
app.add_typer(studies_app, name="studies")

console = Console()
err = Console(stderr=True)
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]


def _debuggable() -> None:
    """`kill -USR1 <pid>` prints every thread's stack to stderr: how to see where a daemon hangs."""
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)


def fail(message: str, code: int = 1) -> NoReturn:
    err.print(f"[bold red]error:[/] {message}", highlight=False, markup=True)
    raise typer.Exit(code)


@contextmanager
def api() -> Iterator[Client]:
    client = Client()
    try:
        yield client
    except ApiError as exc:
        fail(exc.message)
    except httpx.TransportError as exc:
        fail(
            f"cannot reach Phalanx at {client.url} ({exc.__class__.__name__}). "
            "Start it with `phalanx up`, or point PHALANX_URL at a running server."
        )
    finally:
        client.close()


def print_json(value: Any) -> None:
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    elif isinstance(value, list):
        value = [v.model_dump(mode="json") if isinstance(v, BaseModel) else v for v in value]
    sys.stdout.write(json.dumps(value, indent=2, default=str) + "\n")


def _fmt_metrics(metrics: dict[str, float]) -> str:
    return "  ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items()))


# --- components --------------------------------------------------------------------------------


@app.command()
def server(
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
) -> None:
    """Run the API server (FastAPI) on the configured database."""
    import uvicorn

    from server.app import create_app
    from server.db import SchemaOutOfDate
    from server.settings import get_settings

    try:
        application = create_app(get_settings())
    except SchemaOutOfDate as exc:
        fail(str(exc), 2)
    _debuggable()
    log_level = os.environ.get("PHALANX_LOG_LEVEL", "warning").lower()
    uvicorn.run(application, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=3)


@app.command()
def scheduler(
    pool: Annotated[str, typer.Option(help="Celery pool (solo keeps one process).")] = "solo",
) -> None:
    """Run the scheduler: a Celery worker and its periodic passes (placement, reaping lost agents)."""
    from scheduler.celery_app import make_celery, periodic_passes
    from scheduler.periodic import PeriodicPublisher
    from server.db import SchemaOutOfDate, check_schema
    from server.settings import get_settings

    settings = get_settings()
    try:
        check_schema(settings.database_url)
    except SchemaOutOfDate as exc:
        fail(str(exc), 2)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    celery = make_celery(settings)
    PeriodicPublisher(celery, periodic_passes(settings)).start()  # beat's job, in this process
    celery.worker_main(
        [
            "worker",
            f"--pool={pool}",
            "--concurrency=1",
            "--loglevel=WARNING",
            "--without-gossip",
            "--without-mingle",
            f"--hostname=scheduler-{os.getpid()}@{socket.gethostname()}",
        ]
    )


def _default_address(server_url: str) -> str:
    """The local address that routes to the server: what peers on other nodes can reach."""
    host = httpx.URL(server_url).host or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((host, 9))
            address: str = sock.getsockname()[0]
            return address
        except OSError:
            return "127.0.0.1"


def _detect_gpus() -> int:
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


@app.command()
def agent(
    server_url: Annotated[str, typer.Option("--server", envvar="PHALANX_URL", help="The server's URL.")],
    token: Annotated[str, typer.Option(envvar="PHALANX_AGENT_TOKEN", help="An agent token.")],
    cpu_slots: Annotated[int | None, typer.Option(help="CPU worker slots (default: CPU count).")] = None,
    gpu_slots: Annotated[int | None, typer.Option(help="GPU slots (default: detected).")] = None,
    name: Annotated[str | None, typer.Option(help="Unique agent name (default: hostname).")] = None,
    address: Annotated[str | None, typer.Option(help="Address other nodes reach this one at.")] = None,
    work_dir: Annotated[Path | None, typer.Option(help="Where job bundles are unpacked.")] = None,
    heartbeat_interval: Annotated[float, typer.Option(envvar="PHALANX_HEARTBEAT_INTERVAL")] = 2.0,
    kill_grace: Annotated[float, typer.Option(help="Seconds between SIGTERM and SIGKILL.")] = 10.0,
) -> None:
    """Run the agent of this node: it registers its slots and runs the workers placed on it."""
    import logging
    import signal

    from worker_agent.agent import AgentConfig, AgentDaemon

    _debuggable()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s agent %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the agent's own
    agent_name = name or socket.gethostname()
    data_dir = Path(os.environ.get("PHALANX_DATA_DIR", Path.home() / ".phalanx"))
    config = AgentConfig(
        server_url=server_url,
        token=token,
        name=agent_name,
        address=address or _default_address(server_url),
        cpu_slots=cpu_slots if cpu_slots is not None else (os.cpu_count() or 1),
        gpu_slots=gpu_slots if gpu_slots is not None else _detect_gpus(),
        work_dir=work_dir or data_dir / "agents" / agent_name,
        heartbeat_interval=heartbeat_interval,
        kill_grace=kill_grace,
    )
    daemon = AgentDaemon(config)

    def _terminate(signum: int, _frame: object) -> None:
        daemon.shutdown()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, _terminate)
    daemon.run()


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Apply every migration to the configured database (PHALANX_DATABASE_URL)."""
    from server.db import current_revision, upgrade
    from server.settings import get_settings

    url = get_settings().database_url
    upgrade(url)
    console.print(f"database at revision {current_revision(url)}")


# --- the embedded stack ------------------------------------------------------------------------


@app.command()
def up(
    port: Annotated[int, typer.Option(help="Server port.")] = 8000,
    data_dir: Annotated[Path | None, typer.Option(help="Where the embedded database and files live.")] = None,
    agents: Annotated[int, typer.Option(help="Local agents to start (the example is a 2-node gang).")] = 2,
    cpu_slots: Annotated[int, typer.Option(help="CPU slots per local agent.")] = 1,
) -> None:
    """Run the whole stack on this machine: SQLite, a filesystem broker, server, scheduler, agents."""
    from phalanx.cli.stack import EmbeddedStack

    with EmbeddedStack(port=port, data_dir=data_dir, agents=agents, cpu_slots=cpu_slots) as stack:
        stack.announce(console)
        stack.wait_forever()


@app.command()
def demo(
    once: Annotated[bool, typer.Option("--once", help="Exit with the job's outcome when it ends.")] = False,
    port: Annotated[int, typer.Option(help="Server port.")] = 8000,
    data_dir: Annotated[Path | None, typer.Option(help="Where the embedded database and files live.")] = None,
) -> None:
    """`up` plus the example job, with its progress live in the terminal."""
    from phalanx.cli.stack import EmbeddedStack, example_job_file

    with EmbeddedStack(port=port, data_dir=data_dir, agents=2, cpu_slots=1) as stack:
        stack.announce(console)
        with stack.client() as client:
            try:
                job = client.submit_file(example_job_file())
            except (ApiError, SpecError) as exc:
                fail(str(exc))
            console.print(f"submitted job {job.id} ({job.name})")
            final = follow(client, job.id)
        if once:
            raise typer.Exit(0 if final.state is JobState.COMPLETED else 1)
        console.print("The stack keeps serving; press Ctrl-C to stop it.")
        stack.wait_forever()


def follow(client: Client, job_id: int, on_tick: Callable[[], None] | None = None) -> JobDetail:
    """Show a job's state, step and latest metrics live until it ends."""
    from rich.live import Live

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
            _fmt_metrics(job.latest_metrics),
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


# --- users' commands ---------------------------------------------------------------------------


@app.command()
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
            print_json({"id": job.id, "name": job.name, "state": job.state.value})
            return
        if not as_json:
            console.print(f"submitted job [bold]{job.id}[/] ({job.name}); `phalanx jobs show {job.id}` for details")
        if wait:
            final = client.wait(job.id) if as_json else follow(client, job.id)
            if as_json:
                print_json({"id": final.id, "name": final.name, "state": final.state.value})
            raise typer.Exit(0 if final.state is JobState.COMPLETED else 1)


def restart_budgets(job: JobView) -> str:
    """Used/allowed restarts: the job's own failures, then lost infrastructure (its own budget)."""
    return f"{job.restarts_used}/{job.spec.max_restarts} infra {job.infra_restarts_used}/{job.spec.max_infra_restarts}"


@jobs_app.command("list")
def jobs_list(
    state: Annotated[JobState | None, typer.Option(help="Only jobs in this state.")] = None,
    limit: Annotated[int, typer.Option(help="At most this many.")] = 50,
    as_json: JsonOpt = False,
) -> None:
    """List jobs, newest first."""
    with api() as client:
        jobs = client.list_jobs(state.value if state else None, limit)
    if as_json:
        print_json(jobs)
        return
    table = Table()
    for column in ("id", "name", "state", "owner", "nodes x slots", "restarts", "step", "metrics", "note"):
        table.add_column(column)
    for job in jobs:
        res = job.spec.resources
        note = job.wait_reason if job.state is JobState.QUEUED else (job.failure_reason or "")
        table.add_row(
            str(job.id),
            job.name,
            job.state.value,
            job.owner,
            f"{res.nodes}x{res.slots_per_node} {res.slot_type.value}",
            restart_budgets(job),
            "-" if job.latest_step is None else str(job.latest_step),
            _fmt_metrics(job.latest_metrics),
            note or "",
        )
    console.print(table)


@jobs_app.command("show")
def jobs_show(job_id: int, as_json: JsonOpt = False) -> None:
    """A job's state, why it waits or failed, latest metrics, attempts and events."""
    with api() as client:
        job = client.get_job(job_id)
    if as_json:
        print_json(job)
        return
    console.print(f"[bold]job {job.id}[/] {job.name}  state [bold]{job.state.value}[/]  owner {job.owner}")
    console.print(f"restarts used: {restart_budgets(job)}")
    if job.state is JobState.QUEUED and job.wait_reason:
        console.print(f"waiting: {job.wait_reason}")
    if job.failure_reason:
        console.print(f"[red]failed:[/] {job.failure_reason}")
    if job.latest_metrics:
        console.print(f"step {job.latest_step}: {_fmt_metrics(job.latest_metrics)}")
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


@jobs_app.command("logs")
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
                    who = "launcher" if line.rank is None else f"rank {line.rank}"
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


@jobs_app.command("kill")
def jobs_kill(job_id: int, as_json: JsonOpt = False) -> None:
    """Cancel a job: its workers get SIGTERM, then SIGKILL after the grace period."""
    with api() as client:
        _print_state(client.kill_job(job_id), as_json)


def _print_state(job: JobView, as_json: bool) -> None:
    if as_json:
        print_json({"id": job.id, "state": job.state.value})
    else:
        console.print(f"job {job.id} {job.state.value}")


@jobs_app.command("pause")
def jobs_pause(job_id: int, as_json: JsonOpt = False) -> None:
    """SIGTERM the workers so they checkpoint and leave; `jobs resume` continues from there."""
    with api() as client:
        _print_state(client.pause_job(job_id), as_json)


@jobs_app.command("resume")
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
        table.add_row(str(c.step), str(c.attempt), size, _fmt_metrics(c.metrics), str(c.created_at), c.path)
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


@agents_app.command("drain")
def agents_drain(agent: Annotated[str, typer.Argument(help="Agent name or id.")], as_json: JsonOpt = False) -> None:
    """Place no more work on an agent; the jobs on it checkpoint, stop, and restart elsewhere."""
    with api() as client:
        known = client.agents()
        match = next((a for a in known if a.name == agent or str(a.id) == agent), None)
        if match is None:
            fail(f"no agent named {agent!r}; `phalanx agents list` shows them")
        drained = client.drain_agent(match.id)
    if as_json:
        print_json(drained)
    else:
        console.print(f"agent {drained.name} {drained.state.value}")


@agents_app.command("list")
def agents_list(as_json: JsonOpt = False) -> None:
    """Registered agents, their slots and heartbeats."""
    with api() as client:
        agents = client.agents()
    if as_json:
        print_json(agents)
        return
    table = Table()
    for column in ("id", "name", "address", "state", "cpu used/total", "gpu used/total", "last heartbeat"):
        table.add_column(column)
    for a in agents:
        table.add_row(
            str(a.id),
            a.name,
            a.address,
            a.state.value,
            f"{a.used_cpu_slots}/{a.cpu_slots}",
            f"{a.used_gpu_slots}/{a.gpu_slots}",
            str(a.last_heartbeat),
        )
    console.print(table)


@tokens_app.command("create")
def tokens_create(
    name: str,
    kind: Annotated[str, typer.Option(help="user or agent")] = "user",
    as_json: JsonOpt = False,
) -> None:
    """Mint a token (shown once)."""
    if kind not in ("user", "agent"):
        fail("--kind must be 'user' or 'agent'", 2)
    with api() as client:
        created = client.create_token(kind, name)
    if as_json:
        print_json(created)
    else:
        console.print(f"{created.kind} token for {created.name} (shown once): {created.token}")


# --- studies -----------------------------------------------------------------------------------


def _fmt_value(values: list[float] | None) -> str:
    return "-" if not values else ", ".join(f"{v:.5g}" for v in values)


def _fmt_params(params: dict[str, Any]) -> str:
    return "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


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
            _fmt_value(trial.values),
            "-" if trial.best_so_far is None else f"{trial.best_so_far:.5g}",
            "-" if trial.last_step is None else str(trial.last_step),
            _fmt_params(trial.params),
            trial.reason or "",
        )
    return table


def follow_study(client: Client, study_id: int) -> StudyDetail:
    """The trials table, live (long-polled: it changes when a trial does) until the study ends."""
    from rich.live import Live

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


@studies_app.command("create")
def studies_create(
    file: Annotated[Path, typer.Argument(help="A study file (YAML).")],
    wait: Annotated[bool, typer.Option("--wait", help="Follow the trials and exit with the outcome.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Create a study; its trials' workdir is uploaded with it."""
    from phalanx.client import load_study_file

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


@studies_app.command("list")
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
        best = "-" if study.best_trial is None else f"{_fmt_value(study.best_values)} (trial {study.best_trial})"
        done = sum(study.trial_counts.values())
        table.add_row(
            str(study.id),
            study.name,
            study.state.value,
            study.owner,
            f"{done}/{study.spec.n_trials}",
            best,
            objective,
            study.reason or "",
        )
    console.print(table)


@studies_app.command("show")
def studies_show(study_id: int, as_json: JsonOpt = False) -> None:
    """A study's trials (best marked ★), its best value so far and each parameter's importance."""
    with api() as client:
        study = client.get_study(study_id)
        importance = None
        if not study.spec.multi_objective:
            importance = client.param_importances(study_id)
    if as_json:
        print_json({**study.model_dump(mode="json"), "importance": importance.model_dump() if importance else None})
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


@studies_app.command("best")
def studies_best(study_id: int, as_json: JsonOpt = False) -> None:
    """The best trial (every trial on the Pareto front for several objectives)."""
    with api() as client:
        best = client.best_trials(study_id)
    if as_json:
        print_json(best)
        return
    for trial in best.trials:
        console.print(
            f"trial {trial.number} (job {trial.job_id}): {_fmt_value(trial.values)}  {_fmt_params(trial.params)}"
        )


@studies_app.command("stop")
def studies_stop(study_id: int, as_json: JsonOpt = False) -> None:
    """Start no more trials; the running ones checkpoint and pause until `studies resume`."""
    with api() as client:
        _print_study_state(client.stop_study(study_id), as_json)


@studies_app.command("resume")
def studies_resume(study_id: int, as_json: JsonOpt = False) -> None:
    """Resume the paused trials from their checkpoints and go on to n_trials."""
    with api() as client:
        _print_study_state(client.resume_study(study_id), as_json)


def _print_study_state(study: Study, as_json: bool) -> None:
    if as_json:
        print_json({"id": study.id, "state": study.state.value})
    else:
        console.print(f"study {study.id} {study.state.value}")


if __name__ == "__main__":
    app()
