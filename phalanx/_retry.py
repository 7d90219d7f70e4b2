"""The retry policy of everything that talks to the server: which answers are worth retrying, and
how long to wait before the next try.

Standard library only: `phalanx.train`'s metric thread schedules its retries with `backoff_delay`
without loading the HTTP stack (a script run outside Phalanx never sends anything). The transport
(`phalanx._transport`) applies the same policy to exceptions and, through tenacity, to blocking calls.
"""

from __future__ import annotations

import random

# Worth retrying besides 5xx: a proxy timed out (408), the server is not ready (425) or is
# shedding load (429). Any other 4xx answers the same on every try.
RETRYABLE_STATUSES = frozenset({408, 425, 429})
INITIAL_BACKOFF_S = 0.2
MAX_BACKOFF_S = 5.0
# The ranks' metric batches back off further (`phalanx.train._metrics`): nobody waits on them, each
# is large, and every rank of every job sends them to a server that may be struggling already.
METRICS_MAX_BACKOFF_S = 30.0
# The longest `Retry-After` obeyed: a proxy's or a confused server's hour must not silence an agent
# or a rank for that long.
MAX_RETRY_AFTER_S = 60.0


def is_retryable_status(status: int) -> bool:
    return status >= 500 or status in RETRYABLE_STATUSES


def backoff_delay(failures: int, maximum: float = MAX_BACKOFF_S) -> float:
    """Seconds to wait after `failures` consecutive failures (1 or more): doubling from
    `INITIAL_BACKOFF_S`, capped at `maximum`, jittered to between half and all of it so that the
    ranks and agents that lost the server together do not come back in lock-step."""
    exponent = min(max(failures, 1) - 1, 32)  # past any cap already; keeps 2**n small
    return min(maximum, INITIAL_BACKOFF_S * 2.0**exponent) * random.uniform(0.5, 1.0)


def retry_after_s(header: str | None) -> float | None:
    """The wait a `Retry-After` header asks for, in seconds (at most `MAX_RETRY_AFTER_S`); None
    when there is none or it is not a number of seconds (an HTTP date is not obeyed)."""
    value = (header or "").strip()
    if not value.isascii() or not value.isdigit() or len(value) > 10:
        return None
    return min(float(value), MAX_RETRY_AFTER_S)


def retry_delay(failures: int, retry_after: float | None, maximum: float = MAX_BACKOFF_S) -> float:
    """`backoff_delay`, but never sooner than the server's `Retry-After` asked: the server sheds
    load with it (429 when busy), and a client that comes back early only adds to that load."""
    delay = backoff_delay(failures, maximum)
    return delay if retry_after is None else max(delay, retry_after)
