"""`launcher: plain`: start the entrypoint once per slot with the standard variables, as torchrun
would, and nothing else: no elastic agent, no rendezvous of its own.

    python -m worker_agent.plain_launcher --nnodes N --node-rank R --nproc-per-node P
        --master-addr A --master-port M -- ENTRY...

Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, NODE_RANK, ROLE_RANK,
ROLE_WORLD_SIZE, MASTER_ADDR and MASTER_PORT: a script that builds its process group from
`env://`, `jax.distributed.initialize` given those, or anything following that convention runs
unchanged. The launcher speaks torchrun's dialect to the agent, so everything downstream (the
rank of each output line, the failure reason, stops and kills) is the same for both launchers:

- every line a rank prints is prefixed `[default<local rank>]:` (torchrun's `--tee=3`);
- when a rank fails, it logs `failed (exitcode: ...)`, stops the other ranks (SIGTERM, then
  SIGKILL after STOP_GRACE_S), prints a summary naming the rank under "Root Cause", exits 1;
- on SIGTERM (a stop) it waits for its ranks, which got the signal from the agent too (and the
  agent's SIGKILL after the job's grace), and exits 143 with no summary.

It imports nothing heavy: it starts in ~50 ms.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from typing import IO

STOP_GRACE_S = 10.0
POLL_S = 0.05


def _relay(stream: IO[bytes], prefix: bytes, out: IO[bytes], lock: threading.Lock) -> None:
    for line in iter(stream.readline, b""):
        with lock:
            out.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
            out.flush()
    stream.close()


def rank_env(base: dict[str, str], args: argparse.Namespace, local_rank: int) -> dict[str, str]:
    world_size = args.nnodes * args.nproc_per_node
    rank = args.node_rank * args.nproc_per_node + local_rank
    env = dict(base)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(args.nproc_per_node),
        GROUP_RANK=str(args.node_rank),
        NODE_RANK=str(args.node_rank),
        ROLE_RANK=str(rank),
        ROLE_WORLD_SIZE=str(world_size),
        MASTER_ADDR=args.master_addr,
        MASTER_PORT=str(args.master_port),
    )
    return env


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" not in argv:
        raise SystemExit("usage: plain_launcher OPTIONS -- ENTRY...")
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="plain_launcher")
    parser.add_argument("--nnodes", type=int, required=True)
    parser.add_argument("--node-rank", type=int, required=True)
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--master-addr", required=True)
    parser.add_argument("--master-port", type=int, required=True)
    args = parser.parse_args(argv[:split])
    entry = argv[split + 1 :]
    if not entry:
        raise SystemExit("plain_launcher: no entrypoint after --")
    return args, entry


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(POLL_S)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    args, entry = _parse(sys.argv[1:] if argv is None else argv)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    lock = threading.Lock()
    out, err = sys.stdout.buffer, sys.stderr.buffer
    procs: list[subprocess.Popen[bytes]] = []
    relays: list[threading.Thread] = []
    for local_rank in range(args.nproc_per_node):
        proc = subprocess.Popen(
            entry,
            env=rank_env(dict(os.environ), args, local_rank),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        procs.append(proc)
        prefix = f"[default{local_rank}]:".encode()
        for stream, target in ((proc.stdout, out), (proc.stderr, err)):
            assert stream is not None
            relay = threading.Thread(target=_relay, args=(stream, prefix, target, lock), daemon=True)
            relay.start()
            relays.append(relay)

    failed: tuple[int, int, int] | None = None  # (local rank, exit code, pid) of the first failure
    while failed is None and any(p.poll() is None for p in procs):
        if stopping.is_set():
            break
        for local_rank, proc in enumerate(procs):
            code = proc.poll()
            if code is not None and code != 0:
                failed = (local_rank, code, proc.pid)
                break
        else:
            time.sleep(POLL_S)
    if failed is None and not stopping.is_set():
        # every rank ended: one that failed in the last interval still counts
        failed = next(((i, p.returncode, p.pid) for i, p in enumerate(procs) if p.returncode != 0), None)
    if failed is not None:
        local_rank, code, pid = failed
        print(f"plain_launcher: failed (exitcode: {code}) local_rank: {local_rank} (pid: {pid})", file=sys.stderr)
    if stopping.is_set():
        # The agent signalled the ranks too and SIGKILLs what is left after the job's own grace:
        # a rank writing its last checkpoint gets all of it.
        for proc in procs:
            proc.wait()
    else:
        _stop(procs)
    for relay in relays:
        relay.join(timeout=5)
    if failed is not None and not stopping.is_set():
        local_rank, code, pid = failed
        rank = args.node_rank * args.nproc_per_node + local_rank
        print(
            "Root Cause (first observed failure):\n"
            f"[0]:\n  rank      : {rank} (local_rank: {local_rank})\n  exitcode  : {code} (pid: {pid})",
            file=sys.stderr,
            flush=True,
        )
        return 1
    if stopping.is_set():
        return 128 + signal.SIGTERM
    return 0


if __name__ == "__main__":
    sys.exit(main())
