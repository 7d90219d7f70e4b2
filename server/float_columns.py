"""Column types that keep NaN and the infinities, which training legitimately reports.

PostgreSQL's double precision stores them, but its json and jsonb refuse them (JSON has no such
literal), and SQLite stores a bound NaN as NULL. So a JSON column of metric values holds them as
their wire strings ("NaN", "Infinity", "-Infinity", `phalanx._wire`), and on SQLite a metric's
NaN is the text 'NaN' (a REAL column keeps text that is not a number as text). Both read back as
floats through these types; raw SQL over them must decode the same way (`phalanx._wire.decode`).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, Dialect, Float
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.types import TypeDecorator, TypeEngine

from phalanx import _wire


class MetricFloat(TypeDecorator[float]):
    """A double that keeps NaN on SQLite too."""

    impl = Float
    cache_ok = True

    def process_bind_param(self, value: float | None, dialect: Dialect) -> float | str | None:
        if dialect.name == "sqlite" and value is not None and value != value:
            return _wire.NAN
        return value

    def process_result_value(self, value: Any, dialect: Dialect) -> float | None:
        return _wire.decode(value) if isinstance(value, str) else value


def _decode(data: Any) -> Any:
    if isinstance(data, dict):
        return {key: _wire.decode(value) if isinstance(value, str) else value for key, value in data.items()}
    if isinstance(data, list):
        return [_wire.decode(value) if isinstance(value, str) else value for value in data]
    return data


class FloatsJSON(TypeDecorator[Any]):
    """JSON holding floats only (an object of them, or an array), non-finite ones included.
    `binary`: JSONB on PostgreSQL (it has equality, so rows holding it can be selected DISTINCT)."""

    # None is SQL NULL, as when the column is left out (a JSON null would defeat `IS NULL`, and
    # jsonb's || appends to it instead of merging)
    impl = JSON(none_as_null=True)
    cache_ok = True

    def __init__(self, binary: bool = False) -> None:
        super().__init__()
        self.binary = binary

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if self.binary and dialect.name == "postgresql":
            return dialect.type_descriptor(JSONB(none_as_null=True))
        return dialect.type_descriptor(JSON(none_as_null=True))

    def process_bind_param(self, value: Any, dialect: Dialect) -> Any:
        return _wire.encode_floats(value)

    def process_result_value(self, value: Any, dialect: Dialect) -> Any:
        return _decode(value)
