"""Counting the SQL statements a piece of code sends: the tests that say a list costs the same
number of queries however many rows it shows."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import event

from server.db import engine_for


@dataclass
class Statements:
    count: int = 0


@contextmanager
def counting(url: str) -> Iterator[Statements]:
    """Counts the statements sent on `engine_for(url)` (the engine `create_app`'s sessions use)
    while the block runs."""
    seen = Statements()

    def before_cursor_execute(*_: Any) -> None:
        seen.count += 1

    engine = engine_for(url)
    event.listen(engine, "before_cursor_execute", before_cursor_execute)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", before_cursor_execute)
