"""Waiting out gloo's worker threads before the interpreter shuts down.

A gloo process group runs each collective on a worker thread of its own (`pt_gloo_runloop`).
After a collective completes, and after its waiter has moved on, that thread still holds the
finished work for a moment and then drops it, and with it the tensors it all-reduced. A tensor
that Python ever saw (a PowerSGD factor, `should_stop()`'s flag) has a Python object, and
dropping it takes the GIL. Once the interpreter has begun to finalize, CPython 3.11 answers that
with `pthread_exit`, whose unwinding through the work's destructor ends in `std::terminate`:
the rank dies with SIGABRT ("terminate called without an active exception") after a run that
succeeded. On a loaded machine a worker thread can wait tens of milliseconds for a core between
completing a collective and dropping it (measured: 5 of 40 two-rank runs aborted this way with
two busy loops beside them).

`destroy_process_group()` does not stop those threads while anything still holds the group (a
DDP model does), so `Context.finish` waits here until each of them is idle: blocked, and still
blocked after a pause in which the GIL was free to take.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

GLOO_WORKER_NAME = "pt_gloo_runloop"
_TASKS = Path("/proc/self/task")


def wait_for_idle_gloo_workers(timeout: float, pause: float = 0.002) -> bool:
    """Return once every gloo worker thread of this process is idle, True; False after
    `timeout` seconds (a collective still under way, say a peer that died), or where /proc is
    not there to tell (not Linux), at once."""
    if not _TASKS.is_dir():
        return False
    deadline = time.monotonic() + timeout
    before = _worker_switches()
    while True:
        time.sleep(pause)  # the GIL is free: a worker waiting for it takes it and moves on
        after = _worker_switches()
        if before is not None and after is not None and before == after:
            return True
        if time.monotonic() >= deadline:
            return False
        before = after


def _worker_switches() -> dict[str, int] | None:
    """Each gloo worker's context switches so far, or None while any of them is not blocked.

    A worker that is blocked and has not switched since the last look stayed blocked while the
    GIL was free: it waits for work (or for a peer), not for the GIL. A runnable worker (state R)
    is on its way to dropping a work."""
    switches: dict[str, int] = {}
    for task in os.listdir(_TASKS):
        try:
            if (_TASKS / task / "comm").read_text().strip() != GLOO_WORKER_NAME:
                continue
            status = (_TASKS / task / "status").read_text()
        except OSError:  # the thread ended between the listing and the read
            continue
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        if not fields.get("State", "").startswith(("S", "D")):
            return None
        switches[task] = int(fields.get("voluntary_ctxt_switches", "0")) + int(
            fields.get("nonvoluntary_ctxt_switches", "0")
        )
    return switches
