"""The commands that run Phalanx itself: one component each (`server`, `scheduler`, `agent`,
`db upgrade`: what docker-compose.yml and real clusters run) and the embedded stack (`up`, `demo`).

The server's, scheduler's and agent's modules are imported inside their commands: `phalanx jobs
list` must not pay for FastAPI, Celery or torch.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Annotated

import httpx
import typer

from phalanx.bundle_limits import DEFAULT_MAX_FILES, DEFAULT_MAX_UNPACKED_BYTES, BundleLimits
from phalanx.cli.live import follow
from phalanx.cli.output import console, fail
from phalanx.client import ApiError, SpecError
from phalanx.schemas import JobState
from stack.embedded import EmbeddedStack, StackError, example_job_file

db_app = typer.Typer(help="Database schema.", no_args_is_help=True)

LISTEN_BACKLOG = 65535  # the kernel caps it at net.core.somaxconn (4,096 on most Linux today)


def _debuggable() -> None:
    """`kill -USR1 <pid>` prints every thread's stack to stderr: how to see where a daemon hangs."""
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)


# --- components --------------------------------------------------------------------------------


def server(
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
) -> None:
    """Run the API server (FastAPI) on the configured database."""
    import uvicorn

    from server.app import create_app, freeze_startup_heap
    from server.db import SchemaOutOfDate
    from server.settings import get_settings

    try:
        application = create_app(get_settings())
    except SchemaOutOfDate as exc:
        fail(str(exc), 2)
    freeze_startup_heap()
    _debuggable()
    log_level = os.environ.get("PHALANX_LOG_LEVEL", "warning").lower()
    # A listen queue as long as the kernel allows (net.core.somaxconn caps it): a thousand agents
    # and their nodes connect at once when a cluster fills or the server restarts, and a connection
    # the full queue drops is tried again only after 1, 3, 7, 15 s, past the agents' heartbeat
    # timeout (`bench/bench_scale.py`: uvicorn's 2,048 overflowed hundreds of thousands of times).
    uvicorn.run(
        application,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=3,
        backlog=LISTEN_BACKLOG,
    )


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
    run_as: Annotated[
        str | None,
        typer.Option(
            envvar="PHALANX_RUN_AS",
            help="Run jobs as this OS user, or each node as its own uid of a range FIRST-LAST (agent as root).",
        ),
    ] = None,
    workdir_ttl: Annotated[
        float, typer.Option(envvar="PHALANX_WORKDIR_TTL", help="Seconds a node's folder is kept after it ends.")
    ] = 3600.0,
    wheelhouse: Annotated[
        Path | None,
        typer.Option(
            envvar="PHALANX_WHEELHOUSE",
            help="Install jobs' runtime_env packages offline, from this folder of wheels only.",
        ),
    ] = None,
    env_build_timeout: Annotated[
        float,
        typer.Option(envvar="PHALANX_ENV_BUILD_TIMEOUT", help="Seconds a runtime environment may take to build."),
    ] = 900.0,
    env_cache_gib: Annotated[
        float,
        typer.Option(
            envvar="PHALANX_ENV_CACHE_GIB", help="GiB of built environments kept; the least recently used go first."
        ),
    ] = 20.0,
    env_source_builds: Annotated[
        bool,
        typer.Option(
            envvar="PHALANX_ENV_SOURCE_BUILDS",
            help="Let runtime environments build packages from source (runs their build code as the agent's user).",
        ),
    ] = False,
    fork_ranks: Annotated[
        bool,
        typer.Option(
            envvar="PHALANX_FORK_RANKS",
            help="Fork ranks from the agent's fork-server (no rank imports torch at start); "
            "--no-fork-ranks starts each rank as a fresh interpreter.",
        ),
    ] = True,
    max_bundle_files: Annotated[int, typer.Option(envvar="PHALANX_MAX_BUNDLE_FILES")] = DEFAULT_MAX_FILES,
    max_bundle_unpacked_bytes: Annotated[
        int, typer.Option(envvar="PHALANX_MAX_BUNDLE_UNPACKED_BYTES")
    ] = DEFAULT_MAX_UNPACKED_BYTES,
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
        run_as=run_as,
        workdir_ttl=workdir_ttl,
        bundle_limits=BundleLimits(max_bundle_files, max_bundle_unpacked_bytes),
        wheelhouse=wheelhouse.resolve() if wheelhouse is not None else None,
        env_build_timeout=env_build_timeout,
        env_cache_bytes=int(env_cache_gib * 1024**3),
        env_source_builds=env_source_builds,
        fork_ranks=fork_ranks,
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


def up(
    port: Annotated[int, typer.Option(help="Server port.")] = 8000,
    data_dir: Annotated[Path | None, typer.Option(help="Where the embedded database and files live.")] = None,
    agents: Annotated[int, typer.Option(help="Local agents to start (the example is a 2-node gang).")] = 2,
    cpu_slots: Annotated[int, typer.Option(help="CPU slots per local agent.")] = 1,
) -> None:
    """Run the whole stack on this machine: SQLite, a filesystem broker, server, scheduler, agents."""
    try:
        with EmbeddedStack(port=port, data_dir=data_dir, agents=agents, cpu_slots=cpu_slots) as stack:
            stack.announce(console)
            stack.wait_forever()
    except StackError as exc:
        fail(str(exc))


def demo(
    once: Annotated[bool, typer.Option("--once", help="Exit with the job's outcome when it ends.")] = False,
    port: Annotated[int, typer.Option(help="Server port.")] = 8000,
    data_dir: Annotated[Path | None, typer.Option(help="Where the embedded database and files live.")] = None,
) -> None:
    """`up` plus the example job, with its progress live in the terminal."""
    try:
        with EmbeddedStack(port=port, data_dir=data_dir, agents=2, cpu_slots=1) as stack:
            stack.announce(console)
            with stack.client() as client:
                try:
                    job = client.submit_file(example_job_file())
                except (ApiError, SpecError) as exc:
                    fail(str(exc))
                console.print(f"submitted job {job.id} ({job.name})")
                final = follow(client, job.id, on_tick=stack.check)
            if once:
                raise typer.Exit(0 if final.state is JobState.COMPLETED else 1)
            console.print("The stack keeps serving; press Ctrl-C to stop it.")
            stack.wait_forever()
    except StackError as exc:
        fail(str(exc))
