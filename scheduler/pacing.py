"""How soon a scheduling pass may follow the last one.

A pass reads the whole queue: at 10,000 queued jobs it costs ~0.5 s of the worker's core. Every
submission, finished node and freed slot asks for one (coalesced: one waits at a time,
`server.task_queue.PendingPasses`), so a storm of submissions kept the worker in passes back to
back: measured, 0.56 of a core on a 2-core machine while 10,000 held jobs were submitted, taken
from the server and PostgreSQL beside it (`bench/bench_scale.py`).

`PassPacing` decides; `scheduler.tasks.schedule` acts: a pass that took t seconds is followed by a
rest of `rest_ratio` times t (at most `max_rest_s`) before the next one starts, so passes take at most
1 / (1 + rest_ratio) of the core however often they are asked for. A request that comes during
the rest joins the pass that follows it. A pass that is asked for after a quiet while starts at
once: a lone submission is placed as soon as before.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PassPacing:
    rest_ratio: float = 1.0
    max_rest_s: float = 2.0
    not_before: float = 0.0  # monotonic seconds

    def delay(self, now: float) -> float:
        """Seconds until a pass may start, 0 if it may start now."""
        return max(0.0, self.not_before - now)

    def ran(self, began: float, ended: float) -> None:
        """A pass ran from `began` to `ended`."""
        self.not_before = ended + min(max(ended - began, 0.0) * self.rest_ratio, self.max_rest_s)
