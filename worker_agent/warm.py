"""A torchrun that has already paid for Python's start and `import torch`, waiting for its command.

A fresh torchrun spends ~1.5-2 s on this machine starting Python and importing torch before it
starts a single rank, on every start and every restart (bench/RESULTS.md). The agent keeps such
processes waiting on their stdin; a node launch hands one a JSON line (`args`, `env`, `cwd`) and
it runs `python -m torch.distributed.run *args` in that directory with exactly that environment,
so its ranks (new processes that torchrun spawns) see nothing of the agent's.

Two wait by default: a job's start takes one, and the other is there for its restart. The agent
tops them up when it starts and once it has been idle for a few seconds, never while a node runs
there (an import costs ~1.5 s of CPU that ranks would lose; measured: topping up right after a
restart made it ~1.3 s slower on 2 cores). Each costs ~220 MiB of memory while it waits, no CPU.

Contract (parent side, `WarmTorchrun`): `take()` returns a started process or None, never
raises; the caller starts a cold torchrun on None. `prime()` never waits for an import. A
waiting process exits when the agent's end of its stdin closes, so an agent killed with SIGKILL
leaves no warm process behind. Thread-safe.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import runpy
import subprocess
import sys
import threading
import traceback
import warnings
from pathlib import Path

log = logging.getLogger("phalanx.agent")
TORCHRUN_MODULE = "torch.distributed.run"


class WarmTorchrun:
    """Keeps up to `size` waiting torchruns; `prime()` tops them up, `take()` hands one a command."""

    def __init__(self, base_env: dict[str, str], cwd: Path, size: int = 2) -> None:
        # The agent's own PHALANX_* settings stay out of it, as they stay out of the ranks.
        self._env = {k: v for k, v in base_env.items() if not k.startswith("PHALANX_")}
        self._cwd = cwd
        self._size = size
        self._lock = threading.Lock()
        self._waiting: list[subprocess.Popen[bytes]] = []  # oldest first: the likeliest to be ready
        self._closed = False

    def prime(self) -> None:
        with self._lock:
            for dead in [p for p in self._waiting if p.poll() is not None]:
                self._waiting.remove(dead)
                _reap(dead)
            while not self._closed and len(self._waiting) < self._size:
                try:
                    self._cwd.mkdir(parents=True, exist_ok=True)
                    proc = subprocess.Popen(
                        [sys.executable, "-m", "worker_agent.warm"],
                        env=self._env,
                        cwd=self._cwd,
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        start_new_session=True,  # like a cold torchrun: stop() walks its tree
                    )
                except OSError as exc:
                    log.warning("cannot start a warm torchrun (%s); nodes start cold", exc)
                    return
                self._waiting.append(proc)

    def take(self, args: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen[bytes] | None:
        """A waiting process, now running torchrun with `args`; None if none is left."""
        command = json.dumps({"args": args, "env": env, "cwd": str(cwd)}).encode() + b"\n"
        while True:
            with self._lock:
                if not self._waiting:
                    return None
                proc = self._waiting.pop(0)
            if proc.poll() is None and proc.stdin is not None:
                try:
                    proc.stdin.write(command)
                    proc.stdin.close()
                    proc.stdin = None  # as if started without one: communicate() must not flush it
                    return proc
                except OSError:  # it died between poll() and the write
                    pass
            _reap(proc)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            procs, self._waiting = self._waiting, []
        for proc in procs:
            _reap(proc)


def _reap(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(OSError):
        proc.kill()
    proc.wait()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()


def main() -> None:
    """The waiting process: import torchrun, read one command, become that torchrun."""
    import torch.distributed.run  # noqa: F401 - the whole point: paid for before the command arrives

    line = sys.stdin.buffer.readline()
    if not line:  # the agent closed our stdin without a command: it is shutting down or gone
        return
    command = json.loads(line)
    os.chdir(command["cwd"])
    os.environ.clear()
    os.environ.update(command["env"])
    sys.argv = [TORCHRUN_MODULE, *command["args"]]
    # Exactly `python -m torch.distributed.run ...`: the module runs again as __main__ (its imports
    # are cached), with its own exit code and error reporting.
    # (runpy warns that the module was imported already: by design here, and noise in job logs)
    warnings.filterwarnings("ignore", message=".*found in sys.modules", category=RuntimeWarning)
    code = 0
    try:
        runpy.run_module(TORCHRUN_MODULE, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:  # as an uncaught exception would: the traceback, then exit status 1
        traceback.print_exc()
        code = 1
    # torchrun is done and its ranks are gone: skip the interpreter's teardown of torch (~0.3 s
    # here), because the agent reports the node's exit, and a restart starts, only after it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
