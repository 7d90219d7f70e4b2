"""The process supervisor (stack.supervisor) on small real processes: ordering, escalation, what
children leave behind, stop signals, and children that die with a SIGKILLed parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import psutil
import pytest

from stack.supervisor import ChildExited, Supervisor
from tests.processes import REPO, adopting_orphans, survivors, wait_for

PY = sys.executable
# A child that says it is ready once its SIGTERM handler is in place; on SIGTERM it appends its
# name to RECORD and exits, unless IGNORE_TERM is set (then it only notes "term" in its log).
POLITE_CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    def on_term(*_):
        if os.environ.get("IGNORE_TERM"):
            print("term", flush=True)
            return
        with open(os.environ["RECORD"], "a") as f:
            f.write(sys.argv[1] + " ")
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    print("ready", flush=True)
    while True:
        time.sleep(3600)
    """
)


def child(name: str) -> list[str]:
    return [PY, "-c", POLITE_CHILD, name]


@pytest.fixture
def supervisor(tmp_path: Path) -> Iterator[Supervisor]:
    sup = Supervisor(tmp_path / "logs", env={**os.environ, "RECORD": str(tmp_path / "record")}, grace=30.0)
    try:
        yield sup
    finally:
        sup.close()


def ready(sup: Supervisor, *names: str) -> None:
    """Until every named child has installed its SIGTERM handler (it prints "ready")."""
    wait_for(lambda: all("ready" in sup.log(name) for name in names), 30, f"{names} to install their handlers")


def test_children_log_to_their_file_and_check_names_the_one_that_exited(supervisor: Supervisor) -> None:
    supervisor.spawn("steady", ["sleep", "600"])
    supervisor.spawn("crasher", [PY, "-c", "import sys; print('boom', flush=True); sys.exit(3)"])
    with pytest.raises(ChildExited) as exited:
        supervisor.wait_exit(timeout=60)
    assert (exited.value.name, exited.value.returncode) == ("crasher", 3)
    assert str(supervisor.log_path("crasher")) in str(exited.value)
    assert "boom" in supervisor.log("crasher")
    with pytest.raises(ValueError, match="already supervised"):
        supervisor.spawn("steady", ["sleep", "600"])


def test_wait_exit_returns_after_its_timeout_while_every_child_runs(supervisor: Supervisor) -> None:
    supervisor.spawn("steady", ["sleep", "600"])
    supervisor.wait_exit(timeout=0.2)
    assert supervisor.children["steady"].poll() is None


def test_close_stops_the_named_children_first_then_the_newest_first(supervisor: Supervisor, tmp_path: Path) -> None:
    for name in ("server", "scheduler", "agent-a", "agent-b"):
        supervisor.spawn(name, child(name))
    ready(supervisor, "server", "scheduler", "agent-a", "agent-b")
    supervisor.close(order=["agent-a"])
    assert (tmp_path / "record").read_text().split() == ["agent-a", "agent-b", "scheduler", "server"]
    assert supervisor.children == {}
    supervisor.close()  # idempotent


def test_stop_kills_a_child_that_outlives_its_grace(supervisor: Supervisor) -> None:
    supervisor.spawn("stubborn", child("stubborn"), env={**supervisor.env, "IGNORE_TERM": "1"})
    supervisor.spawn("polite", ["sleep", "600"])
    ready(supervisor, "stubborn")
    assert supervisor.stop("stubborn", grace=0.5) == -signal.SIGKILL
    assert "term" in supervisor.log("stubborn")  # it was asked first
    assert supervisor.stop("polite") == -signal.SIGTERM


def test_stop_ends_what_the_child_left_behind(supervisor: Supervisor) -> None:
    # The child starts a grandchild in a session of its own (as the agent starts torchrun) and
    # dies at once on SIGKILL, before it could stop it.
    script = "import subprocess; p = subprocess.Popen(['sleep', '600'], start_new_session=True); "
    script += "print(p.pid, flush=True); p.wait()"
    with adopting_orphans():
        supervisor.spawn("parent", [PY, "-c", script])
        grandchild = int(wait_for(lambda: supervisor.log("parent").strip(), 30, "the grandchild's pid"))
        process = psutil.Process(grandchild)
        supervisor.stop("parent", signal.SIGKILL)
        assert survivors([process], timeout=30) == []


SUPERVISING = textwrap.dedent(
    """
    import signal, sys
    from pathlib import Path
    from stack.supervisor import Stopped, Supervisor
    logs = Path(sys.argv[1])
    try:
        with Supervisor(logs, grace=float(sys.argv[2])) as sup:
            sup.spawn("one", ["sleep", "600"])
            sup.spawn("two", sys.argv[3:])
            print(*sup.pids(), flush=True)
            sup.wait_exit()
    except Stopped as stopped:
        sys.exit(100 + stopped.signum)
    """
)


@contextmanager
def supervising(
    tmp_path: Path, grace: float, second: list[str], extra_env: dict[str, str] | None = None, **popen: object
) -> Iterator[tuple[subprocess.Popen[str], list[psutil.Process]]]:
    """A process supervising `sleep 600` and `second`; it and its two children, once started.
    Killed on the way out, whatever the test did."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.update(RECORD=str(tmp_path / "record"), **(extra_env or {}))
    argv = [PY, "-c", SUPERVISING, str(tmp_path / "logs"), str(grace), *second]
    children: list[psutil.Process] = []
    with subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True, **popen) as proc:  # type: ignore[call-overload]
        try:
            assert proc.stdout is not None
            pids = proc.stdout.readline().split()  # an event: it prints once both children exist
            assert len(pids) == 2, f"the supervising process printed {pids!r}"
            children = [psutil.Process(int(pid)) for pid in pids]
            yield proc, children
        finally:
            for process in [proc, *children]:
                with suppress(psutil.Error, ProcessLookupError):
                    process.kill()


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_stops_every_child(tmp_path: Path, signum: int) -> None:
    with supervising(tmp_path, 30.0, ["sleep", "600"]) as (proc, children):
        proc.send_signal(signum)
        assert proc.wait(timeout=60) == 100 + signum
        assert survivors(children, timeout=10) == []


def test_a_second_signal_while_closing_kills_at_once(tmp_path: Path) -> None:
    # "two" ignores SIGTERM: with a grace of 600 s only the second signal ends it in time.
    two_log = tmp_path / "logs" / "two.log"
    with supervising(tmp_path, 600.0, child("two"), extra_env={"IGNORE_TERM": "1"}) as (proc, children):
        wait_for(lambda: "ready" in two_log.read_text(), 30, "two to install its SIGTERM handler")
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: "term" in two_log.read_text(), 30, "the supervisor to ask two to stop")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 100 + signal.SIGTERM
        assert survivors(children, timeout=10) == []


def test_children_die_with_a_sigkilled_supervisor(tmp_path: Path) -> None:
    with adopting_orphans(), supervising(tmp_path, 30.0, ["sleep", "600"]) as (proc, children):
        proc.kill()
        proc.wait(timeout=30)
        assert survivors(children, timeout=30) == []


def test_a_signal_ignored_at_start_stays_ignored(tmp_path: Path) -> None:
    """`nohup phalanx up`: SIGHUP stays ignored; SIGTERM still stops the stack."""
    ignore_hup = {"preexec_fn": lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)}
    with supervising(tmp_path, 30.0, ["sleep", "600"], **ignore_hup) as (proc, children):
        proc.send_signal(signal.SIGHUP)
        proc.send_signal(signal.SIGTERM)  # both pending at once are delivered lowest number first
        assert proc.wait(timeout=60) == 100 + signal.SIGTERM
        assert survivors(children, timeout=10) == []
