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
DEFAULT_PG_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class RuntimeEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    hparams: dict[str, Any] = field(default_factory=dict)
    precision: str = "32"
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

    raw_hparams = env.get("PHALANX_HPARAMS", "").strip()
    hparams: dict[str, Any] = {}
    if raw_hparams:
        try:
            parsed = json.loads(raw_hparams)
        except json.JSONDecodeError as exc:
            raise ValueError(f"PHALANX_HPARAMS is not valid JSON: {exc}") from None
        if not isinstance(parsed, dict):
            raise ValueError('PHALANX_HPARAMS must be a JSON object such as {"lr": 0.05}')
        hparams = parsed

    precision = env.get("PHALANX_PRECISION", "").strip() or "32"
    if precision not in PRECISIONS:
        raise ValueError(f"PHALANX_PRECISION={precision!r} is not one of {', '.join(PRECISIONS)}")

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
        pg_timeout_s=pg_timeout_s,
        url=url,
        token=env.get("PHALANX_TOKEN") or None,
        job_id=_int(env, "PHALANX_JOB_ID", None),
        allocation_id=allocation_id,
        attempt=_required_int(env, "PHALANX_ATTEMPT", 0),
    )
