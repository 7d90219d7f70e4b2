"""What torchrun starts as a rank when the agent's fork-server can fork it: `python -m
worker_agent.rank_shim ARGS` stands for `python ARGS`.

A rank's own start costs ~1.5-2 s here before the script's first line, mostly `import torch`. The
shim (a Python process that imports nothing heavy) asks the fork-server, at the abstract Unix
socket named by PHALANX_FORK_SOCKET, for a process forked from it, torch already imported, that
runs ARGS with the shim's stdin, stdout and stderr (passed with SCM_RIGHTS), environment and
working directory, as the shim's user (the server reads it from the socket: SO_PEERCRED). Then it
stands in for the rank: the signals it gets are relayed, and it exits as the rank did (with the
same code, or killed by the same signal). If the shim is killed, the server sees the connection
close and kills the rank's process group, so a rank never outlives what torchrun watches.

Anything else (no server, a refused request, `python -c ...` or interpreter options) runs the
real interpreter in the shim's place (exec): a cold rank, as before.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
from typing import NoReturn

from worker_agent.forkserver import _receive, _send

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)


def _cold(args: list[str]) -> NoReturn:
    os.execv(sys.executable, [sys.executable, *args])


def _forkable(args: list[str]) -> bool:
    """`script.py ...` or `-m module ...`: what a forked interpreter can run as `python` would."""
    if not args:
        return False
    if args[0] == "-m":
        return len(args) > 1
    return not args[0].startswith("-") and os.path.isfile(args[0])


def main() -> None:
    args = sys.argv[1:]
    address = os.environ.get("PHALANX_FORK_SOCKET")
    if not address or not _forkable(args):
        _cold(args)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect("\0" + address)
        request = {"argv": args, "env": dict(os.environ), "cwd": os.getcwd()}
        _send(conn, request, [0, 1, 2])
        answer = _receive(conn)
    except (OSError, ValueError):
        answer = None
    if answer is None or "pid" not in answer[0]:
        conn.close()
        _cold(args)

    def relay(signum: int, _frame: object) -> None:
        with contextlib.suppress(OSError):
            _send(conn, {"signal": signum})

    for signum in FORWARDED:
        signal.signal(signum, relay)
    ended = None
    while ended is None:
        try:
            ended = _receive(conn)
        except InterruptedError:
            continue
        except (OSError, ValueError):
            break
        if ended is None:
            break
    code = int(ended[0].get("exit", 1)) if ended is not None else 1
    if code < 0:  # killed by a signal: so is the shim, so that torchrun reports the same
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
