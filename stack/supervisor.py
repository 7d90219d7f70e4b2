"""One supervisor for Phalanx's process trees: `phalanx up` and `demo`, the tests' stacks, the benchmarks.

Contract:

- `spawn(name, argv)` starts a child in a session of its own, stdin from /dev/null, stdout and
  stderr appended to `<logs>/<name>.log`. Its own session: a terminal's signals (Ctrl-C, the
  hangup of a closed window) reach only the supervisor, which stops the children in order
  (agents before the server they report to) instead of every process racing to die at once.
- On Linux each child gets `PR_SET_PDEATHSIG` (SIGTERM by default: our components stop their
  own workers on it): when the supervising process dies, even by SIGKILL, the kernel signals the
  child. The signal fires when the *thread* that spawned the child ends, not the process: spawn
  from the main thread or from a thread that lives as long as the children.
- `stop(name)`: SIGTERM (or the signal given), SIGKILL after `grace` seconds; then whatever of
  the child's process tree outlived it gets `descendant_grace` seconds and SIGKILL.
- `close(order)`: stops every child, those named in `order` first, then the rest newest first.
  Idempotent.
- As a context manager (`with Supervisor(...) as s:`) it turns SIGHUP, SIGINT and SIGTERM into
  `Stopped` (a KeyboardInterrupt) raised in the main thread, and on the way out closes every
  child and restores the previous handlers. A second signal while closing kills what is left at
  once instead of waiting out the grace periods. A signal ignored when the handlers are installed
  (`nohup`, `cmd &` in a script) stays ignored. From another thread no handler is installed.
- `check()` raises `ChildExited` for a child that exited on its own; `wait_until()` polls a
  predicate and checks the children between polls; `wait_exit()` blocks until a child exits.

Not thread-safe: one thread drives a supervisor.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, TypeVar

import psutil

STOP_SIGNALS = (signal.SIGHUP, signal.SIGINT, signal.SIGTERM)
_PR_SET_PDEATHSIG = 1
T = TypeVar("T")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (another process may take it before it is used)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


class SupervisorError(RuntimeError):
    """A supervised child died, or what a caller waited for did not happen in time."""


class ChildExited(SupervisorError):
    def __init__(self, name: str, returncode: int, log: Path) -> None:
        super().__init__(f"the {name} process exited with code {returncode}; see {log}")
        self.name = name
        self.returncode = returncode
        self.log = log


class WaitTimedOut(SupervisorError):
    pass


class Stopped(KeyboardInterrupt):
    """SIGHUP, SIGINT or SIGTERM arrived: a KeyboardInterrupt, so that every signal that means
    "stop" takes the path Ctrl-C takes."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _load_prctl() -> Callable[..., int] | None:
    """libc's prctl, looked up once here in the parent: a child between fork and exec should do
    as little as possible (no imports, no dlopen)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


_PRCTL = _load_prctl()


def die_with_parent(death_signal: int) -> Callable[[], None] | None:
    """A `preexec_fn` that makes the child receive `death_signal` when the spawning thread dies;
    None where the platform has no PR_SET_PDEATHSIG."""
    if _PRCTL is None:
        return None
    prctl, parent = _PRCTL, os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, death_signal, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl ran: no signal will come
            os._exit(128 + death_signal)

    return preexec


def running(proc: psutil.Process) -> bool:
    """Alive and not a zombie: a zombie runs nothing, and under an init that does not reap (some
    containers') it never goes away."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_gone(procs: Iterable[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait up to `timeout` s for `procs` to end; the ones still running then."""
    deadline = time.monotonic() + timeout
    alive = [p for p in procs if running(p)]
    while alive:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        _, alive = psutil.wait_procs(alive, timeout=min(0.2, remaining))
        alive = [p for p in alive if running(p)]
    return alive


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


@dataclass
class Child:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path


class Supervisor:
    """Child processes, each with a log file; stopped in order, and dying with their parent."""

    def __init__(
        self,
        logs: Path,
        env: Mapping[str, str] | None = None,
        grace: float = 20.0,
        descendant_grace: float = 5.0,
        death_signal: int = signal.SIGTERM,
    ) -> None:
        self.logs = logs
        self.env = dict(os.environ if env is None else env)
        self.grace = grace
        self.descendant_grace = descendant_grace
        self.death_signal = death_signal
        self._children: dict[str, Child] = {}
        self._closing = False
        self._hurry = False  # a second stop signal while closing: no more grace periods
        self._previous_handlers: dict[int, Any] = {}
        logs.mkdir(parents=True, exist_ok=True)

    # --- starting and watching ---------------------------------------------------------------------

    def spawn(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start `argv` as child `name` (a name stopped before may be used again)."""
        if name in self._children:
            raise ValueError(f"a child named {name!r} is already supervised")
        log = self.logs / f"{name}.log"
        with open(log, "ab") as out:
            popen = subprocess.Popen(
                list(argv),
                env=self.env if env is None else dict(env),
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                # the one thing a preexec_fn does here is a prctl, looked up before the fork
                preexec_fn=die_with_parent(self.death_signal),
            )
        self._children[name] = Child(name, popen, log)
        return popen

    @property
    def children(self) -> dict[str, subprocess.Popen[bytes]]:
        """The supervised children by name, oldest first."""
        return {name: child.popen for name, child in self._children.items()}

    def pids(self) -> list[int]:
        return [child.popen.pid for child in self._children.values()]

    def log_path(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def log(self, name: str) -> str:
        path = self.log_path(name)
        return path.read_text(errors="replace") if path.exists() else ""

    def check(self) -> None:
        """Raise ChildExited for the first child that exited."""
        for child in self._children.values():
            code = child.popen.poll()
            if code is not None:
                raise ChildExited(child.name, code, child.log)

    def wait_until(self, predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.1) -> T:
        """Poll `predicate` until it returns something truthy, and return that; raise ChildExited
        when a child dies meanwhile, WaitTimedOut (naming `what`) after `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            self.check()
            if time.monotonic() > deadline:
                raise WaitTimedOut(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(interval)

    def wait_exit(self, timeout: float | None = None) -> None:
        """Block until a child exits (raise ChildExited) or `timeout` s pass (return)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.check()
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return
            self._await_any_exit(remaining)

    def _await_any_exit(self, timeout: float | None) -> None:
        """Sleep until some child may have exited: a pidfd turns readable when its process ends
        (Linux 5.3+); elsewhere poll every half second."""
        fds: list[int] = []
        try:
            for child in self._children.values():
                fds.append(os.pidfd_open(child.popen.pid))
        except (AttributeError, OSError):  # no pidfd_open here, or a child already reaped
            for fd in fds:
                os.close(fd)
            time.sleep(0.5 if timeout is None else min(0.5, timeout))
            return
        try:
            if fds:
                select.select(fds, [], [], timeout)
            else:
                time.sleep(0.5 if timeout is None else min(0.5, timeout))
        finally:
            for fd in fds:
                os.close(fd)

    # --- stopping ----------------------------------------------------------------------------------

    def stop(self, name: str, sig: int = signal.SIGTERM, grace: float | None = None) -> int:
        """Signal child `name`; SIGKILL it after `grace` s (default: the supervisor's); then end
        what is left of its process tree. Its exit code (negative: the signal that ended it)."""
        child = self._children.pop(name)
        tree: list[psutil.Process] = []
        if child.popen.poll() is None:  # not reaped, so its pid cannot belong to another process yet
            tree = descendants(child.popen.pid)
            child.popen.send_signal(sig)
        self._await(child.popen, self.grace if grace is None else grace)
        if child.popen.poll() is None:
            child.popen.kill()
            child.popen.wait()
        # Whatever it left behind (a torchrun tree after a SIGKILL, say) goes too.
        for leftover in wait_gone(tree, 0 if self._hurry else self.descendant_grace):
            with contextlib.suppress(psutil.Error):
                leftover.kill()
        return child.popen.returncode

    def _await(self, popen: subprocess.Popen[bytes], grace: float) -> None:
        deadline = time.monotonic() + grace
        while popen.poll() is None and not self._hurry:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=min(0.2, remaining))

    def close(self, order: Iterable[str] = ()) -> None:
        """Stop every child: those named in `order` first, in that order, then the rest newest
        first (started last, they may depend on the older ones)."""
        self._closing = True
        try:
            first = [name for name in order if name in self._children]
            rest = [name for name in reversed(self._children) if name not in first]
            for name in [*first, *rest]:
                self.stop(name)
        finally:
            self._closing = False
            self._hurry = False

    # --- signals -----------------------------------------------------------------------------------

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self._closing:
            self._hurry = True  # asked twice: stop waiting for grace periods
            return
        raise Stopped(signum)

    def __enter__(self) -> Supervisor:
        if threading.current_thread() is threading.main_thread():
            try:
                for sig in STOP_SIGNALS:
                    if signal.getsignal(sig) is signal.SIG_IGN:
                        continue  # nohup, or a background job of a script: the user chose
                    self._previous_handlers[sig] = signal.signal(sig, self._on_signal)
            except BaseException:
                self._restore_handlers()
                raise
        return self

    def _restore_handlers(self) -> None:
        while self._previous_handlers:
            sig, handler = self._previous_handlers.popitem()
            signal.signal(sig, handler)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self.close()
        finally:
            self._restore_handlers()
