"""A fork-server: one process that paid for Python's start and `import torch` once, and forks a
fresh torchrun for every node start and every restart.

A cold torchrun spends ~1.5-2 s on this machine starting Python and importing torch before it
starts a single rank. A pool of single-use warm processes (what the agent had before) must be
topped up, which costs that import again each time, on the cores the ranks train on; back-to-back
jobs and a study's trials drained it and started cold. A fork costs a few milliseconds and no
import, so every start is warm, whatever came before it.

The server forks only from its one thread (a fork copies no other thread's state), at the agent's
request, over a Unix socketpair. A launch carries the command line, the environment, the working
directory and the user, plus the write ends of the child's stdout and stderr pipes (SCM_RIGHTS): the
child writes straight into the agent's pipes, so no output passes through the server. The child
starts a session of its own (stopping walks its process tree, as for a cold torchrun), switches to
the job's user if one is given, and runs `python -m torch.distributed.run ARGS` in-process with
exactly the given environment, so its ranks (which torchrun starts as new processes) see nothing of
the agent's. The server reports each child's pid at once and its exit code when it ends.

Wire: each message is a 4-byte big-endian length and that much JSON.
    agent -> server  {"id": n, "args": [...], "env": {...}, "cwd": "...", "uid": int|null, "gid": int|null}
                     with two fds: the child's stdout and stderr
    server -> agent  {"ready": true}                 once torch is imported
                     {"id": n, "pid": p}             the child was forked
                     {"id": n, "error": "..."}       it could not be
                     {"pid": p, "exit": code}        it ended (negative: killed by that signal)
    rank shim -> server (abstract socket PHALANX_FORK_SOCKET; see rank_shim.py)
                     {"argv": [...], "env": {...}, "cwd": "..."} with three fds: stdin, stdout, stderr
                     {"signal": n}                   for its rank
    server -> shim   {"pid": p} | {"error": "..."}, then {"exit": code}

Contract (agent side, `ForkServer`): `launch()` returns a started `ForkedProcess` or None, never
raises; on None the caller starts a cold torchrun. The server exits when the agent's end of the
socket closes, so an agent killed with SIGKILL leaves no server behind (children it forked run on,
as cold torchruns would; the agent's stop walks their trees). Thread-safe.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import secrets
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import traceback
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import IO, Any, NoReturn

log = logging.getLogger("phalanx.agent")
TORCHRUN_MODULE = "torch.distributed.run"
READY_TIMEOUT_S = 30.0  # a launch waits this long for the server's import of torch, then starts cold
_HEADER = struct.Struct(">I")
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


def _send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    body = json.dumps(message).encode()
    data = _HEADER.pack(len(body)) + body
    sent = socket.send_fds(sock, [data], fds) if fds else sock.send(data)
    sock.sendall(data[sent:])


def _receive(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """One message and the fds that came with it; None at end of stream."""
    head, fds, _flags, _addr = socket.recv_fds(sock, _HEADER.size, 3)
    if not head:
        return None
    while len(head) < _HEADER.size:
        more = sock.recv(_HEADER.size - len(head))
        if not more:
            return None
        head += more
    (size,) = _HEADER.unpack(head)
    if size > MAX_MESSAGE_BYTES:
        raise ValueError(f"a message of {size} bytes")
    body = b""
    while len(body) < size:
        chunk = sock.recv(size - len(body))
        if not chunk:
            return None
        body += chunk
    return json.loads(body), list(fds)


class ForkedProcess:
    """A torchrun the server forked, as the launcher uses a Popen: pid, stdout, stderr, wait, poll."""

    def __init__(self, pid: int, stdout: IO[bytes], stderr: IO[bytes]) -> None:
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None
        self._ended = threading.Event()

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._ended.set()

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired("torchrun", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def poll(self) -> int | None:
        return self.returncode


class _Connection:
    """One server process and what the agent awaits from it."""

    def __init__(self, sock: socket.socket, proc: subprocess.Popen[bytes], rank_address: str) -> None:
        self.sock = sock
        self.proc = proc
        self.rank_address = rank_address
        self.forks_ranks = False  # the server listens for rank shims (it says so when ready)
        self.ready = threading.Event()
        self.lock = threading.Lock()  # one message at a time on the socket; the maps below
        self.pending: dict[int, Future[ForkedProcess]] = {}
        self.children: dict[int, ForkedProcess] = {}
        self.next_id = 0


class ForkServer:
    """The agent's side: starts the server, asks it for torchruns, learns how they ended."""

    def __init__(self, base_env: dict[str, str], cwd: Path) -> None:
        # The agent's own PHALANX_* settings stay out of it, as they stay out of the ranks. Its
        # streams are unbuffered, as a rank's are (PYTHONUNBUFFERED): a forked child keeps them.
        self._env = {k: v for k, v in base_env.items() if not k.startswith("PHALANX_")}
        self._env["PYTHONUNBUFFERED"] = "1"
        self._cwd = cwd
        self._lock = threading.Lock()
        self._conn: _Connection | None = None
        self._closed = False

    @property
    def _proc(self) -> subprocess.Popen[bytes] | None:
        return self._conn.proc if self._conn is not None else None

    def start(self) -> None:
        """Start the server (it imports torch in the background); nothing if it runs already."""
        with self._lock:
            if self._closed or (self._conn is not None and self._conn.proc.poll() is None):
                return
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            rank_address = f"phalanx-fork-{os.getpid()}-{secrets.token_hex(8)}"
            try:
                self._cwd.mkdir(parents=True, exist_ok=True)
                proc = subprocess.Popen(
                    [sys.executable, "-m", "worker_agent.forkserver", str(theirs.fileno()), rank_address],
                    env=self._env,
                    cwd=self._cwd,
                    pass_fds=[theirs.fileno()],
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,  # the agent's terminal's Ctrl-C is the agent's to handle
                )
            except OSError as exc:
                log.warning("cannot start the fork-server (%s); nodes start cold", exc)
                ours.close()
                return
            finally:
                theirs.close()
            self._conn = _Connection(ours, proc, rank_address)
            threading.Thread(target=self._read, args=(self._conn,), name="forkserver", daemon=True).start()

    def rank_socket(self) -> str | None:
        """Where a rank shim asks this server for its rank (PHALANX_FORK_SOCKET); None: it cannot."""
        self.start()
        with self._lock:
            conn = self._conn if not self._closed else None
        if conn is None or not conn.ready.wait(READY_TIMEOUT_S) or not conn.forks_ranks:
            return None
        return conn.rank_address

    def launch(
        self, args: list[str], env: dict[str, str], cwd: Path, uid: int | None = None, gid: int | None = None
    ) -> ForkedProcess | None:
        """A torchrun with `args`, forked from the server; None if the server cannot fork one."""
        self.start()
        with self._lock:
            conn = self._conn if not self._closed else None
        if conn is None or not conn.ready.wait(READY_TIMEOUT_S):
            return None
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        forked: Future[ForkedProcess] = Future()
        with conn.lock:
            conn.next_id += 1
            request_id = conn.next_id
            conn.pending[request_id] = forked
        message = {"id": request_id, "args": args, "env": env, "cwd": str(cwd), "uid": uid, "gid": gid}
        try:
            with conn.lock:
                _send(conn.sock, message, [out_w, err_w])
            child = forked.result(timeout=READY_TIMEOUT_S)
        except Exception as exc:  # the server died or refused: a cold start instead
            log.warning("the fork-server could not start a torchrun (%s); starting it cold", exc)
            for fd in (out_r, err_r):
                os.close(fd)
            return None
        finally:
            os.close(out_w)
            os.close(err_w)
            with conn.lock:
                conn.pending.pop(request_id, None)
        child.stdout = os.fdopen(out_r, "rb")
        child.stderr = os.fdopen(err_r, "rb")
        return child

    def _read(self, conn: _Connection) -> None:
        try:
            while (received := _receive(conn.sock)) is not None:
                message, _fds = received
                if message.get("ready"):
                    conn.forks_ranks = bool(message.get("ranks"))
                    conn.ready.set()
                elif "exit" in message:
                    with conn.lock:
                        ended = conn.children.pop(message["pid"], None)
                    if ended is not None:
                        ended._exited(int(message["exit"]))
                elif "pid" in message:
                    child = ForkedProcess(message["pid"], _NO_STREAM, _NO_STREAM)
                    with conn.lock:
                        # registered before its exit can be read: this thread reads both, in order
                        conn.children[child.pid] = child
                        future = conn.pending.get(message["id"])
                    if future is not None:
                        future.set_result(child)
                elif "error" in message:
                    with conn.lock:
                        future = conn.pending.get(message["id"])
                    if future is not None:
                        future.set_exception(RuntimeError(message["error"]))
        except (OSError, ValueError) as exc:
            log.warning("the fork-server's connection broke: %s", exc)
        self._lost(conn)

    def _lost(self, conn: _Connection) -> None:
        """The server is gone: a later launch starts a new one; what it forked is watched from here."""
        with conn.lock:
            orphans, conn.children = list(conn.children.values()), {}
            pending, conn.pending = list(conn.pending.values()), {}
        for future in pending:
            if not future.done():
                future.set_exception(RuntimeError("the fork-server exited"))
        for child in orphans:  # no exit code can reach us now: report it as killed once it is gone
            threading.Thread(target=_await_gone, args=(child,), daemon=True).start()
        with contextlib.suppress(OSError):
            conn.sock.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            conn.proc.wait(timeout=10)  # reaped, so that a new launch sees it gone

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conn = self._conn
        if conn is None:
            return
        with contextlib.suppress(OSError):
            conn.sock.shutdown(socket.SHUT_RDWR)
        try:
            conn.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            conn.proc.kill()
            conn.proc.wait()


class _NoStream:
    """Placeholder until `launch` hands the child its pipes' read ends."""

    def readline(self, _size: int = -1) -> bytes:
        return b""


_NO_STREAM: Any = _NoStream()


def _await_gone(child: ForkedProcess) -> None:
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        psutil.Process(child.pid).wait()
    child._exited(-signal.SIGKILL)


# --- the server process ----------------------------------------------------------------------------


def serve(sock: socket.socket, rank_address: str | None = None) -> None:
    import torch.distributed.run  # noqa: F401 - the whole point: paid for once, before any request

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ, "agent")
    selector.register(wake_r, selectors.EVENT_READ, "child")
    listener = _rank_listener(rank_address)
    if listener is not None:
        selector.register(listener, selectors.EVENT_READ, "listener")
    ranks: dict[int, socket.socket] = {}  # a forked rank's pid -> its shim's connection
    _send(sock, {"ready": True, "ranks": listener is not None})
    while True:
        for key, _ in selector.select():
            if key.data == "child":
                os.read(wake_r, 4096)
                _reap(sock, ranks, selector)
            elif key.data == "listener":
                assert listener is not None
                with contextlib.suppress(OSError):
                    conn, _ = listener.accept()
                    selector.register(conn, selectors.EVENT_READ, "shim")
            elif key.data == "shim":
                shim: socket.socket = key.fileobj  # type: ignore[assignment]
                try:
                    _shim_request(shim, ranks, selector)
                except (OSError, ValueError):  # that shim went away mid-request: its problem only
                    _drop(shim, ranks, selector)
            else:
                received = _receive(sock)
                if received is None:  # the agent is gone
                    return
                message, fds = received
                _fork(sock, message, fds)


def _rank_listener(address: str | None) -> socket.socket | None:
    """Where rank shims ask for a rank: an abstract Unix socket (this network namespace only)."""
    if not address:
        return None
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind("\0" + address)
        listener.listen(64)
    except OSError:
        listener.close()
        return None
    return listener


def _reap(sock: socket.socket, ranks: dict[int, socket.socket], selector: selectors.BaseSelector) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        shim = ranks.pop(pid, None)
        if shim is None:
            _send(sock, {"pid": pid, "exit": code})
            continue
        with contextlib.suppress(OSError):
            _send(shim, {"exit": code})
        with contextlib.suppress(KeyError, ValueError):
            selector.unregister(shim)
        shim.close()


def _shim_request(conn: socket.socket, ranks: dict[int, socket.socket], selector: selectors.BaseSelector) -> None:
    """A rank shim asks for its rank, or relays a signal to it, or hangs up: its rank dies with it."""
    try:
        received = _receive(conn)
    except (OSError, ValueError):
        received = None
    if received is None:  # the shim is gone (torchrun killed it): so is its rank, and its group
        _drop(conn, ranks, selector)
        return
    message, fds = received
    if message.get("signal") is not None:
        for pid, shim in ranks.items():
            if shim is conn:
                with contextlib.suppress(OSError):
                    os.kill(pid, int(message["signal"]))
        return
    uid, gid = _peer(conn)
    if uid != os.getuid() and os.getuid() != 0:
        _refuse(conn, fds, {"error": "this server cannot run a rank as another user"})
        return
    if len(fds) != 3:
        _refuse(conn, fds, {"error": "a rank needs its stdin, stdout and stderr"})
        return
    try:
        pid = _fork_frozen()
    except OSError as exc:
        _refuse(conn, fds, {"error": f"fork failed: {exc}"})
        return
    if pid == 0:
        _rank_child(message, fds, uid, gid)  # never returns
    for fd in fds:
        os.close(fd)
    ranks[pid] = conn
    _send(conn, {"pid": pid})


def _fork_frozen() -> int:
    """os.fork() with every object alive now moved out of the garbage collector's reach.

    A child shares the server's memory (torch's modules: ~100k objects) copy-on-write. Its first
    full collection would write to every one of those objects' headers, copying every page that
    holds them: a ~170 ms stall, measured mid-run in a forked rank's checkpoint step. Frozen, they
    are never traversed: no copies, and shorter collections than a fresh interpreter's. They are
    the imported modules, alive for the process's life anyway."""
    gc.freeze()
    return os.fork()


def _refuse(sock: socket.socket, fds: list[int], answer: dict[str, Any]) -> None:
    """Answer a request that forks nothing: the fds it brought are closed here."""
    for fd in fds:
        os.close(fd)
    _send(sock, answer)


def _drop(conn: socket.socket, ranks: dict[int, socket.socket], selector: selectors.BaseSelector) -> None:
    """A shim's connection closed: its rank (and the rank's process group) is killed, and reaped
    later like any child."""
    for pid, shim in list(ranks.items()):
        if shim is conn:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(KeyError, ValueError):
        selector.unregister(conn)
    conn.close()


def _peer(conn: socket.socket) -> tuple[int, int]:
    """The uid and gid of the process at the other end: a rank runs as whoever asked for it."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, gid = struct.unpack("3i", creds)
    return uid, gid


def _fork(sock: socket.socket, message: dict[str, Any], fds: list[int]) -> None:
    if len(fds) != 2:
        _refuse(sock, fds, {"id": message.get("id"), "error": "a launch needs its stdout and stderr"})
        return
    try:
        pid = _fork_frozen()
    except OSError as exc:
        _refuse(sock, fds, {"id": message["id"], "error": f"fork failed: {exc}"})
        return
    if pid == 0:
        devnull = os.open(os.devnull, os.O_RDONLY)
        uid, gid = message.get("uid"), message.get("gid")
        _become([devnull, *fds], message["cwd"], message["env"], uid, gid if gid is not None else uid)
        _exit_now(_run_torchrun(message["args"]))
    for fd in fds:
        os.close(fd)
    _send(sock, {"id": message["id"], "pid": pid})


def _become(stdio: list[int], cwd: str, env: dict[str, str], uid: int | None, gid: int | None) -> None:
    """In a forked child: a session of its own, `stdio` as fds 0-2 and no other fd of the server's,
    the given user, working directory and environment."""
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        for target, fd in enumerate(stdio):
            os.dup2(fd, target)
        os.closerange(3, 65536)
        if uid is not None and uid != os.getuid():  # the job's user; the server runs as root then
            os.setgroups([])
            os.setgid(gid if gid is not None else uid)
            os.setuid(uid)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
    except BaseException:
        traceback.print_exc()
        _exit_now(1)


def _exit_now(code: int) -> NoReturn:
    """End a forked child without the interpreter's teardown of torch (~0.3 s here): the agent
    reports the node's exit, and a restart starts, only after it. Exit handlers still run."""
    import atexit

    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _rank_child(message: dict[str, Any], fds: list[int], uid: int, gid: int) -> NoReturn:
    """A rank: the shim's `python ARGS`, run in this process, which imported torch already."""
    import runpy

    env: dict[str, str] = message["env"]
    _become(fds, message["cwd"], env, uid, gid)
    code = 0
    try:
        threads = env.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:
            import torch

            # OpenMP read its settings when torch loaded here, under the agent's environment
            torch.set_num_threads(int(threads))
        extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        argv: list[str] = message["argv"]
        if argv[0] == "-m":
            sys.path[:1] = [os.getcwd(), *extra]
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.path[:1] = [os.path.dirname(os.path.abspath(argv[0])), *extra]
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # as an uncaught exception would: the traceback, then exit status 1
        traceback.print_exc()
        code = 1
    _exit_now(code)


def _run_torchrun(args: list[str]) -> int:
    """Exactly `python -m torch.distributed.run ARGS`: its exit code and its error reporting."""
    import runpy

    sys.argv = [TORCHRUN_MODULE, *args]
    # (runpy warns that the module was imported already: by design here, and noise in job logs)
    warnings.filterwarnings("ignore", message=".*found in sys.modules", category=RuntimeWarning)
    try:
        runpy.run_module(TORCHRUN_MODULE, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:  # as an uncaught exception would: the traceback, then exit status 1
        traceback.print_exc()
        return 1
    return 0


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    with contextlib.suppress(OSError, ValueError):  # the agent is gone, or sent what no agent sends
        serve(sock, sys.argv[2] if len(sys.argv) > 2 else None)


if __name__ == "__main__":
    main()
