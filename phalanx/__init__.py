"""Phalanx: what users import. `Client` (the SDK) and the wire schemas load lazily, so that
`import phalanx.train` inside a training script costs torch and nothing more."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from phalanx.client import ApiError, Client
    from phalanx.schemas import JobSpec

__all__ = ["ApiError", "Client", "JobSpec"]


def __getattr__(name: str) -> Any:
    if name in ("Client", "ApiError"):
        from phalanx import client

        return getattr(client, name)
    if name == "JobSpec":
        from phalanx.schemas import JobSpec

        return JobSpec
    raise AttributeError(f"module 'phalanx' has no attribute {name!r}")
