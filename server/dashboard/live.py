"""Live updates: Server-Sent Event streams fed by the wake-up channels (Redis pub/sub, or the
data dir's inotify watch in the embedded mode)."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter(include_in_schema=False)
