"""The per-node daemon: register, heartbeat, long-poll for work, run each node of a gang.

It talks to the server only through the SDK (`phalanx.client.Client`). Reports that must arrive
(rendezvous, started, exit, logs) travel many in one call (`NodeReporter`, `LogShipper`) and go
through `reliably`, the SDK's one retry policy: retried with backoff while the server is
unreachable or busy (5xx, 408, 425, 429); any other 4xx answer, of the call or of one report in
it, is final and logged.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pwd
import random
import shutil
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from phalanx._retry import is_retryable_status
from phalanx.bundle_limits import BundleLimits, extract_bundle
from phalanx.client import ApiError, Client, Conflict, reliably
from phalanx.schemas import (
    AgentRegistration,
    AllocationLogBatch,
    Assignment,
    ExitReport,
    LogLineIn,
    NodeReport,
    RendezvousReport,
    StartedReport,
)
from phalanx.schemas.protocol import MAX_EXIT_REASON_CHARS, MAX_REPORTS_PER_CALL
from worker_agent.environments import Environment, EnvironmentFailed, Environments, EnvironmentsConfig
from worker_agent.forkserver import ForkServer
from worker_agent.launcher import FailureReport, NodeProcess, free_port, rank_env

log = logging.getLogger("phalanx.agent")
# Lines are shipped in batches this often (or at 500 pending): each request costs the server CPU
# that training on the same machine would otherwise get; a second is still "live" for a person.
SHIP_INTERVAL_S = 1.0
# A request carries at most this much output (the server's cap on a log batch is 8 MiB), and at
# most MAX_PENDING_BYTES of an allocation wait to be shipped before the job's output is held up.
SHIP_BATCH_BYTES = 2 * 1024 * 1024
MAX_PENDING_BYTES = 8 * 1024 * 1024
# The agent's own token (from its last registration), beside the jobs' workdirs, never in one:
# only the agent's OS user may read it.
AGENT_TOKEN_FILE = "agent-token"
MAX_SETUP_LINE_CHARS = 65_536


@dataclass
class AgentConfig:
    server_url: str
    token: str
    name: str
    address: str
    cpu_slots: int
    gpu_slots: int
    work_dir: Path
    heartbeat_interval: float = 2.0
    kill_grace: float = 10.0
    poll_seconds: float = 20.0
    # Jobs run as this OS user (name or uid), never as the agent's: they cannot read its token
    # file or its environment. None: as the agent's own user.
    run_as: str | None = None
    # A node's folder (its code, torchrun's logs) is removed this long after the node ended.
    workdir_ttl: float = 3600.0
    bundle_limits: BundleLimits = field(default_factory=BundleLimits)
    # Runtime environments (worker_agent/environments.py): offline from this folder of wheels when
    # set; how long resolving and building may take; how much disk built environments may keep.
    wheelhouse: Path | None = None
    env_build_timeout: float = 900.0
    env_cache_bytes: int = 20 * 1024**3
    env_source_builds: bool = False
    # Ranks forked from the fork-server too (rank_shim.py), not only torchrun: no rank imports torch.
    fork_ranks: bool = True


class LogShipper(threading.Thread):
    """Batches output lines per allocation and ships them; `flush(allocation)` drains one now.

    Each batch is named "<this shipper's stream>-<number of its first line>" (lines counted per
    allocation), and every retry of it carries that name: a batch whose answer was lost is stored
    once however often it is sent."""

    def __init__(self, agent: AgentDaemon) -> None:
        super().__init__(name="log-shipper", daemon=True)
        self._agent = agent
        self._lock = threading.Condition()
        self._pending: dict[int, list[LogLineIn]] = defaultdict(list)
        self._pending_bytes: dict[int, int] = defaultdict(int)
        self._ship_lock = threading.Lock()
        self._stream = uuid.uuid4().hex[:16]  # a restarted agent never reuses a name
        self._numbered: dict[int, int] = defaultdict(int)  # allocation -> lines named so far

    def add(self, allocation_id: int, line: LogLineIn) -> None:
        """Queue a line; while MAX_PENDING_BYTES of this allocation wait, the caller (the pump of a
        job's output) waits too, and so does the job's next write: a job printing faster than its
        output ships is slowed down, its output is never dropped and the agent's memory stays bounded."""
        with self._lock:
            while self._pending_bytes[allocation_id] > MAX_PENDING_BYTES and not self._agent.stopping.is_set():
                self._lock.notify_all()
                self._lock.wait(timeout=1.0)
            self._pending[allocation_id].append(line)
            self._pending_bytes[allocation_id] += len(line.line)
            if len(self._pending[allocation_id]) >= 500 or self._pending_bytes[allocation_id] > MAX_PENDING_BYTES:
                self._lock.notify_all()

    def _take(self, allocation_id: int | None = None) -> dict[int, list[LogLineIn]]:
        """The pending lines (of one allocation, or all), under the lock; waiting adders go on."""
        if allocation_id is None:
            taken, self._pending = dict(self._pending), defaultdict(list)
            self._pending_bytes.clear()
        else:
            taken = {allocation_id: self._pending.pop(allocation_id, [])}
            self._pending_bytes.pop(allocation_id, None)
        self._lock.notify_all()
        return taken

    def flush(self, allocation_id: int) -> None:
        with self._lock:
            taken = self._take(allocation_id)
        self._ship(taken)

    def _ship(self, pending: dict[int, list[LogLineIn]]) -> None:
        """Every allocation's lines in as few calls as the caps allow, each allocation's in order."""
        with self._ship_lock:  # keep each allocation's lines in order
            for call in _calls(pending):
                batches = []
                for allocation_id, lines in call:
                    batch_id = f"{self._stream}-{self._numbered[allocation_id]}"
                    self._numbered[allocation_id] += len(lines)
                    batches.append(AllocationLogBatch(allocation_id=allocation_id, lines=lines, batch_id=batch_id))
                try:
                    outcomes = reliably(partial(self._agent.client.ship_log_batches, self._agent.agent_id, batches))
                except (ApiError, httpx.TransportError) as exc:  # past reliably's patience: the thread lives on
                    log.warning("dropped %d log lines: %s", sum(len(b.lines) for b in batches), exc)
                    continue
                if len(outcomes) != len(batches):  # a server that does not speak this call: the thread lives on
                    log.warning("%d outcomes answered %d log batches", len(outcomes), len(batches))
                    continue
                for batch, outcome in zip(batches, outcomes, strict=True):
                    if outcome.status >= 300:  # the allocation ended or moved: nobody reads them now
                        log.info(
                            "dropped %d log lines of allocation %d: %s",
                            len(batch.lines),
                            batch.allocation_id,
                            outcome.error,
                        )

    def run(self) -> None:
        while not self._agent.stopping.is_set():
            with self._lock:
                self._lock.wait(timeout=SHIP_INTERVAL_S)
                pending = self._take()
            self._ship(pending)


def _calls(pending: dict[int, list[LogLineIn]]) -> Iterator[list[tuple[int, list[LogLineIn]]]]:
    """The lines in calls of at most 2,000 lines, SHIP_BATCH_BYTES and MAX_REPORTS_PER_CALL
    batches, each call's lines grouped by allocation, each allocation's in order."""
    call: list[tuple[int, list[LogLineIn]]] = []
    count = size = 0
    for allocation_id, lines in pending.items():
        chunk: list[LogLineIn] = []
        for line in lines:
            if count and (count >= 2000 or size + len(line.line) > SHIP_BATCH_BYTES):
                if chunk:
                    call.append((allocation_id, chunk))
                    chunk = []
                yield call
                call, count, size = [], 0, 0
            chunk.append(line)
            count += 1
            size += len(line.line)
        if chunk:
            call.append((allocation_id, chunk))
            if len(call) == MAX_REPORTS_PER_CALL:
                yield call
                call, count, size = [], 0, 0
    if call:
        yield call


class NodeReporter(threading.Thread):
    """Sends what the node runners report (started, exit, rendezvous), many in one call: whatever
    they report while a call is on its way goes in the next one. A lone report waits for nothing;
    the eight nodes an agent starts together cost the server one call, not eight."""

    def __init__(self, agent: AgentDaemon) -> None:
        super().__init__(name="node-reporter", daemon=True)
        self._agent = agent
        self._changed = threading.Condition()
        self._pending: list[tuple[NodeReport, Future[None]]] = []

    def report(self, report: NodeReport) -> None:
        """Send `report` and wait until it is applied; the server's refusal of it (404, 409) is
        raised as `ApiError`, as its own call's would be, and so is a call refused as a whole."""
        done: Future[None] = Future()
        with self._changed:
            self._pending.append((report, done))
            self._changed.notify()
        done.result()

    def run(self) -> None:
        while True:
            with self._changed:
                while not self._pending:
                    self._changed.wait()
                taken = self._pending[:MAX_REPORTS_PER_CALL]
                del self._pending[:MAX_REPORTS_PER_CALL]
            reports = [report for report, _ in taken]
            try:
                outcomes = reliably(partial(self._agent.client.report_nodes, self._agent.agent_id, reports))
                if len(outcomes) != len(taken):
                    raise ApiError(502, f"{len(outcomes)} outcomes answered {len(taken)} reports")
            except Exception as exc:  # the runners decide what it means for their node; this thread lives on
                for _, done in taken:
                    done.set_exception(exc)
                continue
            for (_, done), outcome in zip(taken, outcomes, strict=True):
                if outcome.status < 300:
                    done.set_result(None)
                else:
                    kind = Conflict if outcome.status == 409 else ApiError
                    done.set_exception(kind(outcome.status, outcome.error or "refused"))


class NodeRunner(threading.Thread):
    """Runs one node of one allocation from bundle download to the exit report."""

    def __init__(self, agent: AgentDaemon, assignment: Assignment) -> None:
        super().__init__(name=f"node-{assignment.allocation_id}-{assignment.node_rank}", daemon=True)
        self.agent = agent
        self._assignment = assignment
        self._changed = threading.Condition()
        self._process: NodeProcess | None = None
        self._stop_requested = False

    @property
    def allocation_id(self) -> int:
        return self._assignment.allocation_id

    @property
    def node_dir(self) -> Path:
        return self.agent.config.work_dir / f"alloc-{self._assignment.allocation_id}-node-{self._assignment.node_rank}"

    def update(self, assignment: Assignment | None) -> None:
        """A newer view from the server; None means the server no longer knows this node.

        "stop" gives the ranks the assignment's `stop_grace` (else `kill_grace`) seconds after
        SIGTERM to checkpoint; "kill" and a forgotten node get SIGKILL at once: their attempt is over
        and fenced."""
        with self._changed:
            wanted = "kill" if assignment is None else assignment.desired
            if assignment is not None:
                self._assignment = assignment
            if wanted in ("stop", "kill"):
                self._stop_requested = True
            self._changed.notify_all()
            process = self._process
        if wanted in ("stop", "kill") and process is not None:
            grace = 0.0 if wanted == "kill" else self._stop_grace()
            threading.Thread(target=process.stop, args=(grace,), daemon=True).start()

    def _stop_grace(self) -> float:
        chosen = self._assignment.stop_grace
        return self.agent.config.kill_grace if chosen is None else chosen

    def run(self) -> None:
        a = self._assignment
        exit_code, reason, cause = 1, "", "run"
        user = self.agent.job_users.take()
        environment: Environment | None = None
        try:
            workdir = self._prepare()
            user.own(self.node_dir)
            environment = self._environment(workdir)
            ready = self._await_rendezvous() if not self._stopped() else None
            if ready is None:
                exit_code, reason, cause = -15, "stopped before launch", "stopped"
            else:
                exit_code, reason, cause = self._launch_and_wait(ready, workdir, user, environment)
        except EnvironmentFailed as exc:
            exit_code, reason, cause = 1, str(exc), "environment"
            self._setup_line(f"the environment failed: {exc}")
        except Exception as exc:  # anything here fails the node, never the agent
            log.exception("node %d of allocation %d failed to run", a.node_rank, a.allocation_id)
            exit_code, reason = 1, f"agent could not run the node: {exc}"
        finally:
            if environment is not None:
                environment.release()
            self.agent.shipper.flush(a.allocation_id)
            report = ExitReport(
                kind="exit",
                allocation_id=a.allocation_id,
                node_rank=a.node_rank,
                exit_code=exit_code,
                reason=reason[-MAX_EXIT_REASON_CHARS:],
                cause=cause,
            )
            delivered = self.agent.report_exit(report)
            self.agent.remove_later(self.node_dir)
            self.agent.job_users.give_back(user)
            self.agent.forget(self, None if delivered else report)

    def _prepare(self) -> Path:
        a = self._assignment
        root = self.node_dir
        workdir = root / "workdir"
        if root.exists():
            shutil.rmtree(root)
        workdir.mkdir(parents=True)
        try:
            bundle = reliably(lambda: self.agent.client.download_bundle(a.job_id))
        except ApiError as exc:
            if exc.status != 404:
                raise
            return workdir  # a job without code: the entrypoint is on the node already
        extract_bundle(io.BytesIO(bundle), workdir, self.agent.config.bundle_limits)
        return workdir

    def _stopped(self) -> bool:
        with self._changed:
            return self._stop_requested

    def _setup_line(self, text: str) -> None:
        """A line of the environment's build, shipped with the job's logs as stream "setup"."""
        line = LogLineIn(rank=None, stream="setup", time=time.time(), line=text[:MAX_SETUP_LINE_CHARS])
        self.agent.shipper.add(self._assignment.allocation_id, line)

    def _environment(self, workdir: Path) -> Environment | None:
        """The job's runtime environment, built on this node if it has none (None: the job has none).

        Node rank 0 resolves the requirements when the job has no lock yet and reports the lock; the
        other nodes wait for it, so every node installs the same packages."""
        a = self._assignment
        if a.runtime_env is None:
            return None
        environments = self.agent.environments
        lock = a.env_lock
        if lock is None and a.node_rank == 0:
            wanted = environments.requirements(a.runtime_env, workdir)
            resolved = environments.resolve(wanted, self._setup_line)
            lock = reliably(
                lambda: self.agent.client.report_environment_lock(self.agent.agent_id, a.allocation_id, resolved)
            )
        with self._changed:
            while lock is None and not self._stop_requested:
                self._changed.wait(timeout=1.0)
                lock = self._assignment.env_lock
        if lock is None:
            return None
        return environments.acquire(lock, self._setup_line)

    def _await_rendezvous(self) -> Assignment | None:
        """The assignment to launch with, its master port known; None if stopped meanwhile.

        A one-node job meets on this host only: its port is chosen here and told to nobody (a
        call saved per node start: at a cluster's fill, ~7,000 of them). A gang's rank 0 chooses
        and reports it; the other nodes wait until the server passes it on."""
        a = self._assignment
        if a.nnodes == 1:
            return a.model_copy(update={"master_port": a.master_port or free_port(self.agent.config.address)})
        if a.node_rank == 0 and a.master_port is None:
            port = free_port(self.agent.config.address)
            self.agent.reporter.report(
                RendezvousReport(kind="rendezvous", allocation_id=a.allocation_id, master_port=port)
            )
            with self._changed:
                self._assignment = a.model_copy(update={"master_port": port})
        with self._changed:
            while self._assignment.master_port is None and not self._stop_requested:
                self._changed.wait(timeout=1.0)
            return None if self._stop_requested else self._assignment

    def _launch_and_wait(
        self, a: Assignment, workdir: Path, user: JobUser, environment: Environment | None
    ) -> tuple[int, str, str]:
        cfg = self.agent.config
        env = rank_env(a, dict(os.environ), cfg.server_url, cfg.address)
        if environment is not None:
            env = environment.rank_env(env)
        if user.uid is not None:
            env["HOME"] = str(workdir.parent)  # caches and dotfiles stay in the node's folder
        log_dir = workdir.parent / "torchrun-logs"
        failure = FailureReport()

        def on_line(rank: int | None, stream: str, text: str) -> None:
            failure.add(rank, stream, text)
            line = LogLineIn(
                rank=rank, stream="stderr" if stream == "stderr" else "stdout", time=time.time(), line=text
            )
            self.agent.shipper.add(a.allocation_id, line)

        with self._changed:
            if self._stop_requested:
                return -15, "stopped before launch", "stopped"
            self._process, forked = NodeProcess.start(
                a, env, workdir, log_dir, on_line, self.agent.forkserver, user.popen_args(), cfg.fork_ranks
            )
        log.info(
            "allocation %d node %d: torchrun pid %d (%s)",
            a.allocation_id,
            a.node_rank,
            self._process.pid,
            "forked" if forked else "cold",
        )
        try:
            self.agent.reporter.report(
                StartedReport(kind="started", allocation_id=a.allocation_id, node_rank=a.node_rank)
            )
            log.info("allocation %d node %d: reported started", a.allocation_id, a.node_rank)
        except ApiError as exc:  # superseded while launching: stop what we started
            log.warning("start report refused (%s); stopping", exc)
            self._process.stop(cfg.kill_grace)
        code = self._process.wait()
        if self._stop_requested and failure.rank is None:
            return code, "stopped by Phalanx", "stopped"
        # torchrun named a failed rank: that is this node's story even if a stop came meanwhile
        return code, failure.describe() if code else "", "run"


class AgentDaemon:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.client = Client(config.server_url, config.token)
        self.agent_id = 0
        self.stopping = threading.Event()
        self.shipper = LogShipper(self)
        self.reporter = NodeReporter(self)
        self.job_users = JobUsers.parse(config.run_as)
        # Every torchrun is forked from one process that imported torch once (forkserver.py); it
        # switches to the node's user after the fork, so `--run-as` starts warm too.
        self.forkserver = ForkServer(dict(os.environ), config.work_dir)
        self.environments = Environments(
            EnvironmentsConfig(
                root=config.work_dir / "envs",
                wheelhouse=config.wheelhouse,
                build_timeout=config.env_build_timeout,
                size_budget=config.env_cache_bytes,
                allow_source_builds=config.env_source_builds,
            )
        )
        self._runners: dict[tuple[int, int], NodeRunner] = {}
        # Nodes whose runner ended, until an answer no longer lists them: with the exit report
        # still to deliver, or None once the server took it (or refused it for good). An answer
        # read before the exit was applied still lists the node to run, and must not start it again.
        self._ended: dict[tuple[int, int], ExitReport | None] = {}
        self._lock = threading.Lock()

    def register(self) -> None:
        """Register with the cluster's agent token, proving with the token kept from the last
        registration (if any) that a taken name is this agent restarting; then act with the new one."""
        token_file = self.config.work_dir / AGENT_TOKEN_FILE
        previous = token_file.read_text().strip() if token_file.is_file() else None
        registration = AgentRegistration(
            name=self.config.name,
            address=self.config.address,
            cpu_slots=self.config.cpu_slots,
            gpu_slots=self.config.gpu_slots,
            agent_token=previous or None,
        )
        agent = reliably(lambda: self.client.register_agent(registration, self.config.token))
        self.config.work_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(agent.agent_token)
        self.client.use_token(agent.agent_token)
        self.agent_id = agent.id
        log.info("registered as agent %d (%s, %s)", agent.id, agent.name, self.config.address)

    def remove_later(self, node_dir: Path) -> None:
        """Remove a node's folder once `workdir_ttl` has passed (its logs are on the server)."""
        timer = threading.Timer(
            self.config.workdir_ttl, shutil.rmtree, args=(node_dir,), kwargs={"ignore_errors": True}
        )
        timer.daemon = True
        timer.start()

    def sweep_old_node_dirs(self) -> None:
        """Folders of nodes that ended before this agent (re)started and are past their time."""
        if not self.config.work_dir.is_dir():
            return
        cutoff = time.time() - self.config.workdir_ttl
        for node_dir in self.config.work_dir.glob("alloc-*-node-*"):
            with contextlib.suppress(OSError):
                if node_dir.stat().st_mtime < cutoff:
                    shutil.rmtree(node_dir, ignore_errors=True)

    def report_exit(self, report: ExitReport) -> bool:
        """Whether the server has the exit `report` now (applied, or refused: 404/409 are final)."""
        try:
            self.reporter.report(report)
            a, code = report.allocation_id, report.exit_code
            log.info("allocation %d node %d: reported exit %d", a, report.node_rank, code)
        except ApiError as exc:
            log.warning("exit report for allocation %d refused: %s", report.allocation_id, exc)
            if is_retryable_status(exc.status):
                return False
        except Exception as exc:  # the server unreachable past the retries: sent again on a later answer
            log.warning("exit report for allocation %d not delivered: %s", report.allocation_id, exc)
            return False
        return True

    def forget(self, runner: NodeRunner, undelivered: ExitReport | None = None) -> None:
        """`runner` ended; `undelivered` is its exit report when the server did not take it."""
        with self._lock:
            for key, value in list(self._runners.items()):
                if value is runner:
                    del self._runners[key]
                    self._ended[key] = undelivered

    def _heartbeat_loop(self) -> None:
        while not self.stopping.wait(self.config.heartbeat_interval):
            try:
                self.client.heartbeat(self.agent_id)
            except ApiError as exc:
                if exc.status in (404, 409):  # declared lost, or the database forgot us
                    log.warning("%s; registering again", exc.message)
                    self.register()
            except httpx.TransportError as exc:
                log.warning("heartbeat failed: %s", exc)

    def reconcile(self, assignments: list[Assignment]) -> None:
        wanted = {(a.allocation_id, a.node_rank): a for a in assignments}
        with self._lock:
            for key in self._ended.keys() - wanted.keys():
                del self._ended[key]  # the server has its exit: it lists the node no more
            for key, runner in list(self._runners.items()):
                runner.update(wanted.get(key))
            for key, assignment in wanted.items():
                if key in self._ended:
                    if (undelivered := self._ended[key]) is not None:
                        self._ended[key] = None  # one delivery at a time
                        threading.Thread(target=self._deliver_exit, args=(key, undelivered), daemon=True).start()
                elif key not in self._runners and assignment.desired == "run":
                    runner = NodeRunner(self, assignment)
                    self._runners[key] = runner
                    runner.start()
                elif key not in self._runners:
                    # Told to stop a node we are not running (we restarted): report it gone.
                    threading.Thread(target=self._report_absent, args=(assignment,), daemon=True).start()

    def _deliver_exit(self, key: tuple[int, int], report: ExitReport) -> None:
        if not self.report_exit(report):
            with self._lock:
                if key in self._ended:
                    self._ended[key] = report

    def _report_absent(self, a: Assignment) -> None:
        try:
            self.reporter.report(
                ExitReport(
                    kind="exit",
                    allocation_id=a.allocation_id,
                    node_rank=a.node_rank,
                    exit_code=-9,
                    reason="not running here",
                )
            )
        except ApiError as exc:
            log.warning("could not report absent node: %s", exc)

    def run(self) -> None:
        self.sweep_old_node_dirs()
        self.environments.sweep()
        threading.Thread(target=self.environments.prepare, name="env-prepare", daemon=True).start()
        self.register()
        self.forkserver.start()
        self.shipper.start()
        self.reporter.start()
        threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True).start()
        version = ""
        while not self.stopping.is_set():
            try:
                # up to a tenth shorter, at random: agents that polled together (a cluster's fill,
                # a server restart) come back spread out, not all in the same instant each time
                wait = self.config.poll_seconds * random.uniform(0.9, 1.0)
                work = self.client.agent_work(self.agent_id, version, wait=wait)
            except httpx.TransportError as exc:
                log.warning("cannot reach the server (%s); retrying", exc)
                self.stopping.wait(1.0)
                continue
            except ApiError as exc:
                if exc.status == 404:
                    self.register()
                    continue
                log.warning("work poll refused: %s", exc)
                self.stopping.wait(1.0)
                continue
            version = work.version
            self.reconcile(work.assignments)

    def shutdown(self) -> None:
        """Stop every node this agent runs (SIGTERM, then SIGKILL) and end the loops."""
        self.stopping.set()
        with self._lock:
            runners = list(self._runners.values())
        for runner in runners:
            runner.update(None)
        for runner in runners:
            runner.join(timeout=self.config.kill_grace + 5)
        self.forkserver.close()


@dataclass(frozen=True)
class JobUser:
    """An OS user a node runs as: `popen_args` for its processes, `own` for its folder. No uid:
    the agent's own user."""

    uid: int | None = None
    gid: int | None = None

    def popen_args(self) -> dict[str, Any]:
        if self.uid is None:
            return {}
        return {"user": self.uid, "group": self.gid, "extra_groups": []}

    def own(self, root: Path) -> None:
        """Give `root` and everything in it to this user (the agent unpacked it as its own)."""
        if self.uid is None:
            return
        gid = self.gid if self.gid is not None else -1
        os.chown(root, self.uid, gid)
        for folder, dirs, files in os.walk(root):
            for name in dirs + files:
                os.chown(os.path.join(folder, name), self.uid, gid, follow_symlinks=False)


class JobUsers:
    """Who nodes run as (`--run-as`): the agent's user; one named user for every node (jobs cannot
    read the agent's token, but can read each other's processes); or a uid range "FIRST-LAST",
    each running node taking a uid of its own (jobs cannot read each other either)."""

    def __init__(self, users: list[JobUser], shared: bool) -> None:
        self._free = users
        self._shared = shared
        self._lock = threading.Lock()

    @classmethod
    def parse(cls, run_as: str | None) -> JobUsers:
        if run_as is None:
            return cls([JobUser()], shared=True)
        if os.geteuid() != 0:
            raise SystemExit(f"--run-as {run_as} needs the agent to run as root (it switches users for each job)")
        first, dash, last = run_as.partition("-")
        if dash and first.isdigit() and last.isdigit() and 0 < int(first) <= int(last):
            return cls([JobUser(uid, uid) for uid in range(int(first), int(last) + 1)], shared=False)
        try:
            entry = pwd.getpwuid(int(run_as)) if run_as.isdigit() else pwd.getpwnam(run_as)
        except KeyError as exc:
            raise SystemExit(
                f"--run-as {run_as}: no such user; create it, or give a uid range like 20000-20063"
            ) from exc
        return cls([JobUser(entry.pw_uid, entry.pw_gid)], shared=True)

    @property
    def switching(self) -> bool:
        return self._free[0].uid is not None if self._shared else True

    def take(self) -> JobUser:
        with self._lock:
            if self._shared:
                return self._free[0]
            if not self._free:
                raise RuntimeError("every uid of --run-as runs a node already; give the agent a larger range")
            return self._free.pop(0)

    def give_back(self, user: JobUser) -> None:
        if not self._shared:
            with self._lock:
                self._free.append(user)
