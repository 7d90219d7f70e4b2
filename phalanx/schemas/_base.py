"""What every schema module shares: strict request bodies, the name rule, and text PostgreSQL can
store."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict

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


class StrictModel(BaseModel):
    """A body a person or a program writes: unknown fields are refused, not ignored, and so are
    infinite and NaN numbers (JSON has no literal for them: a spec holding one could not be stored)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
