"""How a float that JSON cannot write (NaN, +inf, -inf) travels: as the strings "NaN", "Infinity"
and "-Infinity", in both directions (what pydantic writes with `ser_json_inf_nan="strings"`, and
the literals JavaScript's and Python's own float parsers read).

Standard library only: a training rank encodes with it without loading pydantic, the schemas
accept and answer with it, and the server stores it where a column cannot hold NaN (JSON columns;
SQLite turns a bound NaN into NULL).
"""

from __future__ import annotations

import math
from typing import Any

NAN, POSITIVE_INFINITY, NEGATIVE_INFINITY = "NaN", "Infinity", "-Infinity"
TOKENS: dict[str, float] = {NAN: math.nan, POSITIVE_INFINITY: math.inf, NEGATIVE_INFINITY: -math.inf}


def token(value: float) -> str:
    """The token of a non-finite float."""
    if value != value:
        return NAN
    return POSITIVE_INFINITY if value > 0 else NEGATIVE_INFINITY


def encode(value: float) -> float | str:
    """`value` as JSON can carry it: itself when finite, else its token."""
    return value if math.isfinite(value) else token(value)


def decode(value: float | int | str) -> float:
    """A float from `encode`'s output (or a number JSON parsed). Raises ValueError for any other string."""
    if isinstance(value, str):
        try:
            return TOKENS[value]
        except KeyError:
            raise ValueError(f"{value!r} is neither a number nor one of {', '.join(TOKENS)}") from None
    return float(value)


def encode_floats(data: Any) -> Any:
    """`data` (dicts, lists, tuples of JSON values) with every non-finite float replaced by its token."""
    if isinstance(data, float):
        return encode(data)
    if isinstance(data, dict):
        return {key: encode_floats(value) for key, value in data.items()}
    if isinstance(data, list | tuple):
        return [encode_floats(value) for value in data]
    return data
