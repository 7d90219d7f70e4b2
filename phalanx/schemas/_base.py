"""What every schema module shares: the base models, the name rule, text PostgreSQL can store, and
how a metric value that JSON cannot write (NaN, ±Infinity) travels."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, PlainValidator, WithJsonSchema
from pydantic_core import PydanticCustomError

from phalanx import _wire

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
# PostgreSQL's text cannot hold NUL (U+0000). A string that is stored or compared in a query carries
# this pattern (or a stricter one), so a NUL is refused with 422 naming the field, not failed at
# the insert; text a program printed is kept instead (`PrintedText`).
NUL_FREE = r"^[^\x00]*$"


def _nul_replaced(text: str) -> str:
    return text.replace("\x00", "\ufffd") if "\x00" in text else text


# A line or message a training program printed: its NUL bytes become U+FFFD (what a terminal
# would show as a replacement character), so the line is stored instead of the batch refused.
PrintedText = Annotated[str, AfterValidator(_nul_replaced)]


class WireModel(BaseModel):
    """Every model that crosses the wire. A non-finite float is written as the string "NaN",
    "Infinity" or "-Infinity" (pydantic's default, null, would lose which one it was and fail a
    reader that expects a number)."""

    model_config = ConfigDict(ser_json_inf_nan="strings")


class StrictModel(WireModel):
    """A body a person or a program writes: unknown fields are refused, not ignored, and so are
    infinite and NaN numbers (JSON has no literal for them: a spec holding one could not be stored);
    a metric value (`MetricValue`) is the exception, on purpose."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


METRIC_VALUE_PROBLEM = 'a metric value is a number, or one of the strings "NaN", "Infinity", "-Infinity"'


def _metric_value(value: Any) -> float:
    # Called per value of every metric batch: the common case (a float) returns first.
    if type(value) is float:
        return value  # NaN and infinities included: JSON's NaN/Infinity tokens, or Python's floats
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            raise PydanticCustomError("metric_value", "an integer too large for a float (past 1.8e308)") from None
    if isinstance(value, str) and value in _wire.TOKENS:
        return _wire.TOKENS[value]
    raise PydanticCustomError("metric_value", METRIC_VALUE_PROBLEM)


# A reported value: any float, NaN and ±Infinity included (a diverged loss is worth seeing). JSON
# has no literal for those, so they travel as the strings "NaN", "Infinity", "-Infinity"; every
# answer writes them so, and requests may use those strings or the NaN/Infinity tokens of Python's
# json module. Any other string is refused.
MetricValue = Annotated[
    float,
    PlainValidator(_metric_value),
    WithJsonSchema(
        {
            "anyOf": [{"type": "number"}, {"enum": list(_wire.TOKENS)}],
            "description": "A number; NaN and the infinities as the strings 'NaN', 'Infinity', '-Infinity'.",
        }
    ),
]
