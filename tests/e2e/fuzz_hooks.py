"""Schemathesis hooks for tests/e2e/test_fuzz_openapi.py, loaded by the `schemathesis run` it
starts (SCHEMATHESIS_HOOKS). They keep a fuzzed request from stalling or crippling the run, never
from reaching the server: a valid long-poll `wait` is cut to a moment (a case could hold a request
for 300 s; out-of-range ones still go as they are), and DELETE /tokens/{id} is turned away from the
tokens the run authenticates with. Values arrive here serialized (strings) or not, by phase."""

from __future__ import annotations

import math
import os
from typing import Any

import schemathesis

LONG_POLL_S = 0.05
MAX_WAIT_S = 300
MAX_ROW_ID = 2**31 - 1
PROTECTED_TOKENS = frozenset(int(i) for i in os.environ.get("PHALANX_FUZZ_PROTECTED_TOKENS", "").split(",") if i)


def number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        parsed = float(value)
    except ValueError:
        return None
    return parsed if math.isfinite(parsed) else None


@schemathesis.hook
def before_call(context: schemathesis.HookContext, case: schemathesis.Case, kwargs: dict[str, Any]) -> None:
    wait = number((case.query or {}).get("wait"))
    if wait is not None and LONG_POLL_S < wait <= MAX_WAIT_S:
        case.query["wait"] = LONG_POLL_S
    if number((case.path_parameters or {}).get("token_id")) in PROTECTED_TOKENS:
        case.path_parameters["token_id"] = MAX_ROW_ID
