"""The floor under `bench_scale`'s latencies: the same HTTP server as `phalanx server` (uvicorn,
the same listen queue) with an app that answers every request 204 and does nothing else.

    python bench/floor_server.py --port PORT

Timed from the probe beside the heartbeats, its round trip is what any call to a Python server
costs on the machine as loaded at that moment (the kernel's run queue, the probe's own loop):
a heartbeat's latency above it is the server's own.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import uvicorn
from starlette.types import Receive, Scope, Send

from stack.commands import LISTEN_BACKLOG


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 204, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", backlog=LISTEN_BACKLOG)


if __name__ == "__main__":
    main()
