"""Server replicas and schedulers side by side on one PostgreSQL and Redis, behind a load balancer:
wake-ups reach a long-poll on whichever replica holds it, a replica killed mid-run goes unnoticed
by the job it was serving, and the whole control plane runs through PgBouncer in transaction
mode."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from sqlalchemy import make_url

from phalanx.client import Client, load_job_file
from phalanx.schemas import JobDetail, JobState, StudyState
from tests.e2e.test_fault_tolerance import SCRIPTED, assert_each_step_once
from tests.e2e.test_studies import scripted_study
from tests.processes import Balancer, Stack, free_port, wait_for

pytestmark = pytest.mark.e2e
REPLICAS = ("server-a", "server-b")
# A long-poll answered by a wake-up comes back at once; one that missed it only at the end of its wait.
LONG_POLL_S = 60.0
WOKEN_WITHIN_S = 10.0


class Replicated:
    def __init__(self, stack: Stack, ports: dict[str, int], balancer: Balancer) -> None:
        self.stack = stack
        self.ports = ports
        self.balancer = balancer

    def client(self, replica: str | None = None) -> Client:
        """An admin client through the balancer, or straight to one replica."""
        url = self.stack.url if replica is None else f"http://127.0.0.1:{self.ports[replica]}"
        return Client(url, self.stack.env["PHALANX_ADMIN_TOKEN"])


@contextmanager
def replicas(stack: Stack) -> Iterator[Replicated]:
    """Two servers and two schedulers; the agents and every client reach the servers through the
    balancer (the stack's URL), as a deployment behind a load balancer does."""
    ports = {name: free_port() for name in REPLICAS}
    try:
        with Balancer(stack.port, list(ports.values())) as balancer:
            for name, port in ports.items():
                stack.start_server(name=name, port=port)
            stack.start_scheduler("scheduler-a")
            stack.start_scheduler("scheduler-b")
            stack.start_agent("node-a")
            stack.start_agent("node-b")
            stack.wait_agents(2)
            yield Replicated(stack, ports, balancer)
    except BaseException:
        print(stack.dump())
        raise
    finally:
        stack.close()


@pytest.fixture
def replicated(clean_db: str, clean_redis: str, tmp_path: Path) -> Iterator[Replicated]:
    with replicas(Stack(tmp_path, clean_db, clean_redis)) as replicated:
        yield replicated


PGBOUNCER_INI = """[databases]
* = host={host} port={port} user={user}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {listen}
auth_type = any
pool_mode = transaction
default_pool_size = 20
max_client_conn = 1000
unix_socket_dir =
"""


def through_pgbouncer(database_url: str, listen: int) -> str:
    """The URL that reaches the database through PgBouncer on `listen`, with psycopg's prepared
    statements off (`prepare_threshold=none`, as the deployment guide says)."""
    url = make_url(database_url).set(port=listen).update_query_dict({"prepare_threshold": "none"})
    return url.render_as_string(hide_password=False)


def start_pgbouncer(stack: Stack, database_url: str, listen: int) -> None:
    """PgBouncer in transaction mode on `listen` in front of the database, a child of the stack."""
    if shutil.which("pgbouncer") is None:
        pytest.fail("no PgBouncer: apt-get install pgbouncer (.ci/run does)")
    url = make_url(database_url)
    ini = stack.tmp / "pgbouncer.ini"
    ini.write_text(PGBOUNCER_INI.format(host=url.host, port=url.port or 5432, user=url.username, listen=listen))
    as_postgres = ["-u", "postgres"] if os.geteuid() == 0 else []  # it refuses to run as root
    stack.supervisor.spawn("pgbouncer", ["pgbouncer", *as_postgres, str(ini)])

    def accepting() -> bool:
        try:
            socket.create_connection(("127.0.0.1", listen), timeout=1).close()
        except OSError:
            return False
        return True

    wait_for(accepting, 30, "PgBouncer to listen")


def users_holding(replicated: Replicated, replica: str) -> int:
    """The requests users hold open on `replica` now, as its /metrics reports them."""
    response = httpx.get(
        f"http://127.0.0.1:{replicated.ports[replica]}/metrics",
        headers={"Authorization": f"Bearer {replicated.stack.env['PHALANX_ADMIN_TOKEN']}"},
    )
    response.raise_for_status()
    found = re.search(r'^phalanx_held_requests\{kind="user"\} ([0-9.]+)$', response.text, re.MULTILINE)
    return 0 if found is None else int(float(found.group(1)))


def test_a_long_poll_on_one_replica_is_woken_by_a_change_made_on_the_other(replicated: Replicated) -> None:
    with replicated.client() as client:
        client.create_team("held")
        client.hold_team("held")
        spec, workdir = load_job_file(SCRIPTED)
        job = client.submit(spec.model_copy(update={"team": "held"}), workdir)
    answered: list[tuple[JobDetail, float]] = []

    def long_poll() -> None:
        with replicated.client("server-b") as on_b:
            began = time.monotonic()
            answered.append((on_b.get_job_change(job.id, JobState.QUEUED, wait=LONG_POLL_S), began))

    poller = threading.Thread(target=long_poll)
    poller.start()
    wait_for(lambda: users_holding(replicated, "server-b") == 1, 30, "server-b to hold the long-poll")
    with replicated.client("server-a") as on_a:
        killed_at = time.monotonic()
        on_a.kill_job(job.id)
    poller.join(timeout=LONG_POLL_S + 20)
    assert answered, "the long-poll on server-b never returned"
    seen, _ = answered[0]
    assert seen.state is JobState.CANCELLED
    assert time.monotonic() - killed_at < WOKEN_WITHIN_S, "server-b answered at the end of its wait, not on the wake-up"


def test_a_replica_killed_mid_run_goes_unnoticed(replicated: Replicated) -> None:
    """kill -9 one of two servers while a job trains: the agents' and ranks' requests it was
    serving are sent again through the balancer to the other one, and the job completes in its
    first attempt with every step reported once."""
    steps = 160
    spec, workdir = load_job_file(SCRIPTED)
    spec = spec.model_copy(update={"hyperparameters": {"steps": steps, "step_seconds": 0.05}})
    with replicated.client() as client:
        job = client.submit(spec, workdir)
        wait_for(lambda: (client.get_job(job.id).latest_step or 0) >= 10, 120, "ten steps")
    assert all(replicated.balancer.connections[port] > 0 for port in replicated.ports.values()), (
        "both replicas must have served before one is killed"
    )
    replicated.stack.stop("server-a", signal.SIGKILL)
    with replicated.client() as client:
        final = client.wait(job.id, timeout=180)
        assert final.state is JobState.COMPLETED, final.failure_reason
        assert final.attempts == 1 and final.restarts_used == 0 and final.infra_restarts_used == 0
        assert_each_step_once(client.metrics(job.id, name="step_value"), steps)
        # the survivor carries on alone: a new job runs to the end
        after = client.submit(spec.model_copy(update={"hyperparameters": {"steps": 20, "step_seconds": 0.05}}), workdir)
        assert client.wait(after.id, timeout=180).state is JobState.COMPLETED
        assert all(agent.state.value == "ACTIVE" for agent in client.agents())


def test_replicas_and_schedulers_run_through_pgbouncer_in_transaction_mode(
    clean_db: str, clean_redis: str, tmp_path: Path
) -> None:
    """Every connection of the servers, the schedulers and Optuna's storage goes through PgBouncer,
    which gives each transaction whichever server connection is free: no session state (a
    session-level advisory lock, a prepared statement) may outlive a transaction. A job trains to
    the end and a study runs its trials, which take the scheduler's and the study driver's
    transaction-scoped advisory locks on every pass."""
    listen = free_port()
    stack = Stack(tmp_path, through_pgbouncer(clean_db, listen), clean_redis)
    start_pgbouncer(stack, clean_db, listen)
    with replicas(stack) as replicated, replicated.client() as client:
        steps = 40
        spec, workdir = load_job_file(SCRIPTED)
        spec = spec.model_copy(update={"hyperparameters": {"steps": steps, "step_seconds": 0.02}})
        job = client.submit(spec, workdir)
        study_spec, study_workdir = scripted_study(n_trials=4, parallelism=2)
        study = client.create_study(study_spec, study_workdir)
        final = client.wait(job.id, timeout=180)
        assert final.state is JobState.COMPLETED and final.attempts == 1, final.failure_reason
        assert_each_step_once(client.metrics(job.id, name="step_value"), steps)
        ended = client.wait_study(study.id, timeout=300)
        assert ended.state is StudyState.COMPLETED, ended.reason
        assert len(ended.trials) == 4 and ended.best_trial is not None
        logs = {name: stack.log(name) for name in stack.procs}
        assert not [name for name, text in logs.items() if "prepared statement" in text], logs
