"""On-demand profiles on a rank (`phalanx jobs profile`): when the server asks, record
torch.profiler traces of the next N optimizer steps and send them, gzipped, to the server.

The request arrives in the answer to a metric batch, on the metrics thread, which only notes it.
The training thread starts the profiler at its next optimizer step (a global optimizer step
post-hook, as the communication figures use), lets one step warm up, records N, and writes the
Chrome trace to a temporary file; a thread of its own gzips and sends it, so the training loop pays
for the recording and the export only. Between profiles the hook costs an attribute read per step.

A rank answers each profile once: its trace, or why it has none (the profiler was already running,
the export failed, the server refused the size). A request seen again (every batch's answer
carries it until every rank has answered) is ignored.
"""

from __future__ import annotations

import contextlib
import gzip
import logging
import os
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

logger = logging.getLogger("phalanx.train")

WARMUP_STEPS = 1  # the profiler's own start-up lands in this step, which the trace leaves out
# Sends the trace (or, with bytes None, the reason in the str); raises when the server refuses it.
Send = Callable[[int, bytes | None, str | None], None]


class OnDemandProfiler:
    def __init__(self, send: Send, device_type: str) -> None:
        self._send = send
        self._device_type = device_type
        self._order: tuple[int, int] | None = None  # (profile id, steps), set by the metrics thread
        self._seen: set[int] = set()
        self._profiler: torch.profiler.profile | None = None
        self._profile_id = 0
        self._steps_left = 0
        self._trace_file = ""
        self._senders: list[threading.Thread] = []
        self._handle = register_optimizer_step_post_hook(self._on_step)

    def ask(self, profile_id: int, steps: int) -> None:
        """The server's request (any thread); one already seen is ignored."""
        if profile_id not in self._seen:
            self._seen.add(profile_id)
            self._order = (profile_id, steps)

    def _on_step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        profiler = self._profiler
        if profiler is not None:
            profiler.step()
            self._steps_left -= 1
            if self._steps_left <= 0:
                self._stop()
            return
        if self._order is not None:
            profile_id, steps = self._order
            self._order = None
            self._start(profile_id, steps)

    def _start(self, profile_id: int, steps: int) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self._device_type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        fd, self._trace_file = tempfile.mkstemp(prefix=f"phalanx-profile-{profile_id}-", suffix=".json")
        os.close(fd)
        profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=0, warmup=WARMUP_STEPS, active=steps, repeat=1),
            on_trace_ready=self._export,
        )
        try:
            profiler.start()
        except Exception as exc:  # another profiler is running (the script's own), or none is built in
            self._answer(profile_id, None, f"torch.profiler could not start on this rank: {exc}")
            return
        self._profiler, self._profile_id, self._steps_left = profiler, profile_id, WARMUP_STEPS + steps

    def _export(self, profiler: torch.profiler.profile) -> None:
        profiler.export_chrome_trace(self._trace_file)

    def _stop(self) -> None:
        profiler, self._profiler = self._profiler, None
        assert profiler is not None
        error = None
        try:
            profiler.stop()
        except Exception as exc:
            error = f"torch.profiler failed to stop or export: {exc}"
        self._answer(self._profile_id, self._trace_file if error is None else None, error)

    def _answer(self, profile_id: int, trace_file: str | None, error: str | None) -> None:
        sender = threading.Thread(
            target=self._deliver, args=(profile_id, trace_file, error), name="phalanx-profile", daemon=True
        )
        self._senders = [s for s in self._senders if s.is_alive()] + [sender]
        sender.start()

    def _deliver(self, profile_id: int, trace_file: str | None, error: str | None) -> None:
        try:
            trace = None
            if trace_file is not None:
                with open(trace_file, "rb") as raw:
                    trace = gzip.compress(raw.read(), compresslevel=6)
            try:
                self._send(profile_id, trace, error)
            except Exception as exc:
                if trace is None:
                    raise
                # the server refused the trace itself (too large, unreadable): say so instead
                self._send(profile_id, None, f"the trace ({len(trace):,} bytes gzipped) was refused: {exc}")
        except Exception as exc:
            logger.warning("phalanx: could not send profile %d: %s", profile_id, str(exc)[:500])
        finally:
            if trace_file is not None:
                with contextlib.suppress(OSError):
                    os.unlink(trace_file)

    def close(self, timeout: float) -> None:
        """Stop listening; wait (at most `timeout` s) for traces still being sent."""
        self._handle.remove()
        if self._profiler is not None:  # the script ended mid-recording: send the steps recorded
            self._stop()
        for sender in self._senders:
            sender.join(timeout)
