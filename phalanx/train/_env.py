"""What a training process learns from its environment (set by torchrun and the Phalanx agent)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Mirrors phalanx.schemas.Precision; duplicated so that importing phalanx.train does not pull in
# pydantic (a test checks that the two agree).
PRECISIONS = ("32", "bf16-mixed", "fp16-mixed")
# Mirrors phalanx.schemas.DdpOptions (its defaults; the agent sends every field, validated).
DDP_DEFAULTS: dict[str, Any] = {
    "comm_hook": "none",
    "powersgd_rank": 1,
    "powersgd_start_iter": 10,
    "bucket_cap_mb": None,
    "gradient_as_bucket_view": False,
    "static_graph": False,
    "timing": True,
}
COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")
DEFAULT_PG_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class RuntimeEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    hparams: dict[str, Any] = field(default_factory=dict)
    precision: str = "32"
    ddp: dict[str, Any] = field(default_factory=lambda: dict(DDP_DEFAULTS))
    pg_timeout_s: float = DEFAULT_PG_TIMEOUT_S
    url: str | None = None
    token: str | None = None
    job_id: int | None = None
    allocation_id: int | None = None
    attempt: int = 0

    @property
    def managed(self) -> bool:
        """True when the Phalanx agent launched this process (metrics then go to the server)."""
        return self.allocation_id is not None


def _int(env: Mapping[str, str], name: str, default: int | None) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def _required_int(env: Mapping[str, str], name: str, default: int) -> int:
    value = _int(env, name, default)
    assert value is not None  # a default was given
    return value


def read_env(env: Mapping[str, str] | None = None) -> RuntimeEnv:
    """Parse the environment contract; raises ValueError with the offending variable's name."""
    env = os.environ if env is None else env

    world_size = _required_int(env, "WORLD_SIZE", 1)
    if world_size < 1:
        raise ValueError(f"WORLD_SIZE={world_size} must be at least 1")
    if world_size > 1 and "RANK" not in env:
        raise ValueError("WORLD_SIZE > 1 but RANK is unset: launch the script with torchrun")
    rank = _required_int(env, "RANK", 0)
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} is outside 0..{world_size - 1}")
    local_rank = _required_int(env, "LOCAL_RANK", 0)

    hparams = _json_object(env, "PHALANX_HPARAMS", '{"lr": 0.05}') or {}

    precision = env.get("PHALANX_PRECISION", "").strip() or "32"
    if precision not in PRECISIONS:
        raise ValueError(f"PHALANX_PRECISION={precision!r} is not one of {', '.join(PRECISIONS)}")

    ddp = _ddp_options(_json_object(env, "PHALANX_DDP", '{"comm_hook": "bf16"}'))

    raw_timeout = env.get("PHALANX_PG_TIMEOUT", "").strip()
    pg_timeout_s = DEFAULT_PG_TIMEOUT_S
    if raw_timeout:
        try:
            pg_timeout_s = float(raw_timeout)
        except ValueError:
            raise ValueError(f"PHALANX_PG_TIMEOUT={raw_timeout!r} is not a number of seconds") from None
        if pg_timeout_s <= 0:
            raise ValueError(f"PHALANX_PG_TIMEOUT={raw_timeout!r} must be positive")

    allocation_id = _int(env, "PHALANX_ALLOCATION_ID", None)
    url = env.get("PHALANX_URL", "").strip().rstrip("/") or None
    if allocation_id is not None and url is None:
        raise ValueError("PHALANX_ALLOCATION_ID is set but PHALANX_URL is not: metrics would have nowhere to go")

    return RuntimeEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        hparams=hparams,
        precision=precision,
        ddp=ddp,
        pg_timeout_s=pg_timeout_s,
        url=url,
        token=env.get("PHALANX_TOKEN") or None,
        job_id=_int(env, "PHALANX_JOB_ID", None),
        allocation_id=allocation_id,
        attempt=_required_int(env, "PHALANX_ATTEMPT", 0),
    )


def _json_object(env: Mapping[str, str], name: str, example: str) -> dict[str, Any] | None:
    """The JSON object in variable `name`; None when it is unset or empty."""
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"{name} must be a JSON object such as {example}")
    return parsed


def _ddp_options(given: dict[str, Any] | None) -> dict[str, Any]:
    """PHALANX_DDP (the job's `ddp` options) over the defaults; set by hand outside Phalanx, it
    is checked here as the job schema would."""
    options = dict(DDP_DEFAULTS)
    if given is None:
        return options
    unknown = sorted(set(given) - set(DDP_DEFAULTS))
    if unknown:
        raise ValueError(f"PHALANX_DDP: unknown option(s) {', '.join(unknown)}; known: {', '.join(DDP_DEFAULTS)}")
    options.update(given)
    if options["comm_hook"] not in COMM_HOOKS:
        raise ValueError(f"PHALANX_DDP: comm_hook={options['comm_hook']!r} is not one of {', '.join(COMM_HOOKS)}")
    for name in ("powersgd_rank", "powersgd_start_iter"):
        if isinstance(options[name], bool) or not isinstance(options[name], int) or options[name] < 1:
            raise ValueError(f"PHALANX_DDP: {name}={options[name]!r} must be a positive integer")
    cap = options["bucket_cap_mb"]
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int | float) or cap <= 0):
        raise ValueError(f"PHALANX_DDP: bucket_cap_mb={cap!r} must be a positive number of MiB")
    for name in ("gradient_as_bucket_view", "static_graph", "timing"):
        if not isinstance(options[name], bool):
            raise ValueError(f"PHALANX_DDP: {name}={options[name]!r} must be true or false")
    return options
